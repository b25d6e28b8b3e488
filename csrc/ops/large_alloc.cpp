#include "ops/large_alloc.h"

#include <c10/util/accumulate.h>

#include <cstdlib>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace kt {

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
#ifdef __linux__
  const size_t bytes = c10::multiply_integers(sizes) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (options.device().is_cpu() && bytes >= kHugePageMinBytes) {
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
