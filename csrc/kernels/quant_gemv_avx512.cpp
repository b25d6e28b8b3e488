// The AVX-512 kernels of quant_gemv_nt (quant_gemv.h): the AVX2 kernels of quant_gemv.cpp step
// for step with 16 lanes instead of 8, so each decode instruction handles twice the values:
//   fp8 / int8: each byte sign-extended to 32 bits (vpmovsxbd), then fp8's shift-and-mask into
//     float32 bit patterns (the value / 2^120, x carrying the block scales and 2^120) or int8's
//     vcvtdq2ps; RJ weight rows per pass, 64 columns per step and one 32-column step where
//     K % 64 = 32, so both paths leave the same columns (K % 32) to the shared fix-ups;
//   int4: 16 bytes zero-extended to 32 bits give 32 columns, the low nibbles the even ones and
//     the high nibbles the odd ones (x permuted alike per 32 columns); the stored +8 removed
//     through each group's sum of x.
// fp8 bands whose scaled x would overflow, the K % 32 tail columns and rows holding a NaN code
// go through the same code as on the AVX2 path (quant_gemv_internal.h).
#include "kernels/quant_gemv_internal.h"
#include "platform/vec.h"

namespace kt {
namespace qgemv {
namespace {

KT_TARGET_AVX512 inline __m512 decode_fp8x16_bits(const uint8_t* p) {
  const __m512i d = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(d, 20), _mm512_set1_epi32(int32_t(0x87f00000))));
}

KT_TARGET_AVX512 inline __m512 decode_int8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

struct Fp8Bits {
  static constexpr bool kCheckNan = true;
  KT_TARGET_AVX512 static __m512 decode(const uint8_t* p) { return decode_fp8x16_bits(p); }
};
struct Int8Values {
  static constexpr bool kCheckNan = false;
  KT_TARGET_AVX512 static __m512 decode(const uint8_t* p) { return decode_int8x16(p); }
};

// The largest of 32 bytes with their sign bit cleared, folded into `seen` (a NaN code is 0x7f).
KT_TARGET_AVX512 inline __m256i max_magnitude32(const uint8_t* p, __m256i seen) {
  return _mm256_max_epu8(seen, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                                _mm256_set1_epi8(0x7f)));
}

// Q vectors of 16 columns from column c of RJ weight rows against M rows of x, into the chains
// part[m][j][q % C].
template <class Decoder, int M, int RJ, int C, int Q>
KT_TARGET_AVX512 inline void dot_step(const float* x, int64_t K, const uint8_t* row, int64_t ld, int64_t c,
                                      __m512 (&part)[M][RJ][C], __m256i& magnitude) {
  if constexpr (Decoder::kCheckNan) {
    KT_UNROLL for (int j = 0; j < RJ; ++j) KT_UNROLL for (int h = 0; h < Q / 2; ++h)
      magnitude = max_magnitude32(row + j * ld + c + 32 * h, magnitude);
  }
  KT_UNROLL for (int q = 0; q < Q; ++q) {
    __m512 xv[M];
    KT_UNROLL for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + c + 16 * q);
    KT_UNROLL for (int j = 0; j < RJ; ++j) {
      const __m512 v = Decoder::decode(row + j * ld + c + 16 * q);
      KT_UNROLL for (int m = 0; m < M; ++m) part[m][j][q % C] = _mm512_fmadd_ps(xv[m], v, part[m][j][q % C]);
    }
  }
}

// dot_rows of quant_gemv.cpp: RJ weight rows r..r+RJ at once against M rows of x over the
// first K32 columns, each x vector loaded once for the RJ rows; prefetch_rows rows from `ahead`
// prefetched.
template <class Decoder, int M, int RJ, int C>
KT_TARGET_AVX512 inline void dot_rows(const float* x, int64_t K, int64_t K32, const uint8_t* row, int64_t ld,
                                      const uint8_t* ahead, int64_t prefetch_rows, float (&sums)[M][RJ],
                                      bool* nan) {
  __m512 part[M][RJ][C];
  KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < RJ; ++j) KT_UNROLL for (int i = 0; i < C; ++i)
    part[m][j][i] = _mm512_setzero_ps();
  __m256i magnitude = _mm256_setzero_si256();
  int64_t c = 0;
  for (; c + 64 <= K32; c += 64) {
    KT_UNROLL for (int j = 0; j < RJ; ++j) {
      if (j < prefetch_rows) prefetch_into_l2(ahead + j * ld + c);
    }
    dot_step<Decoder, M, RJ, C, 4>(x, K, row, ld, c, part, magnitude);
  }
  if (c < K32) dot_step<Decoder, M, RJ, C, 2>(x, K, row, ld, c, part, magnitude);  // K32 % 64 = 32
  if constexpr (Decoder::kCheckNan) {
    *nan = _mm256_movemask_epi8(_mm256_cmpeq_epi8(magnitude, _mm256_set1_epi8(0x7f))) != 0;
  }
  KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < RJ; ++j) {
    __m512 t = part[m][j][0];
    KT_UNROLL for (int i = 1; i < C; ++i) t = _mm512_add_ps(t, part[m][j][i]);
    sums[m][j] = _mm512_reduce_add_ps(t);
  }
}

