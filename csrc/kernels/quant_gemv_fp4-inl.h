// The fp4 decode GEMV of quant_gemv_nt on float32 x (mxfp4, nvfp4), written once for both
// vector widths: V is simd::F32x8 (AVX2) or simd::F32x16 (AVX-512), and the includer defines
// KT_VEC_TARGET as that path's target attribute and includes this file once per path, each in
// its own namespace (see quant_gemv_int4-inl.h, whose reasons hold here). No #pragma once.
//
// Per 32 columns (16 bytes): fp4_values32's 32 values (2 · e2m1, int8, by byte shuffle), widened
// to V's lanes and converted, times their scales (scale_table's: the products are the
// dequantized weights exactly), then one FMA per x row and vector; two chains per x row.
#ifndef KT_VEC_TARGET
#error "define KT_VEC_TARGET (the target attribute of the including path) before including quant_gemv_fp4-inl.h"
#endif

// The 32 weights of a step as 32 / lanes vectors: lo's 16 values times s0, hi's times s1.
template <class V>
KT_VEC_TARGET inline void fp4_weights32(__m128i lo, __m128i hi, float s0, float s1,
                                        typename V::Reg (&w)[32 / V::kLanes]) {
  if constexpr (V::kLanes == 8) {
    const __m256 a = _mm256_set1_ps(s0), b = _mm256_set1_ps(s1);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), a);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), a);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), b);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), b);
  } else {
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_set1_ps(s0));
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), _mm512_set1_ps(s1));
  }
}

template <class V, int M, int G>
KT_VEC_TARGET void fp4_gemv_rows(const float* x, const WeightMatrix& w, float* out) {
  using Reg = typename V::Reg;
  constexpr int L = V::kLanes, N = 32 / L;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale.const_data_ptr());
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibble_values(w.format)));
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const uint8_t* row_scales = scales + r * groups;
    Reg acc[M][2];
    KT_UNROLL for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = V::zero();
    for (int64_t c = 0; c < K; c += 32) {
      if (row_ahead != nullptr) prefetch_lines(row_ahead, c / 2, c / 2 + 16);
      float s0, s1;
      step_scales<G>(w.scale_table, row_scales, c, s0, s1);
      __m128i lo, hi;
      fp4_values32(row + c / 2, table, lo, hi);
      Reg wv[N];
      fp4_weights32<V>(lo, hi, s0, s1, wv);
      KT_UNROLL for (int m = 0; m < M; ++m) {
        KT_UNROLL for (int j = 0; j < N; ++j) acc[m][j % 2] = V::fmadd(V::load(x + m * K + c + j * L), wv[j], acc[m][j % 2]);
      }
    }
    KT_UNROLL for (int m = 0; m < M; ++m) out[m * R + r] = V::reduce_add(V::add(acc[m][0], acc[m][1]));
  }
}
