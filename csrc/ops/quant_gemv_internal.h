// Pieces of the decode GEMV (quant_gemv.h) shared by its AVX2 kernels (quant_gemv.cpp) and its
// AVX-512 kernels (quant_gemv_avx512.cpp): scratch buffers, the MXCSR guard, scale loads, and
// the rare cases both leave to the same code (fp8 bands whose scaled x would overflow, the
// columns after the last whole 32-column step, rows holding an fp8 NaN code).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "ops/cpu_isa.h"
#include "ops/expert_weights.h"
#include "ops/simd.h"

namespace kt {
namespace qgemv {

// A float buffer on a 64-byte boundary: the kernels' loads of x never straddle a cache line
// (std::vector's 16-byte alignment made every other 32-byte load straddle one: 25% slower fp8 /
// int4 GEMVs in half the calls, depending on where malloc put the buffer).
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t n)
      : data_(static_cast<float*>(std::aligned_alloc(64, (std::max<int64_t>(n, 1) * sizeof(float) + 63) / 64 * 64))) {
    TORCH_CHECK(data_ != nullptr, "quant_gemv_nt: out of memory");
  }
  ~AlignedFloats() { std::free(data_); }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  float* data() { return data_; }

 private:
  float* data_;
};

// Denormals are read as zero while MXCSR.DAZ is set (torch.set_flush_denormal(True), which
// kt_ops.finetune sets): the fp8 bit-pattern kernels' subnormal weights are float32 denormals,
// so the bit is cleared for the call and restored after it (this thread's MXCSR only).
class DenormalsAsInputs {
 public:
  DenormalsAsInputs() : saved_(_mm_getcsr()) {
    if (saved_ & kDaz) _mm_setcsr(saved_ & ~kDaz);
  }
  ~DenormalsAsInputs() {
    if (saved_ & kDaz) _mm_setcsr(saved_);
  }
  DenormalsAsInputs(const DenormalsAsInputs&) = delete;
  DenormalsAsInputs& operator=(const DenormalsAsInputs&) = delete;

 private:
  static constexpr unsigned kDaz = 0x0040;
  unsigned saved_;
};

template <bool Bf16>
inline float load_scale(const void* scales, int64_t i) {
  if constexpr (Bf16) {
    return simd::bf16_to_float(static_cast<const uint16_t*>(scales)[i]);
  } else {
    return static_cast<const float*>(scales)[i];
  }
}

inline bool bf16_scales(const WeightMatrix& w) { return w.scale.scalar_type() == at::kBFloat16; }

// xs[m, c] = x[m, c] · scale[c / 128] · 2^120 for the M rows of x. Returns whether every
// |x · scale| < 2^7 (false for a NaN or inf in x): then xs is finite, and so is every partial
// sum of the fp8 bit-pattern kernels (|x · scale · w| < 2^7 · 448 per term).
KT_TARGET_AVX2 bool scale_x_by_blocks(const float* x, int64_t M, int64_t K, const float* block_scales, float* xs);

// fp8 rows r0..r1 of one 128-row band, M (1..4) rows of x, through fp16 bit patterns and a
// partial sum per 128-column block: the bands scale_x_by_blocks refused. Whole 32-column steps;
// flags NaN rows in nan_rows.
void fp8_band_through_fp16(const float* x, int64_t M, const WeightMatrix& w, int64_t r0, int64_t r1, float* out,
                           uint8_t* nan_rows);

// The columns after the last whole 32-column step (K % 32 of them) added to every row, and
// each row flagged in nan_rows recomputed exactly (fp8).
void fp8_fixups(const float* x, int64_t M, const WeightMatrix& w, const uint8_t* nan_rows, float* out);

// int8: the columns after the last whole 32-column step added to every row.
void int8_tail_columns(const float* x, int64_t M, const WeightMatrix& w, float* out);

// out = x·wᵀ for M (1..4) rows of x on the AVX-512 kernels (quant_gemv_avx512.cpp).
void gemv_avx512(const float* x, int64_t M, const WeightMatrix& w, float* out);

}  // namespace qgemv
}  // namespace kt