// dot_rows as the pass of dot_row_range (quant_gemv_internal.h).
template <class Decoder>
struct Avx512Pass {
  template <int M, int RJ, int C>
  KT_TARGET_AVX512 static void run(const float* x, int64_t K, int64_t K32, const uint8_t* row, int64_t ld,
                                   const uint8_t* ahead, int64_t prefetch_rows, float (&sums)[M][RJ], bool* nan) {
    dot_rows<Decoder, M, RJ, C>(x, K, K32, row, ld, ahead, prefetch_rows, sums, nan);
  }
};

// ---- int4 ---------------------------------------------------------------------------------------

// 32 columns from 16 bytes: lo = the even columns c, c+2, .., c+30 (low nibbles), hi = the odd
// ones, each q + 8 in 0..15.
KT_TARGET_AVX512 inline void decode_int4(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(0x0f)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
}

// The int4 kernels at 16 lanes: quant_gemv.cpp's AVX2 body, written once for both widths.
#define KT_VEC_TARGET KT_TARGET_AVX512
#include "kernels/quant_gemv_int4-inl.h"
#undef KT_VEC_TARGET

// The AVX-512 kernels for the drivers of quant_gemv_internal.h.
struct Avx512Kernels {
  using Fp8Pass = Avx512Pass<Fp8Bits>;
  using Int8Pass = Avx512Pass<Int8Values>;
  static constexpr int kLanes = 16;
  template <int M, int G, bool Bf16>
  static void int4_groups(const float* x, const float* neg_sums, const WeightMatrix& w, float* scale_buffer,
                          float* out) {
    gemv_int4_groups<simd::F32x16, M, G, Bf16>(x, neg_sums, w, scale_buffer, out);
  }
};

// ---- int4 on bf16 activations (AVX512-BF16) -------------------------------------------------
//
// 128 columns (64 bytes, one load) per step, decoded without a lookup table. The 16-bit word j
// of the 64 bytes holds columns 4j .. 4j+3, a nibble each (byte 2j's low and high nibble, then
// byte 2j+1's). Its k-th nibble q masked into the mantissa of 0x4300 (bf16 128.0, whose unit in
// the last place is 1) is the bf16 128 + q exactly: one shift and one vpternlogd per 32
// columns, where the previous kernel spent a widening, a shift and two vpermw lookups per 64
// (and port 5 ran every lookup and widening). The stored +8 and the 128 come back out through
// x's sums: Σ x (q − 8) = Σ x (128 + q) − 136 Σ x, with Σ x per sum lane computed once per call.
// vdpbf16ps pairs words 2i and 2i + 1, so sum lane i of nibble k's products holds columns
// 8i + k and 8i + 4 + k: x is reordered into its four column classes mod 4 once per call
// (bf16_x_mod4), and lane i covers columns 8i .. 8i+7 (a group of 32 is 4 lanes). The products
// are exact and the sums float32 (vdpbf16ps also flushes bf16 denormals of x, |x| < 2^-126);
// the bias makes the float32 sums about 136 / |q - 8| times larger, so their rounding is a
// few 1e-6 of a row's result (bf16 outputs round at 4e-3). A last K % 128 columns go through a
// 32-column lookup step on x as it is. The rows ahead are prefetched (kPrefetchAheadBytes): on
// the Intel Xeon with AMX this doubled the GEMV's speed from memory (6.9 -> 15 G weights/s,
// one thread).

// Chains of independent sums per x row, enough to cover vdpbf16ps's latency.
template <int M>
constexpr int kBf16Chains = M == 1 ? 4 : M == 2 ? 2 : 1;

