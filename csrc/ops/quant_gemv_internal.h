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

// Weight rows per pass and FMA chains per (x row, weight row), by x rows: at least 8
// accumulators (two FMA units of 4 cycles) within AVX2's 16 registers (AVX-512's 32 hold them
// with room to spare).
template <int M>
constexpr int kRowsPerPass = M == 1 ? 1 : M == 2 ? 4 : 2;
template <int M>
constexpr int kPassChains = M == 1 ? 4 : 1;

struct UnitScale {
  float operator()(int64_t) const { return 1.f; }
};

// Rows r0..r1 of w (fp8 / int8, one byte per value), kRowsPerPass<M> at a time (the rest one by
// one) through Pass::run<M, RJ, C>(x, K, K32, rows, ld, prefetch_rows, sums, &nan): the dot
// products of RJ rows with the M rows of x over the first K32 columns (whole 32-column steps),
// the next pass's first prefetch_rows rows prefetched, *nan set for a NaN code (fp8). Then
// out[m, r] = row_scale(r) · sums; NaN rows flagged in nan_rows (all rows of the pass) when it
// is not null. Pass is an instruction set's kernel (quant_gemv.cpp, quant_gemv_avx512.cpp).
template <class Pass, int M, class RowScale>
void dot_row_range(const float* x, const WeightMatrix& w, int64_t r0, int64_t r1, float* out, uint8_t* nan_rows,
                   const RowScale& row_scale) {
  constexpr int RJ = kRowsPerPass<M>, C = kPassChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), K32 = K / 32 * 32;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  int64_t r = r0;
  for (; r + RJ <= r1; r += RJ) {
    float sums[M][RJ];
    bool nan = false;
    // One row at a time is one sequential stream, which the hardware prefetcher follows.
    const int64_t prefetch_rows = RJ > 1 ? std::min<int64_t>(RJ, r1 - r - RJ) : 0;
    Pass::template run<M, RJ, C>(x, K, K32, base + r * ld, ld, prefetch_rows, sums, &nan);
    for (int j = 0; j < RJ; ++j) {
      if (nan_rows != nullptr) nan_rows[r + j] = nan;
      const float s = row_scale(r + j);
      for (int m = 0; m < M; ++m) out[m * R + r + j] = s * sums[m][j];
    }
  }
  for (; r < r1; ++r) {
    float sums[M][1];
    bool nan = false;
    Pass::template run<M, 1, 4>(x, K, K32, base + r * ld, ld, 0, sums, &nan);
    if (nan_rows != nullptr) nan_rows[r] = nan;
    const float s = row_scale(r);
    for (int m = 0; m < M; ++m) out[m * R + r] = s * sums[m][0];
  }
}

// out = x·wᵀ for M (1..4) rows of x on the AVX-512 kernels (quant_gemv_avx512.cpp).
void gemv_avx512(const float* x, int64_t M, const WeightMatrix& w, float* out);

}  // namespace qgemv
}  // namespace kt
