// The fp4 decode GEMVs of quant_gemv_nt (mxfp4, nvfp4) on float32 x: one pass over the 4-bit
// codes, half of int8's bytes. Per 32 columns (16 bytes): the nibbles split and interleaved
// into column order, each looked up as its nibble_values entry (2 · e2m1, a small integer) by
// a byte shuffle, widened to float32 and multiplied by its group's scale (scale_table: half the
// true scale, so each product is the dequantized weight exactly), then one FMA per x row. The
// scale is applied to the weights rather than to per-group sums: with at most 4 rows of x one
// multiply per weight vector costs less than a group sum per row. The reference loop is
// quant_gemv.cpp's gemv_reference; tests compare them (tests/test_quant_fp4.py).
#include <algorithm>

#include "kernels/quant_gemv_internal.h"
#include "platform/simd.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace qgemv {
namespace {

// The codes of 16 bytes (32 columns, low nibble first) as their values, columns 0-15 in lo and
// 16-31 in hi (16 int8 each).
KT_TARGET_AVX2 inline void fp4_values32(const uint8_t* p, __m128i table, __m128i& lo, __m128i& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i low = _mm_and_si128(b, mask), high = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  lo = _mm_shuffle_epi8(table, _mm_unpacklo_epi8(low, high));
  hi = _mm_shuffle_epi8(table, _mm_unpackhi_epi8(low, high));
}

// The scales a 32-column step multiplies by: its first and second 16 columns' (G = 16) or one.
template <int G>
inline void step_scales(const float* table, const uint8_t* row_scales, int64_t c, float& first, float& second) {
  first = table[row_scales[c / G]];
  second = G == 16 ? table[row_scales[c / G + 1]] : first;
}

template <int M, int G>
KT_TARGET_AVX2 void fp4_gemv_avx2(const float* x, const WeightMatrix& w, float* out) {
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale.const_data_ptr());
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibble_values(w.format)));
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const uint8_t* row_scales = scales + r * groups;
    __m256 acc[M][2];
    KT_UNROLL for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < K; c += 32) {
      if (row_ahead != nullptr) prefetch_lines(row_ahead, c / 2, c / 2 + 16);
      float s0, s1;
      step_scales<G>(w.scale_table, row_scales, c, s0, s1);
      __m128i lo, hi;
      fp4_values32(row + c / 2, table, lo, hi);
      const __m256 a = _mm256_set1_ps(s0), b = _mm256_set1_ps(s1);
      const __m256 v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), a);
      const __m256 v1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), a);
      const __m256 v2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), b);
      const __m256 v3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), b);
      KT_UNROLL for (int m = 0; m < M; ++m) {
        const float* xm = x + m * K + c;
        acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), v0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), v1, acc[m][1]);
        acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), v2, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), v3, acc[m][1]);
      }
    }
    KT_UNROLL for (int m = 0; m < M; ++m) out[m * R + r] = simd::hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
  }
}

template <int M, int G>
KT_TARGET_AVX512 void fp4_gemv_avx512(const float* x, const WeightMatrix& w, float* out) {
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale.const_data_ptr());
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibble_values(w.format)));
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const uint8_t* row_scales = scales + r * groups;
    __m512 acc[M][2];
    KT_UNROLL for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += 32) {
      if (row_ahead != nullptr) prefetch_lines(row_ahead, c / 2, c / 2 + 16);
      float s0, s1;
      step_scales<G>(w.scale_table, row_scales, c, s0, s1);
      __m128i lo, hi;
      fp4_values32(row + c / 2, table, lo, hi);
      const __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_set1_ps(s0));
      const __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), _mm512_set1_ps(s1));
      KT_UNROLL for (int m = 0; m < M; ++m) {
        const float* xm = x + m * K + c;
        acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xm), v0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 16), v1, acc[m][1]);
      }
    }
    KT_UNROLL for (int m = 0; m < M; ++m) out[m * R + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
  }
}

template <int M>
void fp4_gemv_rows(const float* x, const WeightMatrix& w, bool avx512, float* out) {
  if (w.group == 16) return avx512 ? fp4_gemv_avx512<M, 16>(x, w, out) : fp4_gemv_avx2<M, 16>(x, w, out);
  return avx512 ? fp4_gemv_avx512<M, 32>(x, w, out) : fp4_gemv_avx2<M, 32>(x, w, out);
}

}  // namespace

void gemv_fp4(const float* x, int64_t M, const WeightMatrix& w, bool avx512, float* out) {
  TORCH_INTERNAL_ASSERT(is_fp4(w.format) && w.cols % 32 == 0 && (w.group == 16 || w.group == 32));
  for_row_chunks(M, [&](int64_t m0, auto rows) {
    // each chunk's rows of out: [rows, R] at out + m0 · R
    fp4_gemv_rows<decltype(rows)::value>(x + m0 * w.cols, w, avx512, out + m0 * w.rows);
  });
}

}  // namespace qgemv
}  // namespace kt
