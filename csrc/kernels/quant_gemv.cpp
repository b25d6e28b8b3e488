// Kernels of quant_gemv_nt (see quant_gemv.h): the reference loop (dequantize a row, dot it
// with each x row), then the AVX2 kernels, which decode the quantized bytes in registers and
// feed them straight to the FMAs: decode blocks are bound by the work per weight, not by memory
// (the bf16 GEMV streams weights at the bandwidth; a quantized one must decode each value in a
// handful of instructions to go faster than it). Per format:
//   int8: vpmovsxbd + vcvtdq2ps per 8 values; the row's scale applied once at the end;
//   fp8:  bytes sign-extended to 32 bits, shifted and masked into float32 bit patterns (the
//         value / 2^120, subnormals as float32 denormals, read with DAZ cleared); x is
//         multiplied once per 128-row band by its blocks' scales and 2^120, so the weights
//         need no scaling at all. Bands where that would overflow take fp16 bit patterns and
//         vcvtph2ps, one partial sum per 128-column block. NaN codes only detected (a row
//         holding one is recomputed exactly);
//   int4: 8 bytes zero-extended to 32 bits, low and high nibbles converted (q + 8); per group
//         a partial sum starting from -8 · (the group's sum of x), times the group's scale.
// Several FMA chains per x row (4 for one row, 2 for two) so that FMA latency does not bound one
// decode row. No function calls inside the row loops (see gemv_fp8_steps).
#include "kernels/quant_gemv.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "kernels/convert_rows.h"
#include "kernels/dequantize.h"
#include "kernels/quant_gemv_internal.h"
#include "platform/simd.h"
#include "platform/vec.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace {

using qgemv::AlignedFloats;
using qgemv::load_scale;
using qgemv::prefetch_ahead_rows;
using qgemv::prefetch_lines;
using qgemv::prefetch_into_l2;

void gemv_reference(const float* x, int64_t M, const WeightMatrix& w, float* out) {
  std::vector<float> row(w.cols);
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_rows(w, r, 1, row.data(), w.cols, CpuIsa::kPortable);
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < w.cols; ++k) acc += x[m * w.cols + k] * row[k];
      out[m * w.rows + r] = acc;
    }
  }
}

// ---- decoders: consecutive columns -> vectors of 8 floats in column order ---------------------

// fp8, 16 columns: sign-extending a byte to 16 bits and shifting it left by 7 puts the sign at
// bit 15 and the magnitude bits where an fp16's are (value / 2^8, subnormals included), plus a
// copy of the sign at bit 14 that the mask clears.
KT_TARGET_AVX2 inline void decode_fp8x16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i words = _mm256_and_si256(
      _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7),
      _mm256_set1_epi16(int16_t(0xbf80)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(words));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(words, 1));
}

// int4, 16 columns from 8 bytes: each byte zero-extended to 32 bits, its low nibble (even
// column) and high nibble (odd column) converted to float: q + 8 in 0..15. The 8 is
// subtracted per group through the group's sum of x (int4_group of quant_gemv_int4-inl.h). lo
// holds columns 0, 2, .., 14 and hi 1, 3, .., 15: x is permuted alike (int4_permuted_x), the
// dot product unchanged.
// 5 instructions per 16 values, two of them shuffles (the nibble-table decode it replaced
// needed 11 per 32, eight of them shuffles).
KT_TARGET_AVX2 inline void decode_int4(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(0x0f)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
}

KT_TARGET_AVX2 inline __m256 decode_int8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// ---- the AVX2 kernels: out[m, r] for every row r of w, M (1..4) rows of x ([M, K] float32) ----

// FMA chains per x row: 4 for one or two rows, 2 for three or four: at least 8 independent
// chains (two FMA units, 4 cycles each) where the registers allow. Fewer (2 for two rows, 1
// for three or four) left each row's FMAs waiting on each other: the 2- and 4-row decode
// GEMVs ran at about half the FMA rate.
template <int M>
constexpr int kChains = M <= 2 ? 4 : 2;

template <int M>
KT_TARGET_AVX2 inline void store_row(const __m256 (&total)[M], float* out, int64_t R, int64_t r) {
  KT_UNROLL for (int m = 0; m < M; ++m) out[m * R + r] = simd::hsum8(total[m]);
}


