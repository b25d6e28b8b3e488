// Large per-call buffers (gradients of stacked expert weights, sorted expert rows) mapped
// fresh from the kernel, zero-filled and backed by transparent huge pages.
//
// These tensors are hundreds of MiB and allocated on every call (autograd hands them out as
// .grad; zero_grad(set_to_none=True) frees them). Fresh anonymous memory is zero and only
// committed where it is written: the weight gradients of experts that got no rows need no
// zero fill (it cost ~0.8 s per decode step of the Qwen3-30B-A3B layer, 120 of its 128
// experts idle), and reading them maps the shared zero page. madvise(MADV_HUGEPAGE) makes
// the kernel map 2 MiB pages (512x fewer faults): on 4 KiB pages, faults made a
// weight-gradient GEMM into fresh memory take 3.05 ms instead of 1.75 ms; with huge pages 1.79.
#pragma once

#include <ATen/ATen.h>

namespace kt {

// Zero-filled tensor (contiguous). At least kLargeMinBytes on Linux: a fresh private
// anonymous mapping, 2 MiB aligned, advised to use huge pages; smaller: at::zeros.
at::Tensor zeros_large(at::IntArrayRef sizes, const at::TensorOptions& options);

// Same shape, dtype and device as t.
at::Tensor zeros_large_like(const at::Tensor& t);

constexpr size_t kLargeMinBytes = size_t(8) << 20;

}  // namespace kt
