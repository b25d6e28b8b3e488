// Kernels of quant_gemv_nt (see quant_gemv.h): the reference loop (dequantize a row, dot it
// with each x row), then the AVX2 kernels, which decode the quantized bytes in registers and
// feed them straight to the FMAs: decode blocks are bound by the work per weight, not by memory
// (the bf16 GEMV streams weights at the bandwidth; a quantized one must decode each value in a
// handful of instructions to go faster than it). Per format:
//   int8: vpmovsxbd + vcvtdq2ps per 8 values; the row's scale applied once at the end;
//   fp8:  16 bytes sign-extended to 16 bits, shifted and masked into fp16 bit patterns (the
//         value / 2^8, subnormals included), vcvtph2ps; per 128-column block a partial sum
//         times the block's scale; NaN codes only detected (a row holding one is recomputed
//         exactly);
//   int4: 16 bytes = 32 values through two vpshufb tables of bf16 bytes and byte / word
//         interleaves (no conversion instruction); per group a partial sum times its scale.
// Several FMA chains per x row (4 for one row, 2 for two) so that FMA latency does not bound one
// decode row.
#include "ops/quant_gemv.h"

#include <immintrin.h>

#include <vector>

#include "ops/dequantize.h"
#include "ops/simd.h"

namespace kt {
namespace {

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

inline float scale_value(const WeightMatrix& w, int64_t i) {
  const void* p = w.scale.const_data_ptr();
  return w.scale.scalar_type() == at::kFloat ? static_cast<const float*>(p)[i]
                                             : simd::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
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

// Any of the 32 bytes at p a NaN code (0x7f, 0xff): accumulated into `seen`, checked per row.
KT_TARGET_AVX2 inline __m256i fp8_nan_codes(const uint8_t* p, __m256i seen) {
  const __m256i b = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(0x7f));
  return _mm256_or_si256(seen, _mm256_cmpeq_epi8(b, _mm256_set1_epi8(0x7f)));
}

// int4, 32 columns from 16 bytes, with integer shuffles only: the low nibbles (even columns) and
// high nibbles (odd columns) side by side, two vpshufb tables giving the two bytes of the bf16
// of q - 8 (q - 8 = -8..7: their float32 bits are the bf16 bits followed by 16 zeros), then
// interleaving bytes and zero words builds the float32 values directly. The shuffles work
// within 128-bit halves, so vector q of the result holds the columns kInt4Column(q, i): x is
// permuted alike (int4_permuted_x) and the dot product is unchanged.
constexpr int64_t kInt4Column(int q, int i) { return 8 * q + (i < 4 ? 2 * i : 2 * i - 7); }

KT_TARGET_AVX2 inline __m256i int4_bf16_table(bool high) {
  // bf16 of -8, -7, ..., 7: 0xc100 0xc0e0 0xc0c0 0xc0a0 0xc080 0xc040 0xc000 0xbf80 0 0x3f80
  // 0x4000 0x4040 0x4080 0x40a0 0x40c0 0x40e0.
  return high ? _mm256_setr_epi8(int8_t(0xc1), int8_t(0xc0), int8_t(0xc0), int8_t(0xc0), int8_t(0xc0), int8_t(0xc0),
                                 int8_t(0xc0), int8_t(0xbf), 0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
                                 int8_t(0xc1), int8_t(0xc0), int8_t(0xc0), int8_t(0xc0), int8_t(0xc0), int8_t(0xc0),
                                 int8_t(0xc0), int8_t(0xbf), 0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40)
              : _mm256_setr_epi8(0x00, int8_t(0xe0), int8_t(0xc0), int8_t(0xa0), int8_t(0x80), 0x40, 0x00,
                                 int8_t(0x80), 0x00, int8_t(0x80), 0x00, 0x40, int8_t(0x80), int8_t(0xa0),
                                 int8_t(0xc0), int8_t(0xe0), 0x00, int8_t(0xe0), int8_t(0xc0), int8_t(0xa0),
                                 int8_t(0x80), 0x40, 0x00, int8_t(0x80), 0x00, int8_t(0x80), 0x00, 0x40,
                                 int8_t(0x80), int8_t(0xa0), int8_t(0xc0), int8_t(0xe0));
}

KT_TARGET_AVX2 inline void decode_int4x32(const uint8_t* p, __m256i table_hi, __m256i table_lo, __m256 v[4]) {
  // The 16 bytes in both halves; the upper half shifted right by 4: low nibbles | high nibbles.
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                           _mm256_set1_epi8(0x0f));
  const __m256i hi = _mm256_shuffle_epi8(table_hi, nibbles), lo = _mm256_shuffle_epi8(table_lo, nibbles);
  const __m256i words0 = _mm256_unpacklo_epi8(lo, hi), words1 = _mm256_unpackhi_epi8(lo, hi);
  const __m256i zero = _mm256_setzero_si256();
  v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, words0));
  v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, words0));
  v[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, words1));
  v[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, words1));
}

