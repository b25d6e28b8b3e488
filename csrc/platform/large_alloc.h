// Large per-call buffers (weight gradients of stacked experts, saved activations, outputs): 2 MiB
// aligned private anonymous mappings on transparent huge pages, recycled across calls.
//
// These tensors are hundreds of MiB and allocated on every call (autograd hands the weight
// gradients out as .grad; zero_grad(set_to_none=True) frees them). Memory fresh from the
// kernel costs a page fault and a zero fill of every page at its first write: on this
// project's machine a full fine-tuning step of a Qwen3-30B-A3B layer (T=1024, whose weight
// gradients are 1.2 GiB) ran 1.17-1.33x faster with its buffers recycled
// (benchmarks/buffer_reuse.py). So a freed buffer is kept, its pages mapped, and handed to the
// next request of its size or up to a quarter smaller; the longest-idle buffers are unmapped
// when the idle ones exceed a budget.
//
// Huge pages (madvise(MADV_HUGEPAGE)): 512x fewer faults for the fresh mappings; on 4 KiB
// pages (KT_OPS_HUGE_PAGES=0) that step on fresh buffers took 751 ms against 473 ms.
//
// Budget for the idle buffers kept: KT_OPS_BUFFER_CACHE_MB (default a quarter of physical
// memory; 0 keeps none); release_cached_buffers() unmaps them now. KT_OPS_HUGE_PAGES=0 turns
// the huge-page advice off.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace kt {

constexpr size_t kLargeMinBytes = size_t(8) << 20;

// Contiguous tensor with undefined contents: the caller writes every element, or zeroes what
// it does not write with zero_large. At least kLargeMinBytes on Linux: a recycled or fresh
// mapping as above; smaller: at::empty.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options);

// Sets t (contiguous; a whole buffer or a slice of one) to zero. The whole pages of t inside
// a large buffer are handed back to the kernel (MADV_DONTNEED): they read as zeros and take
// no memory until written, so zeroing the gradients of experts that got no rows (most of
// them at decode sizes) costs neither time nor memory. The partial pages at its ends are
// memset, so the neighbouring elements are untouched.
void zero_large(const at::Tensor& t);

// Unmaps every idle buffer kept for reuse.
void release_cached_buffers();

// {idle buffers kept, their bytes}
std::vector<int64_t> cached_buffers_info();

}  // namespace kt
