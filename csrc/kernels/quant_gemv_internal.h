// Pieces of the decode GEMV (quant_gemv.h) shared by its AVX2 kernels (quant_gemv.cpp) and its
// AVX-512 kernels (quant_gemv_avx512.cpp): scratch buffers, the MXCSR guard, scale loads, and
// the rare cases both leave to the same code (fp8 bands whose scaled x would overflow, the
// columns after the last whole 32-column step, rows holding an fp8 NaN code).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "platform/cpu_isa.h"
#include "kernels/expert_weights.h"
#include "platform/simd.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace qgemv {

// A buffer of n values on a 64-byte boundary: the kernels' loads of x never straddle a cache
// line (std::vector's 16-byte alignment made every other 32-byte load straddle one: 25% slower
// fp8 / int4 GEMVs in half the calls, depending on where malloc put the buffer).
template <typename T>
class AlignedArray {
 public:
  explicit AlignedArray(int64_t n)
      : data_(static_cast<T*>(std::aligned_alloc(64, (std::max<int64_t>(n, 1) * sizeof(T) + 63) / 64 * 64))) {
    TORCH_CHECK(data_ != nullptr, "quant_gemv_nt: out of memory");
  }
  ~AlignedArray() { std::free(data_); }
  AlignedArray(const AlignedArray&) = delete;
  AlignedArray& operator=(const AlignedArray&) = delete;
  T* data() { return data_; }
  const T* data() const { return data_; }

 private:
  T* data_;
};
using AlignedFloats = AlignedArray<float>;

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

// The group scales s0.. s0 + groups of a row as float32 (bf16 ones converted into buffer), so
// that each group's scale is one broadcast load (the int4 kernels). Plain C++ on purpose: it is
// inlined into each kernel, whose target attribute vectorizes the loop at that path's width.
template <bool Bf16>
__attribute__((always_inline)) inline const float* row_scales(const void* scales, int64_t s0, int64_t groups,
                                                             float* buffer) {
  if constexpr (!Bf16) {
    return static_cast<const float*>(scales) + s0;
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(scales) + s0;
    for (int64_t g = 0; g < groups; ++g) buffer[g] = simd::bf16_to_float(src[g]);
    return buffer;
  }
}