// The largest of the 32 bytes at p with their sign bit cleared, folded into `seen`: a row
// holds a NaN code (0x7f, 0xff) exactly when its largest such byte is 0x7f.
KT_TARGET_AVX2 inline __m256i fp8_max_magnitude(const uint8_t* p, __m256i seen) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_max_epu8(seen, _mm256_and_si256(b, _mm256_set1_epi8(0x7f)));
}

KT_TARGET_AVX2 inline bool any_byte_is_0x7f(__m256i v) {
  return _mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(0x7f))) != 0;
}

// fp8 rows r0..r1 through fp16 bit patterns (decode_fp8x16), each 128-column block's partial
// sums times its scale: the path for bands whose scaled x would overflow gemv_fp8_bits'.
// Only whole 32-column steps here and no function call anywhere in the row loop: a call
// (the scalar fp8 decode) made GCC keep the loop-carried NaN detector in memory, a
// store-to-load chain per step that cost 40% of the kernel's speed. The columns after the
// last whole step (rows whose length is not a multiple of 32) and the rows holding a NaN
// code are finished by gemv_fp8_fixups.
template <int M, bool Bf16>
KT_TARGET_AVX2 void gemv_fp8_steps(const float* x, const WeightMatrix& w, int64_t r0, int64_t r1, float* out,
                                   uint8_t* nan_rows) {
  constexpr int C = kChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), blocks = w.scale.size(1);
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = base + r * ld;
    const int64_t s0 = (r / kFp8Block) * blocks;
    __m256 total[M];
    KT_UNROLL for (int m = 0; m < M; ++m) total[m] = _mm256_setzero_ps();
    __m256i magnitude = _mm256_setzero_si256();
    for (int64_t c0 = 0; c0 < K; c0 += kFp8Block) {
      const int64_t end = c0 + std::min(K - c0, kFp8Block) / 32 * 32;
      __m256 part[M][C];
      KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) part[m][j] = _mm256_setzero_ps();
      for (int64_t c = c0; c < end; c += 32) {
        magnitude = fp8_max_magnitude(row + c, magnitude);
        __m256 v[4];
        decode_fp8x16(row + c, v[0], v[1]);
        decode_fp8x16(row + c + 16, v[2], v[3]);
        KT_UNROLL for (int q = 0; q < 4; ++q)
          KT_UNROLL for (int m = 0; m < M; ++m)
            part[m][q % C] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + c + 8 * q), v[q], part[m][q % C]);
      }
      // The decoded values are the weights / 2^8.
      const __m256 sv = _mm256_set1_ps(load_scale<Bf16>(scales, s0 + c0 / kFp8Block) * 256.0f);
      KT_UNROLL for (int m = 0; m < M; ++m) {
        __m256 sum = part[m][0];
        KT_UNROLL for (int j = 1; j < C; ++j) sum = _mm256_add_ps(sum, part[m][j]);
        total[m] = _mm256_fmadd_ps(sv, sum, total[m]);
      }
    }
    nan_rows[r] = any_byte_is_0x7f(magnitude);
    store_row<M>(total, out, R, r);
  }
}

// The columns gemv_fp8_steps left (K % 32 of them, all in the last 128-column block) added to
// every row, and each row holding a NaN code recomputed exactly (such a weight, never written
// by kt_ops.quantization but possible in a checkpoint, was decoded as a number).
template <bool Bf16>
void gemv_fp8_fixups(const float* x, int64_t M, const WeightMatrix& w, const uint8_t* nan_rows, float* out) {
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), blocks = w.scale.size(1), tail0 = K / 32 * 32;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const int64_t s0 = (r / kFp8Block) * blocks;
    const bool exact = nan_rows[r] != 0;
    for (int64_t m = 0; m < M; ++m) {
      float acc = exact ? 0.f : out[m * R + r];
      for (int64_t c = exact ? 0 : tail0; c < K; ++c) {
        acc += x[m * K + c] * (fp8_e4m3_to_float(row[c]) * load_scale<Bf16>(scales, s0 + c / kFp8Block));
      }
      out[m * R + r] = acc;
    }
  }
}