// x [M, K] with each 32 columns in the order decode_int4x32 produces them.
std::vector<float> int4_permuted_x(const float* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K; c += 32)
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 8; ++i) out[m * K + c + 8 * q + i] = x[m * K + c + kInt4Column(q, i)];
  return out;
}

KT_TARGET_AVX2 inline __m256 decode_int8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// ---- the AVX2 kernels: out[m, r] for every row r of w, M (1..4) rows of x ([M, K] float32) ----

// FMA chains per x row: 4 for one row, 2 for two, 1 for three or four.
template <int M>
constexpr int kChains = M == 1 ? 4 : M == 2 ? 2 : 1;

template <int M>
KT_TARGET_AVX2 inline void store_row(const __m256 (&total)[M], const float (&tail)[M], float* out, int64_t R, int64_t r) {
  KT_UNROLL for (int m = 0; m < M; ++m) out[m * R + r] = simd::hsum8(total[m]) + tail[m];
}

template <int M>
KT_TARGET_AVX2 void gemv_int8(const float* x, const WeightMatrix& w, float* out) {
  constexpr int C = kChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0);
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    __m256 part[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) part[m][j] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= K; c += 32) {
      KT_UNROLL for (int q = 0; q < 4; ++q) {
        const __m256 wv = decode_int8x8(row + c + 8 * q);
        KT_UNROLL for (int m = 0; m < M; ++m)
          part[m][q % C] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + c + 8 * q), wv, part[m][q % C]);
      }
    }
    for (; c + 8 <= K; c += 8) {
      const __m256 wv = decode_int8x8(row + c);
      KT_UNROLL for (int m = 0; m < M; ++m) part[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + c), wv, part[m][0]);
    }
    const float s = scale_value(w, r);
    const __m256 sv = _mm256_set1_ps(s);
    __m256 total[M];
    float tail[M] = {};
    KT_UNROLL for (int m = 0; m < M; ++m) {
      __m256 sum = part[m][0];
      KT_UNROLL for (int j = 1; j < C; ++j) sum = _mm256_add_ps(sum, part[m][j]);
      total[m] = _mm256_mul_ps(sv, sum);
    }
    for (; c < K; ++c) {
      const float wv = static_cast<float>(static_cast<int8_t>(row[c])) * s;
      KT_UNROLL for (int m = 0; m < M; ++m) tail[m] += x[m * K + c] * wv;
    }
    store_row<M>(total, tail, out, R, r);
  }
}

