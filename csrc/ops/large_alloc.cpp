#include "ops/large_alloc.h"

#include <c10/util/accumulate.h>

#include <cstdlib>
#include <string>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace kt {

namespace {

// KT_OPS_HUGE_PAGES=0 turns the huge-page buffers off (plain at::empty).
bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KT_OPS_HUGE_PAGES");
    return !(env && std::string(env) == "0");
  }();
  return enabled;
}

}  // namespace

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
#ifdef __linux__
  const size_t bytes = c10::multiply_integers(sizes) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (options.device().is_cpu() && bytes >= kHugePageMinBytes && huge_pages_enabled()) {
    constexpr size_t kHugePage = size_t(2) << 20;
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, rounded) == 0) {
      madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure leaves normal pages
      return at::from_blob(p, sizes, [](void* q) { std::free(q); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

at::Tensor empty_large_like(const at::Tensor& t) { return empty_large(t.sizes(), t.options()); }

}  // namespace kt