// fp8 as float32 bit patterns: sign-extending a byte to 32 bits and shifting it left by 20
// puts the sign at bit 31 and the exponent and mantissa bits at the bottom of float32's (the
// value / 2^120; fp8 subnormals become float32 denormals, exact while DAZ is off), plus sign
// copies at bits 27-30 that the mask clears: 3 integer instructions per 8 values and no
// conversion. The 2^120 is carried by x (gemv_fp8_bits).
KT_TARGET_AVX2 inline __m256 decode_fp8x8_bits(const uint8_t* p) {
  const __m256i d = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 20), _mm256_set1_epi32(int32_t(0x87f00000))));
}

// The decoders of dot_rows: 8 consecutive columns of one weight row as floats.
struct Fp8Bits {
  static constexpr bool kCheckNan = true;
  KT_TARGET_AVX2 static __m256 decode(const uint8_t* p) { return decode_fp8x8_bits(p); }
};
struct Int8Values {
  static constexpr bool kCheckNan = false;
  KT_TARGET_AVX2 static __m256 decode(const uint8_t* p) { return decode_int8x8(p); }
};

// RJ weight rows r..r+RJ at once against M rows of x, whole 32-column steps (K32 columns):
// each x vector is loaded once for the RJ rows. Decoding one weight row at a time loaded
// every x vector once per row: at 2-4 x rows the loads, not the FMAs, bound the kernel (a
// 2-row GEMV 1.5x and a 4-row one 3x slower per weight than a 1-row one). Decode is a
// decoder type (Fp8Bits, Int8Values); with CheckNan, *nan is set when any of the RJ rows
// holds a NaN code. sums[m][j] = the row's dot products, unscaled. prefetch_rows rows from
// `ahead` are prefetched as the columns go.
template <class Decoder, int M, int RJ, int C>
KT_TARGET_AVX2 inline void dot_rows(const float* x, int64_t K, int64_t K32, const uint8_t* row, int64_t ld,
                                    const uint8_t* ahead, int64_t prefetch_rows, float (&sums)[M][RJ],
                                    bool* nan) {
  __m256 part[M][RJ][C];
  KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < RJ; ++j) KT_UNROLL for (int i = 0; i < C; ++i)
    part[m][j][i] = _mm256_setzero_ps();
  __m256i magnitude = _mm256_setzero_si256();
  for (int64_t c = 0; c < K32; c += 32) {
    if (c % 64 == 0 && prefetch_rows > 0) {
      // Rows ahead (kBytePrefetchAheadBytes, quant_gemv_internal.h; thin_gemm's prefetch_next_tile:
      // RJ short row streams at once outran the hardware prefetcher; a 2-row fp8 GEMV read
      // memory at 5 GB/s, Zen 3).
      KT_UNROLL for (int j = 0; j < RJ; ++j) {
        if (j < prefetch_rows) prefetch_into_l2(ahead + j * ld + c);
      }
    }
    if constexpr (Decoder::kCheckNan) {
      KT_UNROLL for (int j = 0; j < RJ; ++j) magnitude = fp8_max_magnitude(row + j * ld + c, magnitude);
    }
    KT_UNROLL for (int q = 0; q < 4; ++q) {
      __m256 xv[M];
      KT_UNROLL for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * K + c + 8 * q);
      KT_UNROLL for (int j = 0; j < RJ; ++j) {
        const __m256 v = Decoder::decode(row + j * ld + c + 8 * q);
        KT_UNROLL for (int m = 0; m < M; ++m) part[m][j][q % C] = _mm256_fmadd_ps(xv[m], v, part[m][j][q % C]);
      }
    }
  }
  if constexpr (Decoder::kCheckNan) *nan = any_byte_is_0x7f(magnitude);
  KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < RJ; ++j) {
    __m256 t = part[m][j][0];
    KT_UNROLL for (int i = 1; i < C; ++i) t = _mm256_add_ps(t, part[m][j][i]);
    sums[m][j] = simd::hsum8(t);
  }
}

// dot_rows as the pass of qgemv::dot_row_range.
template <class Decoder>
struct Avx2Pass {
  template <int M, int RJ, int C>
  KT_TARGET_AVX2 static void run(const float* x, int64_t K, int64_t K32, const uint8_t* row, int64_t ld,
                                 const uint8_t* ahead, int64_t prefetch_rows, float (&sums)[M][RJ], bool* nan) {
    dot_rows<Decoder, M, RJ, C>(x, K, K32, row, ld, ahead, prefetch_rows, sums, nan);
  }
};

}  // namespace

