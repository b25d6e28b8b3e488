#include "ops/large_alloc.h"

#include <c10/util/accumulate.h>

#include <cstdlib>
#include <string>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace kt {
namespace {

// KT_OPS_HUGE_PAGES=0 turns the huge-page advice off (fresh mappings stay).
bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KT_OPS_HUGE_PAGES");
    return !(env && std::string(env) == "0");
  }();
  return enabled;
}

}  // namespace

at::Tensor zeros_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
#ifdef __linux__
  const size_t bytes = c10::multiply_integers(sizes) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (options.device().is_cpu() && bytes >= kLargeMinBytes) {
    constexpr size_t kHugePage = size_t(2) << 20;
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    const size_t mapped = rounded + kHugePage;  // slack to align the start to 2 MiB
    void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const uintptr_t start = (reinterpret_cast<uintptr_t>(base) + kHugePage - 1) / kHugePage * kHugePage;
      void* data = reinterpret_cast<void*>(start);
      if (huge_pages_enabled()) madvise(data, rounded, MADV_HUGEPAGE);  // advice: failure is harmless
      return at::from_blob(data, sizes, [base, mapped](void*) { munmap(base, mapped); }, options);
    }
  }
#endif
  return at::zeros(sizes, options);
}

at::Tensor zeros_large_like(const at::Tensor& t) { return zeros_large(t.sizes(), t.options()); }

}  // namespace kt