// The group scales of a 128-column step's 16 sum lanes, lane i holding columns 8i .. 8i+7 (the
// AVX-512 int4 kernels on bf16 x): four groups of 32, two of 64 or one of 128; s: the row's
// scales, c: the step's first column.
template <int G>
KT_TARGET_AVX512 inline __m512 step_lane_scales(const float* s, int64_t c) {
  if constexpr (G == 32) {
    alignas(64) static constexpr int32_t kQuads[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
    return _mm512_permutexvar_ps(_mm512_load_si512(kQuads), _mm512_castps128_ps512(_mm_loadu_ps(s + c / 32)));
  } else if constexpr (G == 64) {
    return _mm512_insertf32x8(_mm512_set1_ps(s[c / 64]), _mm256_set1_ps(s[c / 64 + 1]), 1);
  } else {
    return _mm512_set1_ps(s[c / G]);
  }
}

// 16-bit block floating point for the integer kernels (quant_gemv_int16.cpp,
// quant_gemv_int4_vnni.cpp): a group whose largest |x| is `most` is held as x16 = x · 2^-e, the
// largest in [2^14, 2^15). Sets e; false for a group whose largest |x| is below 2^-101
// (e < -115), left to the other kernels since 2^-e must stay a normal float32.
inline bool block_float_exponent(float most, int& e) {
  int exponent = 0;  // most = f · 2^exponent, f in [0.5, 1)
  std::frexp(most, &exponent);
  e = most == 0.f ? 0 : exponent - 15;
  return e >= -115;
}

// 128 columns of 16-bit values (words: 4 vectors of 32, in column order) as their four classes
// mod 4: cls[k] holds columns 4j + k, j = 0 .. 31 (the int4 kernels on bf16 x, whose 16-bit
// words hold 4 nibbles each).
KT_TARGET_AVX512 inline void columns_mod4(const __m512i (&words)[4], __m512i (&cls)[4]) {
  alignas(64) static constexpr uint16_t kEven[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                                     22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                                     44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  alignas(64) static constexpr uint16_t kOdd[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                    23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                    45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i ie = _mm512_load_si512(kEven), io = _mm512_load_si512(kOdd);
  const __m512i even_lo = _mm512_permutex2var_epi16(words[0], ie, words[1]);
  const __m512i odd_lo = _mm512_permutex2var_epi16(words[0], io, words[1]);
  const __m512i even_hi = _mm512_permutex2var_epi16(words[2], ie, words[3]);
  const __m512i odd_hi = _mm512_permutex2var_epi16(words[2], io, words[3]);
  cls[0] = _mm512_permutex2var_epi16(even_lo, ie, even_hi);  // columns 4j
  cls[1] = _mm512_permutex2var_epi16(odd_lo, ie, odd_hi);    // 4j + 1
  cls[2] = _mm512_permutex2var_epi16(even_lo, io, even_hi);  // 4j + 2
  cls[3] = _mm512_permutex2var_epi16(odd_lo, io, odd_hi);    // 4j + 3
}

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

// int8: columns first_column.. K - 1 (those after the kernel's last whole step) added to every
// row of out.
void int8_tail_columns(const float* x, int64_t M, const WeightMatrix& w, int64_t first_column, float* out);

// How far ahead of the rows being decoded the float int4 GEMVs prefetch the weight stream (fp8,
// int8 and the int4 VNNI GEMV: kBytePrefetchAheadBytes below). On an Intel Xeon (Sapphire Rapids class, KVM) the
// hardware prefetchers alone left a one-thread int4 GEMV reading 3.5 GB/s from memory (6.9 G
// weights/s; 17 from cache); prefetching 2 KB ahead made it 15 (benchmarks.quant_gemv --rows 1;
// 1 KB ahead: 14, 4-8 KB: 13-15). Zen 4's hardware prefetcher had followed the single row
// stream by itself.
constexpr int64_t kPrefetchAheadBytes = 2048;

// The fp8 / int8 GEMVs (a byte a value) prefetch 4 KB ahead into L2 (prefetch_into_l2). On Zen 4
// (one thread, 1 row, [768, 2048] experts from memory) that read fp8 at 15.2-15.3 G weights/s
// and int8 at 17.1-17.2 where 2 KB into L1 had read 12.3-12.7 and 11.9-12.4 (AVX-512 kernels;
// the AVX2 ones 14.3-14.7 / 13.4-15.9 -> 14.7 / 16.4). Into L2 at 2 KB alone read int8 at
// 13.1-14.2; 4 KB into L1 alone at 12.6 (one run).
// The float int4 kernels keep 2 KB into L1: 4 KB took one from 19 to 18 G weights/s at 2 rows.
// The int4 VNNI kernel (quant_gemv_int4_vnni.cpp) takes 4 KB into L2: on the Intel Xeon with AMX
// its decode got 4-6% faster than with 2 KB into L1 (benchmarks/RESULTS.md).
constexpr int64_t kBytePrefetchAheadBytes = 4096;

// The first row to prefetch while rows r.. are decoded: at least `pass` rows (the next pass)
// and at least `bytes` ahead.
inline int64_t prefetch_ahead_rows(int64_t ld, int64_t pass, int64_t bytes = kPrefetchAheadBytes) {
  return std::max<int64_t>(pass, (bytes + ld - 1) / ld);
}

// The byte GEMVs' prefetch (kBytePrefetchAheadBytes).
inline void prefetch_into_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// The cache lines at bytes [begin, end) of a row (those whose offset from the row's start is a
// multiple of 64), prefetched: a kernel walking a row calls it once per step with the step's
// bytes, so each line of the row ahead is prefetched once.
inline void prefetch_lines(const uint8_t* row, int64_t begin, int64_t end) {
  for (int64_t o = (begin + 63) & ~int64_t(63); o < end; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row + o), _MM_HINT_T0);
  }
}

// Weight rows per pass and FMA chains per (x row, weight row), by x rows: at least 8
// accumulators (two FMA units of 4 cycles) within AVX2's 16 registers (AVX-512's 32 hold them
// with room to spare).
template <int M>
constexpr int kRowsPerPass = M == 1 ? 1 : M == 2 ? 4 : 2;
template <int M>
constexpr int kPassChains = M == 1 ? 4 : 1;

// Chains of per-group totals per x row, by x rows, for the kernels that add one FMA per group
// (the float int4 kernels, quant_gemv_int16.cpp's int4 and int8): fewer chains for more rows
// keep every accumulator in a register.
template <int M>
constexpr int kTotalChains = M == 1 ? 4 : M == 2 ? 2 : 1;

struct UnitScale {
  float operator()(int64_t) const { return 1.f; }
};

// Rows r0..r1 of w (fp8 / int8, one byte per value), kRowsPerPass<M> at a time (the rest one by
// one) through Pass::run<M, RJ, C>(x, K, K32, rows, ld, ahead, prefetch_rows, sums, &nan): the
// dot products of RJ rows with the M rows of x over the first K32 columns (whole 32-column
// steps), prefetch_rows rows from `ahead` (prefetch_ahead_rows) prefetched as they go, *nan set
// for a NaN code (fp8). Then
// out[m, r] = row_scale(r) · sums; NaN rows flagged in nan_rows (all rows of the pass) when it
// is not null. Pass is an instruction set's kernel (quant_gemv.cpp, quant_gemv_avx512.cpp).
template <class Pass, int M, class RowScale>
void dot_row_range(const float* x, const WeightMatrix& w, int64_t r0, int64_t r1, float* out, uint8_t* nan_rows,
                   const RowScale& row_scale) {
  constexpr int RJ = kRowsPerPass<M>, C = kPassChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), K32 = K / 32 * 32;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const int64_t ahead = prefetch_ahead_rows(ld, RJ, kBytePrefetchAheadBytes);
  auto prefetch_rows = [&](int64_t r, int64_t rows) { return std::clamp<int64_t>(r1 - (r + ahead), 0, rows); };
  int64_t r = r0;
  for (; r + RJ <= r1; r += RJ) {
    float sums[M][RJ];
    bool nan = false;
    const int64_t p = prefetch_rows(r, RJ);
    Pass::template run<M, RJ, C>(x, K, K32, base + r * ld, ld, p > 0 ? base + (r + ahead) * ld : nullptr, p, sums,
                                 &nan);
    for (int j = 0; j < RJ; ++j) {
      if (nan_rows != nullptr) nan_rows[r + j] = nan;
      const float s = row_scale(r + j);
      for (int m = 0; m < M; ++m) out[m * R + r + j] = s * sums[m][j];
    }
  }
  for (; r < r1; ++r) {
    float sums[M][1];
    bool nan = false;
    const int64_t p = prefetch_rows(r, 1);
    Pass::template run<M, 1, 4>(x, K, K32, base + r * ld, ld, p > 0 ? base + (r + ahead) * ld : nullptr, p, sums,
                                &nan);
    if (nan_rows != nullptr) nan_rows[r] = nan;
    const float s = row_scale(r);
    for (int m = 0; m < M; ++m) out[m * R + r] = s * sums[m][0];
  }
}