KT_TARGET_AVX2 bool qgemv::scale_x_by_blocks(const float* x, int64_t M, int64_t K, const float* block_scales, float* xs) {
  const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), two_120 = _mm256_set1_ps(0x1p120f);
  const __m256 bound = _mm256_set1_ps(0x1p7f);
  __m256 too_large = _mm256_setzero_ps();
  bool tail_too_large = false;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c0 = 0; c0 < K; c0 += kFp8Block) {
      const int64_t end = std::min(K, c0 + kFp8Block);
      const float s = block_scales[c0 / kFp8Block];
      int64_t c = c0;
      for (; c + 8 <= end; c += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + m * K + c), _mm256_set1_ps(s));
        // "not less than" is also true for NaN.
        too_large = _mm256_or_ps(too_large, _mm256_cmp_ps(_mm256_and_ps(v, magnitude_mask), bound, _CMP_NLT_UQ));
        _mm256_storeu_ps(xs + m * K + c, _mm256_mul_ps(v, two_120));
      }
      for (; c < end; ++c) {
        const float v = x[m * K + c] * s;
        tail_too_large |= !(std::abs(v) < 0x1p7f);
        xs[m * K + c] = v * 0x1p120f;
      }
    }
  }
  return !tail_too_large && _mm256_movemask_ps(too_large) == 0;
}

namespace {

// The int4 kernels at 8 lanes: the body is written once for both widths (the AVX-512 one is
// quant_gemv_avx512.cpp's).
#define KT_VEC_TARGET KT_TARGET_AVX2
#include "kernels/quant_gemv_int4-inl.h"
#undef KT_VEC_TARGET

// The AVX2 kernels for the drivers of quant_gemv_internal.h.
struct Avx2Kernels {
  using Fp8Pass = Avx2Pass<Fp8Bits>;
  using Int8Pass = Avx2Pass<Int8Values>;
  static constexpr int kLanes = 8;
  template <int M, int G, bool Bf16>
  static void int4_groups(const float* x, const float* neg_sums, const WeightMatrix& w, float* scale_buffer,
                          float* out) {
    gemv_int4_groups<simd::F32x8, M, G, Bf16>(x, neg_sums, w, scale_buffer, out);
  }
};

void run_gemv(const float* x, int64_t M, const WeightMatrix& w, CpuIsa isa, float* out) {
  if (isa == CpuIsa::kPortable) return gemv_reference(x, M, w, out);
  if (is_fp4(w.format)) return qgemv::gemv_fp4(x, M, w, isa == CpuIsa::kAvx512 || isa == CpuIsa::kAvx512Bf16, out);
  const bool avx512 = isa == CpuIsa::kAvx512 || isa == CpuIsa::kAvx512Bf16;
  qgemv::for_row_chunks(M, [&](int64_t m0, auto rows) {
    constexpr int R = decltype(rows)::value;
    const float* xm = x + m0 * w.cols;
    float* om = out + m0 * w.rows;
    if (avx512) return qgemv::gemv_avx512<R>(xm, w, om);
    qgemv::gemv_rows<Avx2Kernels, R>(xm, w, om);
  });
}

}  // namespace

void qgemv::int4_permuted_x(const float* x, int64_t M, int64_t K, int64_t G, int lanes, float* out,
                            float* neg_group_sums) {
  const int64_t groups = K / G, step = 2 * lanes;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    for (int64_t c = 0; c < K; c += step) {
      for (int i = 0; i < lanes; ++i) {
        out[m * K + c + i] = xm[c + 2 * i];
        out[m * K + c + lanes + i] = xm[c + 2 * i + 1];
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t c = g * G; c < (g + 1) * G; ++c) sum += xm[c];
      for (int lane = 0; lane < lanes; ++lane) neg_group_sums[(m * groups + g) * lanes + lane] = lane < 8 ? -sum : 0.f;
    }
  }
}