template <int M>
KT_TARGET_AVX2 void gemv_fp8(const float* x, const WeightMatrix& w, float* out) {
  constexpr int C = kChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), blocks = w.scale.size(1);
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    __m256 total[M];
    float tail[M] = {};
    KT_UNROLL for (int m = 0; m < M; ++m) total[m] = _mm256_setzero_ps();
    __m256i nan_seen = _mm256_setzero_si256();
    for (int64_t c0 = 0; c0 < K; c0 += kFp8Block) {
      const int64_t end = std::min(K, c0 + kFp8Block);
      const float s = scale_value(w, (r / kFp8Block) * blocks + c0 / kFp8Block);
      __m256 part[M][C];
      KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) part[m][j] = _mm256_setzero_ps();
      int64_t c = c0;
      for (; c + 32 <= end; c += 32) {
        nan_seen = fp8_nan_codes(row + c, nan_seen);
        __m256 v[4];
        decode_fp8x16(row + c, v[0], v[1]);
        decode_fp8x16(row + c + 16, v[2], v[3]);
        KT_UNROLL for (int q = 0; q < 4; ++q)
          KT_UNROLL for (int m = 0; m < M; ++m)
            part[m][q % C] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + c + 8 * q), v[q], part[m][q % C]);
      }
      const __m256 sv = _mm256_set1_ps(s * 256.0f);  // the decoded values are the weights / 2^8
      KT_UNROLL for (int m = 0; m < M; ++m) {
        __m256 sum = part[m][0];
        KT_UNROLL for (int j = 1; j < C; ++j) sum = _mm256_add_ps(sum, part[m][j]);
        total[m] = _mm256_fmadd_ps(sv, sum, total[m]);
      }
      for (; c < end; ++c) {  // a block's columns after its last 32 (rows whose length is not a multiple of 32)
        const float wv = fp8_e4m3_to_float(row[c]) * s;
        KT_UNROLL for (int m = 0; m < M; ++m) tail[m] += x[m * K + c] * wv;
      }
    }
    if (_mm256_movemask_epi8(nan_seen) != 0) {
      // A NaN weight (never written by kt_ops.quantization, possible in a checkpoint): the
      // decoding above read it as a number, so this row goes through the exact reference loop.
      KT_UNROLL for (int m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t c = 0; c < K; ++c) {
          acc += x[m * K + c] * fp8_e4m3_to_float(row[c]) * scale_value(w, (r / kFp8Block) * blocks + c / kFp8Block);
        }
        out[m * R + r] = acc;
      }
      continue;
    }
    store_row<M>(total, tail, out, R, r);
  }
}

// One int4 group of G columns (its bytes at p, its scale s): the group's sum in two chains per
// x row, times s, added to chain J of each row's total.
template <int M, int C, int G, int J>
KT_TARGET_AVX2 inline void int4_group(const float* x, int64_t K, const uint8_t* p, __m256 s, __m256i table_hi,
                                      __m256i table_lo, __m256 (&total)[M][C]) {
  __m256 part[M][2];
  KT_UNROLL for (int m = 0; m < M; ++m) part[m][0] = part[m][1] = _mm256_setzero_ps();
  KT_UNROLL for (int c = 0; c < G; c += 32) {
    __m256 v[4];
    decode_int4x32(p + c / 2, table_hi, table_lo, v);
    KT_UNROLL for (int q = 0; q < 4; ++q)
      KT_UNROLL for (int m = 0; m < M; ++m)
        part[m][q % 2] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + c + 8 * q), v[q], part[m][q % 2]);
  }
  KT_UNROLL for (int m = 0; m < M; ++m) total[m][J] = _mm256_fmadd_ps(s, _mm256_add_ps(part[m][0], part[m][1]), total[m][J]);
}

template <bool Bf16>
inline float load_scale(const void* scales, int64_t i) {
  if constexpr (Bf16) {
    return simd::bf16_to_float(static_cast<const uint16_t*>(scales)[i]);
  } else {
    return static_cast<const float*>(scales)[i];
  }
}