// x [M, K] reordered for the int4 kernels of `lanes` floats per vector: each 2·lanes columns as
// their evens, then their odds (the low, then the high nibbles of `lanes` bytes);
// neg_group_sums[(m · groups + g) · lanes + lane] = minus the sum of x[m] over group g in lanes
// 0-7 and 0 in the others, a vector whose lanes add up to -8 times the group's sum.
void int4_permuted_x(const float* x, int64_t M, int64_t K, int64_t G, int lanes, float* out, float* neg_group_sums);

// ---- one decode GEMV over every format, given an instruction set's Kernels ----------------------
//
// Kernels (Avx2Kernels in quant_gemv.cpp, Avx512Kernels in quant_gemv_avx512.cpp) holds
// Fp8Pass and Int8Pass (dot_row_range passes of its fp8 bit-pattern and int8 decoders), kLanes
// (floats per vector) and int4_groups<M, G, Bf16>(x, neg_sums, w, scale_buffer, out), its int4
// kernel over all rows on int4_permuted_x's x.

// fp8: each 128-row band on x times its blocks' scales times 2^120 (scale_x_by_blocks), or
// through fp16 patterns where that would overflow; then the tail columns and NaN rows.
template <class Kernels, int M, bool Bf16>
void gemv_fp8(const float* x, const WeightMatrix& w, float* out) {
  const int64_t K = w.cols, blocks = w.scale.size(1);
  const void* scales = w.scale.const_data_ptr();
  std::vector<uint8_t> nan_rows(w.rows);
  AlignedFloats xs(M * K);
  std::vector<float> block_scales(blocks);
  {
    const DenormalsAsInputs daz_off;
    for (int64_t r0 = 0; r0 < w.rows; r0 += kFp8Block) {
      const int64_t r1 = std::min(w.rows, r0 + kFp8Block);
      for (int64_t b = 0; b < blocks; ++b) block_scales[b] = load_scale<Bf16>(scales, (r0 / kFp8Block) * blocks + b);
      if (scale_x_by_blocks(x, M, K, block_scales.data(), xs.data())) {
        dot_row_range<typename Kernels::Fp8Pass, M>(xs.data(), w, r0, r1, out, nan_rows.data(), UnitScale{});
      } else {
        fp8_band_through_fp16(x, M, w, r0, r1, out, nan_rows.data());
      }
    }
  }
  if (K % 32 != 0 || std::any_of(nan_rows.begin(), nan_rows.end(), [](uint8_t v) { return v != 0; })) {
    fp8_fixups(x, M, w, nan_rows.data(), out);
  }
}