void qgemv::fp8_band_through_fp16(const float* x, int64_t M, const WeightMatrix& w, int64_t r0, int64_t r1, float* out,
                                  uint8_t* nan_rows) {
  const bool bf16 = qgemv::bf16_scales(w);
  switch (M) {
    case 1: return bf16 ? gemv_fp8_steps<1, true>(x, w, r0, r1, out, nan_rows) : gemv_fp8_steps<1, false>(x, w, r0, r1, out, nan_rows);
    case 2: return bf16 ? gemv_fp8_steps<2, true>(x, w, r0, r1, out, nan_rows) : gemv_fp8_steps<2, false>(x, w, r0, r1, out, nan_rows);
    case 3: return bf16 ? gemv_fp8_steps<3, true>(x, w, r0, r1, out, nan_rows) : gemv_fp8_steps<3, false>(x, w, r0, r1, out, nan_rows);
    default: return bf16 ? gemv_fp8_steps<4, true>(x, w, r0, r1, out, nan_rows) : gemv_fp8_steps<4, false>(x, w, r0, r1, out, nan_rows);
  }
}

void qgemv::fp8_fixups(const float* x, int64_t M, const WeightMatrix& w, const uint8_t* nan_rows, float* out) {
  if (qgemv::bf16_scales(w)) return gemv_fp8_fixups<true>(x, M, w, nan_rows, out);
  gemv_fp8_fixups<false>(x, M, w, nan_rows, out);
}

void qgemv::int8_tail_columns(const float* x, int64_t M, const WeightMatrix& w, int64_t first_column, float* out) {
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0);
  if (first_column >= K) return;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  const bool bf16 = qgemv::bf16_scales(w);
  for (int64_t r = 0; r < R; ++r) {
    const float s = bf16 ? load_scale<true>(scales, r) : load_scale<false>(scales, r);
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t c = first_column; c < K; ++c) acc += x[m * K + c] * (static_cast<float>(static_cast<int8_t>(base[r * ld + c])) * s);
      out[m * R + r] += acc;
    }
  }
}

namespace {

// Whether x [M, K] holds an inf; a scan of the raw bits for float32 and bf16 rows (a decode step
// asks for every int4 GEMV, so it must cost next to nothing).
template <typename Bits>
bool rows_hold_inf(const at::Tensor& x, Bits magnitude_mask, Bits inf) {
  const Bits* p = static_cast<const Bits*>(x.const_data_ptr());
  bool any = false;
  for (int64_t m = 0; m < x.size(0); ++m) {
    const Bits* row = p + m * x.stride(0);
    for (int64_t k = 0; k < x.size(1); ++k) any |= (row[k] & magnitude_mask) == inf;
  }
  return any;
}

bool holds_inf(const at::Tensor& x) {
  if (x.stride(1) == 1 && x.scalar_type() == at::kBFloat16) return rows_hold_inf<uint16_t>(x, 0x7fff, 0x7f80);
  if (x.stride(1) == 1 && x.scalar_type() == at::kFloat) return rows_hold_inf<uint32_t>(x, 0x7fffffff, 0x7f800000);
  return at::isinf(x).any().item<bool>();
}

}  // namespace

