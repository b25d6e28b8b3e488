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
#include <vector>

#include "ops/quant_gemv_internal.h"

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
// first K32 columns, each x vector loaded once for the RJ rows; the next pass's first
// prefetch_rows rows prefetched into L2.
template <class Decoder, int M, int RJ, int C>
KT_TARGET_AVX512 inline void dot_rows(const float* x, int64_t K, int64_t K32, const uint8_t* row, int64_t ld,
                                      int64_t prefetch_rows, float (&sums)[M][RJ], bool* nan) {
  __m512 part[M][RJ][C];
  KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < RJ; ++j) KT_UNROLL for (int i = 0; i < C; ++i)
    part[m][j][i] = _mm512_setzero_ps();
  __m256i magnitude = _mm256_setzero_si256();
  int64_t c = 0;
  for (; c + 64 <= K32; c += 64) {
    KT_UNROLL for (int j = 0; j < RJ; ++j) {
      if (j < prefetch_rows) _mm_prefetch(reinterpret_cast<const char*>(row + (RJ + j) * ld + c), _MM_HINT_T1);
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
                                   int64_t prefetch_rows, float (&sums)[M][RJ], bool* nan) {
    dot_rows<Decoder, M, RJ, C>(x, K, K32, row, ld, prefetch_rows, sums, nan);
  }
};

template <int M, bool Bf16>
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
        dot_row_range<Avx512Pass<Fp8Bits>, M>(xs.data(), w, r0, r1, out, nan_rows.data(), UnitScale{});
      } else {
        fp8_band_through_fp16(x, M, w, r0, r1, out, nan_rows.data());
      }
    }
  }
  if (K % 32 != 0 || std::any_of(nan_rows.begin(), nan_rows.end(), [](uint8_t v) { return v != 0; })) {
    fp8_fixups(x, M, w, nan_rows.data(), out);
  }
}

template <int M, bool Bf16>
void gemv_int8(const float* x, const WeightMatrix& w, float* out) {
  const void* scales = w.scale.const_data_ptr();
  dot_row_range<Avx512Pass<Int8Values>, M>(x, w, 0, w.rows, out, nullptr,
                                           [scales](int64_t r) { return load_scale<Bf16>(scales, r); });
  int8_tail_columns(x, M, w, out);
}

// ---- int4 ---------------------------------------------------------------------------------------

// 32 columns from 16 bytes: lo = the even columns c, c+2, .., c+30 (low nibbles), hi = the odd
// ones, each q + 8 in 0..15.
KT_TARGET_AVX512 inline void decode_int4x32(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(0x0f)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
}

// out: x [M, K] with each 32 columns in decode_int4x32's order (evens, then odds);
// neg_group_sums[(m * groups + g) * 16 + lane]: minus the sum of x[m] over group g in lanes 0-7
// and zero in lanes 8-15, a vector whose lanes add up to -8 times the group's sum.
void int4_permuted_x(const float* x, int64_t M, int64_t K, int64_t G, float* out, float* neg_group_sums) {
  const int64_t groups = K / G;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    for (int64_t c = 0; c < K; c += 32) {
      for (int i = 0; i < 16; ++i) {
        out[m * K + c + i] = xm[c + 2 * i];
        out[m * K + c + 16 + i] = xm[c + 2 * i + 1];
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t c = g * G; c < (g + 1) * G; ++c) sum += xm[c];
      for (int lane = 0; lane < 16; ++lane) neg_group_sums[(m * groups + g) * 16 + lane] = lane < 8 ? -sum : 0.f;
    }
  }
}

template <int M>
constexpr int kInt4TotalChains = M == 1 ? 4 : M == 2 ? 2 : 1;

// One group of G columns into chain J of each x row's total (quant_gemv.cpp's int4_group).
template <int M, int C, int G, int J>
KT_TARGET_AVX512 inline void int4_group(const float* x, int64_t K, const uint8_t* p, const float* s,
                                        const float* neg_sums, int64_t groups, __m512 (&total)[M][C]) {
  __m512 part[M][2];
  KT_UNROLL for (int m = 0; m < M; ++m) {
    part[m][0] = _mm512_loadu_ps(neg_sums + m * groups * 16);
    part[m][1] = _mm512_setzero_ps();
  }
  KT_UNROLL for (int c = 0; c < G; c += 32) {
    __m512 lo, hi;
    decode_int4x32(p + c / 2, lo, hi);
    KT_UNROLL for (int m = 0; m < M; ++m) {
      part[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + c), lo, part[m][0]);
      part[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + c + 16), hi, part[m][1]);
    }
  }
  const __m512 sv = _mm512_set1_ps(*s);
  KT_UNROLL for (int m = 0; m < M; ++m) total[m][J] = _mm512_fmadd_ps(sv, _mm512_add_ps(part[m][0], part[m][1]), total[m][J]);
}