// Groups of G columns, scales of dtype bf16 (Bf16) or float32: both compile-time, so that a
// group is straight-line code. Group gi goes to chain gi % C, unrolled by C so that the totals
// stay in registers.
template <int M, int G, bool Bf16>
KT_TARGET_AVX2 void gemv_int4_groups(const float* x, const WeightMatrix& w, float* out) {
  constexpr int C = kChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  const __m256i table_hi = int4_bf16_table(true), table_lo = int4_bf16_table(false);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const int64_t s0 = r * groups;
    __m256 total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = _mm256_setzero_ps();
    int64_t gi = 0;
    for (; gi + C <= groups; gi += C) {
      const float* xg = x + gi * G;
      const uint8_t* pg = row + gi * (G / 2);
      int4_group<M, C, G, 0>(xg, K, pg, _mm256_set1_ps(load_scale<Bf16>(scales, s0 + gi)), table_hi, table_lo, total);
      if constexpr (C > 1) {
        int4_group<M, C, G, (C > 1)>(xg + G, K, pg + G / 2, _mm256_set1_ps(load_scale<Bf16>(scales, s0 + gi + 1)),
                                     table_hi, table_lo, total);
      }
      if constexpr (C > 2) {
        int4_group<M, C, G, 2 * (C > 2)>(xg + 2 * G, K, pg + G, _mm256_set1_ps(load_scale<Bf16>(scales, s0 + gi + 2)),
                                         table_hi, table_lo, total);
        int4_group<M, C, G, 3 * (C > 2)>(xg + 3 * G, K, pg + 3 * G / 2,
                                         _mm256_set1_ps(load_scale<Bf16>(scales, s0 + gi + 3)), table_hi, table_lo, total);
      }
    }
    for (; gi < groups; ++gi) {
      int4_group<M, C, G, 0>(x + gi * G, K, row + gi * (G / 2), _mm256_set1_ps(load_scale<Bf16>(scales, s0 + gi)),
                             table_hi, table_lo, total);
    }
    __m256 sum[M];
    float tail[M] = {};
    KT_UNROLL for (int m = 0; m < M; ++m) {
      sum[m] = total[m][0];
      KT_UNROLL for (int j = 1; j < C; ++j) sum[m] = _mm256_add_ps(sum[m], total[m][j]);
    }
    store_row<M>(sum, tail, out, R, r);
  }
}

template <int M>
void gemv_int4(const float* x_in, const WeightMatrix& w, float* out) {
  const std::vector<float> x_permuted = int4_permuted_x(x_in, M, w.cols);
  const float* x = x_permuted.data();
  const bool bf16 = w.scale.scalar_type() == at::kBFloat16;
  switch (w.group) {
    case 32: return bf16 ? gemv_int4_groups<M, 32, true>(x, w, out) : gemv_int4_groups<M, 32, false>(x, w, out);
    case 64: return bf16 ? gemv_int4_groups<M, 64, true>(x, w, out) : gemv_int4_groups<M, 64, false>(x, w, out);
    default: return bf16 ? gemv_int4_groups<M, 128, true>(x, w, out) : gemv_int4_groups<M, 128, false>(x, w, out);
  }
}

template <int M>
void gemv_avx2(const float* x, const WeightMatrix& w, float* out) {
  switch (w.format) {
    case WeightFormat::kFp8: return gemv_fp8<M>(x, w, out);
    case WeightFormat::kInt8: return gemv_int8<M>(x, w, out);
    default: return gemv_int4<M>(x, w, out);
  }
}

}  // namespace

at::Tensor quant_gemv_nt(const at::Tensor& x, const WeightMatrix& w, CpuIsa isa) {
  TORCH_INTERNAL_ASSERT(w.quantized() && x.dim() == 2 && x.size(1) == w.cols);
  const int64_t M = x.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, w.rows}, x.options().dtype(at::kFloat));
  const float* xp = xf.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  if (isa == CpuIsa::kPortable) {
    gemv_reference(xp, M, w, op);
  } else {
    // Four x rows at a time (decode blocks have at most 4: moe_forward's kGemvMaxRows).
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const float* xm = xp + m0 * w.cols;
      float* om = op + m0 * w.rows;
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: gemv_avx2<1>(xm, w, om); break;
        case 2: gemv_avx2<2>(xm, w, om); break;
        case 3: gemv_avx2<3>(xm, w, om); break;
        default: gemv_avx2<4>(xm, w, om); break;
      }
    }
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace kt