// int8: every row's dot products times its scale, then the tail columns.
template <class Kernels, int M, bool Bf16>
void gemv_int8(const float* x, const WeightMatrix& w, float* out) {
  const void* scales = w.scale.const_data_ptr();
  dot_row_range<typename Kernels::Int8Pass, M>(x, w, 0, w.rows, out, nullptr,
                                               [scales](int64_t r) { return load_scale<Bf16>(scales, r); });
  int8_tail_columns(x, M, w, w.cols / 32 * 32, out);
}

// int4: x permuted and the group sums once per call, then the kernel for the group size (32,
// 64 or 128) and scale dtype, both compile-time so that a group is straight-line code.
template <class Kernels, int M>
void gemv_int4(const float* x_in, const WeightMatrix& w, float* out) {
  constexpr int L = Kernels::kLanes;
  const int64_t K = w.cols, G = w.group, groups = K / G;
  AlignedFloats x_permuted(M * K), neg_sums(M * groups * L), scale_buffer(groups);
  int4_permuted_x(x_in, M, K, G, L, x_permuted.data(), neg_sums.data());
  const float* x = x_permuted.data();
  const float* n = neg_sums.data();
  float* sb = scale_buffer.data();
  const bool bf16 = bf16_scales(w);
  switch (G) {
    case 32:
      return bf16 ? Kernels::template int4_groups<M, 32, true>(x, n, w, sb, out)
                  : Kernels::template int4_groups<M, 32, false>(x, n, w, sb, out);
    case 64:
      return bf16 ? Kernels::template int4_groups<M, 64, true>(x, n, w, sb, out)
                  : Kernels::template int4_groups<M, 64, false>(x, n, w, sb, out);
    default:
      return bf16 ? Kernels::template int4_groups<M, 128, true>(x, n, w, sb, out)
                  : Kernels::template int4_groups<M, 128, false>(x, n, w, sb, out);
  }
}