at::Tensor quant_gemv_nt(const at::Tensor& x, const WeightMatrix& w, CpuIsa isa) {
  TORCH_INTERNAL_ASSERT(w.quantized() && x.dim() == 2 && x.size(1) == w.cols);
  const int64_t M = x.size(0), K = w.cols, R = w.rows;
  at::Tensor out = at::empty({M, R}, x.options());
  if (M == 0 || R == 0) return out;
  // The int4 kernels take the stored +8 back out through x's sums (Σ x·q = Σ x·(q + 8) − 8·Σ x),
  // so an inf in x would give inf − inf = NaN where x·wᵀ has ±inf. Such x (a model that has
  // diverged) takes the reference loop, which dequantizes each weight row first.
  if (w.format == WeightFormat::kInt4 && holds_inf(x)) isa = CpuIsa::kPortable;
  if (x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.stride(0) == K) {
    run_gemv(x.const_data_ptr<float>(), M, w, isa, out.mutable_data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && isa == CpuIsa::kAvx512Bf16 &&
             (w.format == WeightFormat::kInt4 || is_fp4(w.format) ||
              (w.format == WeightFormat::kFp8 && cpu_has_avx512_vbmi()))) {
    AlignedFloats of(M * R);  // x as it is: vdpbf16ps on bf16 pairs (quant_gemv_internal.h)
    const uint16_t* xb = static_cast<const uint16_t*>(x.const_data_ptr());
    if (is_fp4(w.format)) {
      qgemv::gemv_fp4_bf16(xb, x.stride(0), M, w, of.data());
    } else if (w.format == WeightFormat::kInt4) {
      const bool vnni = K % 128 == 0 && cpu_has_avx512_vnni() && qgemv::gemv_int4_vnni(xb, x.stride(0), M, w, of.data());
      if (!vnni) qgemv::gemv_int4_bf16(xb, x.stride(0), M, w, of.data());
    } else {
      qgemv::gemv_fp8_bf16(xb, x.stride(0), M, w, of.data());
    }
    float_rows_to_bf16(of.data(), R, static_cast<uint16_t*>(out.mutable_data_ptr()), R, M, R, isa);
  } else if (x.scalar_type() == at::kBFloat16 && x.stride(1) == 1) {
    // Converted and written back by convert_rows.h's kernels rather than at::Tensor::to: a
    // decode step makes three of these calls per expert, and each conversion through ATen cost
    // a few microseconds.
    AlignedFloats xf(M * K), of(M * R);
    bf16_rows_to_float(static_cast<const uint16_t*>(x.const_data_ptr()), x.stride(0), xf.data(), K, M, K, isa);
    // int4 / int8 on AVX2: integer dot products on x as 16-bit block floating point
    // (quant_gemv_int16.cpp); where it refuses x, the float kernels.
    const bool integer = isa == CpuIsa::kAvx2 && (w.format == WeightFormat::kInt4 || w.format == WeightFormat::kInt8) &&
                         qgemv::gemv_int16_avx2(xf.data(), M, w, of.data());
    if (!integer) run_gemv(xf.data(), M, w, isa, of.data());
    float_rows_to_bf16(of.data(), R, static_cast<uint16_t*>(out.mutable_data_ptr()), R, M, R, isa);
  } else {  // float64 activations or strided rows
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    at::Tensor of = at::empty({M, R}, x.options().dtype(at::kFloat));
    run_gemv(xf.const_data_ptr<float>(), M, w, isa, of.mutable_data_ptr<float>());
    out.copy_(of);
  }
  return out;
}

std::tuple<at::Tensor, bool> quant_gemv_int4_vnni(const at::Tensor& x, const WeightMatrix& w) {
  TORCH_CHECK(w.format == WeightFormat::kInt4 && w.cols % 128 == 0,
              "quant_gemv_int4_vnni: int4 weights of whole 128-column steps expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == w.cols,
              "quant_gemv_int4_vnni: x must be bfloat16 [M, ", w.cols, "]");
  parse_cpu_isa("avx512", "quant_gemv_int4_vnni");  // raises on a CPU without AVX-512
  TORCH_CHECK(cpu_has_avx512_vnni(), "quant_gemv_int4_vnni: this CPU has no AVX512-VNNI");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::zeros({x.size(0), w.rows}, x.options().dtype(at::kFloat));
  const bool ran = x.size(0) == 0 || qgemv::gemv_int4_vnni(static_cast<const uint16_t*>(xc.const_data_ptr()), w.cols,
                                                           x.size(0), w, out.mutable_data_ptr<float>());
  return {out, ran};
}

std::tuple<at::Tensor, bool> quant_gemv_int16_avx2(const at::Tensor& x, const WeightMatrix& w) {
  TORCH_CHECK(w.format == WeightFormat::kInt4 || w.format == WeightFormat::kInt8,
              "quant_gemv_int16_avx2: int4 or int8 weights expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == w.cols,
              "quant_gemv_int16_avx2: x must be float32 [M, ", w.cols, "]");
  parse_cpu_isa("avx2", "quant_gemv_int16_avx2");  // raises on a CPU without AVX2
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::zeros({x.size(0), w.rows}, x.options());
  const bool ran = x.size(0) == 0 || qgemv::gemv_int16_avx2(xc.const_data_ptr<float>(), x.size(0), w,
                                                            out.mutable_data_ptr<float>());
  return {out, ran};
}

}  // namespace kt