constexpr int64_t kInt4Step = 128;  // columns per step of the bf16 kernel
constexpr float kInt4Bias = 136.0f;  // 128 (the decoded form) + 8 (the stored offset)


// 32 columns c.. of a row against x as it is (pairs in column order: byte j's low nibble is
// column 2j, its high nibble 2j + 1, one dword of the lookup index), into part.
template <int M>
KT_TARGET_AVX512_BF16 inline void int4_bf16_step32(const uint16_t* x, int64_t ldx, const uint8_t* row, int64_t c,
                                                   __m512i table, __m512 (&part)[M]) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
  const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000f000f), 0xa8);
  const __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(idx, table);
  KT_UNROLL for (int m = 0; m < M; ++m) {
    part[m] = _mm512_dpbf16_ps(part[m], wv, (__m512bh)_mm512_loadu_si512(x + m * ldx + c));
  }
}

// Step b (columns 128b ..) of a row into chain i of every x row's total; the same bytes of
// row_ahead (when not null) prefetched.
template <int M, int C, int G>
KT_TARGET_AVX512_BF16 inline void int4_bf16_step128(const uint16_t* xp, const float* sums, int64_t steps,
                                                    const uint8_t* row, const uint8_t* row_ahead, int64_t b,
                                                    const float* s, int i, __m512 (&total)[M][C]) {
  const int64_t c = b * kInt4Step;
  if (row_ahead != nullptr) prefetch_lines(row_ahead, c / 2, c / 2 + 64);
  const __m512i v = _mm512_loadu_si512(row + c / 2);
  const __m512i nibble = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
  constexpr int kMaskOr = 0xea;  // (a & b) | c
  const __m512bh w[4] = {
      (__m512bh)_mm512_ternarylogic_epi32(v, nibble, bias, kMaskOr),
      (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, bias, kMaskOr),
      (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nibble, bias, kMaskOr),
      (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), bias)};
  const __m512 sv = step_lane_scales<G>(s, c);
  KT_UNROLL for (int m = 0; m < M; ++m) {
    const uint16_t* xb = xp + (m * steps + b) * kInt4Step;
    __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), w[0], (__m512bh)_mm512_loadu_si512(xb));
    KT_UNROLL for (int k = 1; k < 4; ++k) part = _mm512_dpbf16_ps(part, w[k], (__m512bh)_mm512_loadu_si512(xb + 32 * k));
    // part - 136 Σ x: the exact Σ x (q - 8) of each lane but for float32 rounding
    const __m512 unbiased = _mm512_sub_ps(part, _mm512_loadu_ps(sums + (m * steps + b) * 16));
    total[m][i] = _mm512_fmadd_ps(sv, unbiased, total[m][i]);
  }
}

template <int M, int G, bool Bf16Scales>
KT_TARGET_AVX512_BF16 void gemv_int4_bf16_rows(const uint16_t* x, int64_t ldx, const uint16_t* xp,
                                               const float* sums, const WeightMatrix& w, float* scale_buffer,
                                               float* out) {
  constexpr int C = kBf16Chains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G, steps = K / kInt4Step;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  alignas(64) uint16_t words[32];
  for (int i = 0; i < 32; ++i) words[i] = simd::float_to_bf16(float(i % 16 - 8));  // the tail's bf16(q - 8)
  const __m512i table = _mm512_load_si512(words);
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const float* s = row_scales<Bf16Scales>(scales, r * groups, groups, scale_buffer);
    __m512 total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + C <= steps; b += C) {
      KT_UNROLL for (int i = 0; i < C; ++i) {
        int4_bf16_step128<M, C, G>(xp, sums, steps, row, row_ahead, b + i, s, i, total);
      }
    }
    for (; b < steps; ++b) int4_bf16_step128<M, C, G>(xp, sums, steps, row, row_ahead, b, s, 0, total);
    for (int64_t c = steps * kInt4Step; c < K; c += 32) {  // K % 128: 32, 64 or 96 (groups of 32 or 64)
      if (row_ahead != nullptr) prefetch_lines(row_ahead, c / 2, c / 2 + 16);
      __m512 part[M];
      KT_UNROLL for (int m = 0; m < M; ++m) part[m] = _mm512_setzero_ps();
      int4_bf16_step32<M>(x, ldx, row, c, table, part);
      const __m512 sv = _mm512_set1_ps(s[c / G]);
      KT_UNROLL for (int m = 0; m < M; ++m) total[m][0] = _mm512_fmadd_ps(sv, part[m], total[m][0]);
    }
    KT_UNROLL for (int m = 0; m < M; ++m) {
      __m512 sum = total[m][0];
      KT_UNROLL for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, total[m][i]);
      out[m * R + r] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <int M>