// out = x·wᵀ for M rows of x (a compile-time 1..4) on Kernels, any quantized format.
template <class Kernels, int M>
void gemv_rows(const float* x, const WeightMatrix& w, float* out) {
  const bool bf16 = bf16_scales(w);
  switch (w.format) {
    case WeightFormat::kFp8: return bf16 ? gemv_fp8<Kernels, M, true>(x, w, out) : gemv_fp8<Kernels, M, false>(x, w, out);
    case WeightFormat::kInt8:
      return bf16 ? gemv_int8<Kernels, M, true>(x, w, out) : gemv_int8<Kernels, M, false>(x, w, out);
    default: return gemv_int4<Kernels, M>(x, w, out);
  }
}

// fn(m0, std::integral_constant<int, R>{}) for x rows [m0, m0 + R), four at a time (decode
// blocks have at most 4: moe_forward's kGemvMaxRows), R known at compile time for the kernels'
// templates.
template <typename Fn>
void for_row_chunks(int64_t M, const Fn& fn) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: fn(m0, std::integral_constant<int, 1>{}); break;
      case 2: fn(m0, std::integral_constant<int, 2>{}); break;
      case 3: fn(m0, std::integral_constant<int, 3>{}); break;
      default: fn(m0, std::integral_constant<int, 4>{}); break;
    }
  }
}

// out = x·wᵀ for M (1..4) rows of x on the AVX-512 kernels (quant_gemv_avx512.cpp; instantiated
// there for M = 1..4).
template <int M>
void gemv_avx512(const float* x, const WeightMatrix& w, float* out);

// out = x·wᵀ for M rows of x (float32 [M, K]) on an mxfp4 / nvfp4 weight (K a multiple of 32),
// on the AVX-512 kernel or the AVX2 one (quant_gemv_fp4.cpp).
void gemv_fp4(const float* x, int64_t M, const WeightMatrix& w, bool avx512, float* out);

// x [M, K] bf16 (rows ldx apart) in each 128 columns' four classes mod 4 into xp [M, K / 128 *
// 128], and (when sums is not null) the int4 kernel's bias sums (quant_gemv_avx512.cpp).
void bf16_x_mod4(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp, float* sums);

// out = x·wᵀ for M rows of bf16 x (rows ldx apart) on an mxfp4 / nvfp4 weight, on AVX512-BF16
// (quant_gemv_fp4.cpp): each code looked up as the exact bf16 of its value, vdpbf16ps, each
// group's sums times its scale; out [M, R] float32.
void gemv_fp4_bf16(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out);

// out = x·wᵀ for M rows of x (float32 holding bf16 values, [M, K]) on an int4 or int8 weight,
// through AVX2 integer dot products on x as 16-bit block floating point (quant_gemv_int16.cpp).
// False, out untouched, where x holds a NaN, an inf or a group too small for its exponents:
// then the float kernels run.
bool gemv_int16_avx2(const float* x, int64_t M, const WeightMatrix& w, float* out);

// out = x·wᵀ for M rows of bf16 x (rows ldx apart) on an int4 weight, on AVX512-BF16
// (quant_gemv_avx512.cpp): each nibble looked up as the bf16 value q − 8 (exact), multiplied
// with x's bf16 values by vdpbf16ps (x reordered once per call to the lookups' order; exact
// products, float32 sums), each group's sum times its scale; out [M, R] float32.
void gemv_int4_bf16(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out);

// out = x·wᵀ for M rows of bf16 x (rows ldx apart) on an fp8 weight, on AVX512-BF16 with
// AVX512-VBMI (quant_gemv_fp8_bf16.cpp): each code looked up as its exact bf16 value,
// multiplied with x by vdpbf16ps (x reordered once per call to the lookups' order; exact
// products, float32 sums), each 128-column block's sum times its scale; out [M, R] float32.
void gemv_fp8_bf16(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out);

// out = x·wᵀ for M rows of bf16 x (rows ldx apart) on an int4 weight of whole 128-column steps,
// on AVX512-VNNI (quant_gemv_int4_vnni.cpp): x as 16-bit block floating point per 32 columns,
// vpdpwssd on the nibbles, each sum lane scaled once; out [M, R] float32. False, out untouched,
// where x holds a NaN, an inf or a group too small for its exponents: then gemv_int4_bf16 runs.
bool gemv_int4_vnni(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out);

}  // namespace qgemv
}  // namespace kt
