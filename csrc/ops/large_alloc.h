// Large per-call buffers (gradients of stacked expert weights, sorted expert rows) backed by
// transparent huge pages.
//
// These tensors are hundreds of MiB, freshly allocated on every call (autograd hands them
// out as .grad; zero_grad(set_to_none=True) frees them), and glibc serves such sizes with a
// fresh mmap: every 4 KiB page then faults on first write. Measured on the Qwen3-30B-A3B
// layer: a weight-gradient GEMM into fresh memory took 3.05 ms instead of 1.75 ms. With
// madvise(MADV_HUGEPAGE) the kernel maps 2 MiB pages (512x fewer faults): 1.79 ms.
#pragma once

#include <ATen/ATen.h>

namespace kt {

// at::empty(sizes, options), 2 MiB-aligned and advised to use huge pages when the tensor is
// at least kHugePageMinBytes on Linux; a plain at::empty otherwise.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options);

// same shape, dtype and device as t (contiguous)
at::Tensor empty_large_like(const at::Tensor& t);

constexpr size_t kHugePageMinBytes = size_t(8) << 20;

}  // namespace kt