template <bool Bf16>
KT_TARGET_AVX512 inline const float* row_scales(const void* scales, int64_t s0, int64_t groups, float* buffer) {
  if constexpr (!Bf16) {
    return static_cast<const float*>(scales) + s0;
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(scales) + s0;
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) _mm512_storeu_ps(buffer + g, simd::load16_bf16(src + g));
    for (; g < groups; ++g) buffer[g] = simd::bf16_to_float(src[g]);
    return buffer;
  }
}

template <int M, int G, bool Bf16>
KT_TARGET_AVX512 void gemv_int4_groups(const float* x, const float* neg_sums, const WeightMatrix& w,
                                       float* scale_buffer, float* out) {
  constexpr int C = kInt4TotalChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const float* s = row_scales<Bf16>(scales, r * groups, groups, scale_buffer);
    __m512 total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = _mm512_setzero_ps();
    int64_t gi = 0;
    for (; gi + C <= groups; gi += C) {
      const float* xg = x + gi * G;
      const float* ng = neg_sums + gi * 16;
      const uint8_t* pg = row + gi * (G / 2);
      int4_group<M, C, G, 0>(xg, K, pg, s + gi, ng, groups, total);
      if constexpr (C > 1) int4_group<M, C, G, (C > 1)>(xg + G, K, pg + G / 2, s + gi + 1, ng + 16, groups, total);
      if constexpr (C > 2) {
        int4_group<M, C, G, 2 * (C > 2)>(xg + 2 * G, K, pg + G, s + gi + 2, ng + 32, groups, total);
        int4_group<M, C, G, 3 * (C > 2)>(xg + 3 * G, K, pg + 3 * G / 2, s + gi + 3, ng + 48, groups, total);
      }
    }
    for (; gi < groups; ++gi) {
      int4_group<M, C, G, 0>(x + gi * G, K, row + gi * (G / 2), s + gi, neg_sums + gi * 16, groups, total);
    }
    KT_UNROLL for (int m = 0; m < M; ++m) {
      __m512 sum = total[m][0];
      KT_UNROLL for (int j = 1; j < C; ++j) sum = _mm512_add_ps(sum, total[m][j]);
      out[m * R + r] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <int M>
void gemv_int4(const float* x_in, const WeightMatrix& w, float* out) {
  const int64_t K = w.cols, G = w.group, groups = K / G;
  AlignedFloats x_permuted(M * K), neg_sums(M * groups * 16), scale_buffer(groups);
  int4_permuted_x(x_in, M, K, G, x_permuted.data(), neg_sums.data());
  const float* x = x_permuted.data();
  const float* n = neg_sums.data();
  float* sb = scale_buffer.data();
  const bool bf16 = bf16_scales(w);
  switch (G) {
    case 32: return bf16 ? gemv_int4_groups<M, 32, true>(x, n, w, sb, out) : gemv_int4_groups<M, 32, false>(x, n, w, sb, out);
    case 64: return bf16 ? gemv_int4_groups<M, 64, true>(x, n, w, sb, out) : gemv_int4_groups<M, 64, false>(x, n, w, sb, out);
    default: return bf16 ? gemv_int4_groups<M, 128, true>(x, n, w, sb, out) : gemv_int4_groups<M, 128, false>(x, n, w, sb, out);
  }
}

template <int M>
void gemv_rows(const float* x, const WeightMatrix& w, float* out) {
  const bool bf16 = bf16_scales(w);
  switch (w.format) {
    case WeightFormat::kFp8: return bf16 ? gemv_fp8<M, true>(x, w, out) : gemv_fp8<M, false>(x, w, out);
    case WeightFormat::kInt8: return bf16 ? gemv_int8<M, true>(x, w, out) : gemv_int8<M, false>(x, w, out);
    default: return gemv_int4<M>(x, w, out);
  }
}

}  // namespace

void gemv_avx512(const float* x, int64_t M, const WeightMatrix& w, float* out) {
  switch (M) {
    case 1: return gemv_rows<1>(x, w, out);
    case 2: return gemv_rows<2>(x, w, out);
    case 3: return gemv_rows<3>(x, w, out);
    default: return gemv_rows<4>(x, w, out);
  }
}

}  // namespace qgemv
}  // namespace kt