void gemv_int4_bf16_m(const uint16_t* x, int64_t ldx, const uint16_t* xp, const float* sums, const WeightMatrix& w,
                      float* out) {
  AlignedFloats scale_buffer(w.cols / w.group);
  const bool bf16_scales = w.scale.scalar_type() == at::kBFloat16;
  float* sb = scale_buffer.data();
  switch (w.group) {
    case 32:
      return bf16_scales ? gemv_int4_bf16_rows<M, 32, true>(x, ldx, xp, sums, w, sb, out)
                         : gemv_int4_bf16_rows<M, 32, false>(x, ldx, xp, sums, w, sb, out);
    case 64:
      return bf16_scales ? gemv_int4_bf16_rows<M, 64, true>(x, ldx, xp, sums, w, sb, out)
                         : gemv_int4_bf16_rows<M, 64, false>(x, ldx, xp, sums, w, sb, out);
    default:
      return bf16_scales ? gemv_int4_bf16_rows<M, 128, true>(x, ldx, xp, sums, w, sb, out)
                         : gemv_int4_bf16_rows<M, 128, false>(x, ldx, xp, sums, w, sb, out);
  }
}

}  // namespace

// x [M, K] bf16 (row stride ldx): each 128 columns' four classes mod 4 (columns c + 4j + k,
// j = 0 .. 31, for k = 0 .. 3) into xp [M, K / 128 * 128], and kInt4Bias times the sums of the
// step kernel's lanes (columns 8i .. 8i+7 of each 128) into sums [M, K / 128, 16]. The sums come
// from vdpbf16ps against ones, so they see x as the products do (denormals flushed).
KT_TARGET_AVX512_BF16 void bf16_x_mod4(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp,
                                       float* sums) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  const int64_t steps = K / kInt4Step;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < steps; ++b) {
      const uint16_t* src = x + m * ldx + b * kInt4Step;
      uint16_t* dst = xp + (m * steps + b) * kInt4Step;
      const __m512i words[4] = {_mm512_loadu_si512(src), _mm512_loadu_si512(src + 32), _mm512_loadu_si512(src + 64),
                                _mm512_loadu_si512(src + 96)};
      __m512i cls[4];
      columns_mod4(words, cls);
      __m512 sum = _mm512_setzero_ps();
      for (int k = 0; k < 4; ++k) {
        _mm512_storeu_si512(dst + 32 * k, cls[k]);
        sum = _mm512_dpbf16_ps(sum, (__m512bh)cls[k], ones);
      }
      if (sums != nullptr) _mm512_storeu_ps(sums + (m * steps + b) * 16, _mm512_mul_ps(sum, _mm512_set1_ps(kInt4Bias)));
    }
  }
}

void gemv_int4_bf16(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out) {
  TORCH_INTERNAL_ASSERT(w.format == WeightFormat::kInt4);
  const int64_t K = w.cols, steps = K / kInt4Step;
  AlignedFloats xp_buffer((M * steps * kInt4Step + 1) / 2), sums(M * steps * 16);
  uint16_t* xp = reinterpret_cast<uint16_t*>(xp_buffer.data());
  bf16_x_mod4(x, ldx, M, K, xp, sums.data());
  for_row_chunks(M, [&](int64_t m0, auto rows) {
    gemv_int4_bf16_m<decltype(rows)::value>(x + m0 * ldx, ldx, xp + m0 * steps * kInt4Step,
                                            sums.data() + m0 * steps * 16, w, out + m0 * w.rows);
  });
}

template <int M>
void gemv_avx512(const float* x, const WeightMatrix& w, float* out) {
  gemv_rows<Avx512Kernels, M>(x, w, out);
}

template void gemv_avx512<1>(const float*, const WeightMatrix&, float*);
template void gemv_avx512<2>(const float*, const WeightMatrix&, float*);
template void gemv_avx512<3>(const float*, const WeightMatrix&, float*);
template void gemv_avx512<4>(const float*, const WeightMatrix&, float*);

}  // namespace qgemv
}  // namespace kt
