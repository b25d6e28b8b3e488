// The fp4 decode GEMVs of quant_gemv_nt (mxfp4, nvfp4) on float32 x: one pass over the 4-bit
// codes, half of int8's bytes. Per 32 columns (16 bytes): the nibbles split and interleaved
// into column order, each looked up as its nibble_values entry (2 · e2m1, a small integer) by
// a byte shuffle, widened to float32 and multiplied by its group's scale (scale_table: half the
// true scale, so each product is the dequantized weight exactly), then one FMA per x row. The
// scale is applied to the weights rather than to per-group sums: with at most 4 rows of x one
// multiply per weight vector costs less than a group sum per row. The reference loop is
// quant_gemv.cpp's gemv_reference; tests compare them (tests/test_quant_fp4.py). bf16 x on
// AVX512-BF16 takes vdpbf16ps on looked-up bf16 values instead (fp4_gemv_bf16).
#include <algorithm>

#include <cmath>

#include "kernels/dequantize.h"
#include "kernels/dequantize_internal.h"
#include "kernels/quant_gemv_internal.h"
#include "platform/simd.h"
#include "platform/vec.h"
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

// The float32-x GEMV, written once for both widths (quant_gemv_fp4-inl.h), in a namespace per
// path, as quant_gemv_int4-inl.h is.
namespace avx2 {
#define KT_VEC_TARGET KT_TARGET_AVX2
#include "kernels/quant_gemv_fp4-inl.h"
#undef KT_VEC_TARGET
}  // namespace avx2

namespace avx512 {
#define KT_VEC_TARGET KT_TARGET_AVX512
#include "kernels/quant_gemv_fp4-inl.h"
#undef KT_VEC_TARGET
}  // namespace avx512

template <int M, int G>
void fp4_gemv_avx2(const float* x, const WeightMatrix& w, float* out) {
  avx2::fp4_gemv_rows<simd::F32x8, M, G>(x, w, out);
}

template <int M, int G>
void fp4_gemv_avx512(const float* x, const WeightMatrix& w, float* out) {
  avx512::fp4_gemv_rows<simd::F32x16, M, G>(x, w, out);
}

// bf16 x on AVX512-BF16, as the int4 kernel (quant_gemv_avx512.cpp) takes it: x reordered
// once per call into each 128 columns' four classes mod 4 (bf16_x_mod4), so that the four
// nibbles of each 16-bit word of a row's 64 bytes, shifted into place, index the 16 bf16
// values of e2m1 (exact) with one vpermw per 32 columns (it reads 5 bits: the table repeats); vdpbf16ps multiplies them with x
// exactly and sums in float32, lane i holding columns 8i .. 8i+7 of the step, and each lane's
// sum is scaled by its group's true scale (fp4_row_scales, once per row, vectorized;
// fp4_lane_scales: nvfp4's groups of 16 two lanes each).
// The columns after the last whole 128 go 32 at a time against x as it is (the word trick of
// decode32_bf16 puts each pair in column order).
constexpr int64_t kStep = 128;

// The true scales of a row's groups (not scale_table's halves: this kernel looks up the e2m1
// values themselves), 16 at a time: mxfp4's E8M0 byte e is the float32 of exponent bits e
// (e = 0: 2^-127, a denormal; 255: NaN); nvfp4's E4M3 byte through fp16 (value / 2^8,
// exactly) times 2^8 · global, which rounds as (value · global) does.
template <WeightFormat F>
KT_TARGET_AVX512 void fp4_row_scales(const uint8_t* bytes, int64_t groups, float global, float* dst) {
  for (int64_t g = 0; g < groups; g += 16) {
    // a row's last groups (fewer than 16) through a zeroed copy: no masked loads, which the
    // emulated AVX-512 build (csrc/platform/avx512_emulation.h) lacks
    const int64_t n = std::min<int64_t>(16, groups - g);
    alignas(16) uint8_t tail[16] = {};
    const uint8_t* src = bytes + g;
    if (n < 16) {
      std::copy(src, src + n, tail);
      src = tail;
    }
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m512 v;
    if constexpr (F == WeightFormat::kMxfp4) {
      const __m512i e = _mm512_cvtepu8_epi32(b);
      v = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
      v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_ps(0x1p-127f));
      v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_ps(NAN));
    } else {
      v = _mm512_mul_ps(_mm512_cvtph_ps(dequant::fp8x16_as_fp16(src)), _mm512_set1_ps(global * 256.0f));
    }
    if (n == 16) {
      _mm512_storeu_ps(dst + g, v);
    } else {
      alignas(64) float values[16];
      _mm512_store_ps(values, v);
      std::copy(values, values + n, dst + g);
    }
  }
}

template <int G>
KT_TARGET_AVX512 inline __m512 fp4_lane_scales(const float* s, int64_t c) {
  if constexpr (G == 16) {  // lane i: group c / 16 + i / 2
    alignas(64) static constexpr int32_t kPairs[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
    return _mm512_permutexvar_ps(_mm512_load_si512(kPairs), _mm512_castps256_ps512(_mm256_loadu_ps(s + c / 16)));
  } else {
    return step_lane_scales<G>(s, c);
  }
}

template <int M, int G>
KT_TARGET_AVX512_BF16 void fp4_gemv_bf16(const uint16_t* x, int64_t ldx, const uint16_t* xp, const WeightMatrix& w,
                                         float* scale_buffer, float* out) {
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G, steps = K / kStep;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale.const_data_ptr());
  alignas(64) uint16_t words[32];  // the e2m1 values as bf16 (exact); the true scales below
  for (int i = 0; i < 32; ++i) words[i] = simd::float_to_bf16(0.5f * float(kE2m1TwiceValues[i % 16]));
  const __m512i table = _mm512_load_si512(words);  // entries 16-31 repeat 0-15: vpermw reads 5 bits
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const uint8_t* row_scales = scales + r * groups;
    fp4_row_scales<G == 16 ? WeightFormat::kNvfp4 : WeightFormat::kMxfp4>(row_scales, groups, w.global_scale,
                                                                          scale_buffer);
    __m512 acc[M][2];
    KT_UNROLL for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < steps; ++b) {
      const int64_t c = b * kStep;
      if (row_ahead != nullptr) prefetch_lines(row_ahead, c / 2, c / 2 + 64);
      const __m512i v = _mm512_loadu_si512(row + c / 2);
      const __m512bh wv[4] = {
          (__m512bh)_mm512_permutexvar_epi16(v, table),
          (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table),  // vpermw: bits 0-4 of each
          (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table),  // word, the table repeating
          (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table)};
      const __m512 sv = fp4_lane_scales<G>(scale_buffer, c);
      KT_UNROLL for (int m = 0; m < M; ++m) {
        const uint16_t* xb = xp + (m * steps + b) * kStep;
        __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), wv[0], (__m512bh)_mm512_loadu_si512(xb));
        KT_UNROLL for (int k = 1; k < 4; ++k) {
          part = _mm512_dpbf16_ps(part, wv[k], (__m512bh)_mm512_loadu_si512(xb + 32 * k));
        }
        acc[m][b & 1] = _mm512_fmadd_ps(sv, part, acc[m][b & 1]);
      }
    }
    for (int64_t c = steps * kStep; c < K; c += 32) {  // 32, 64 or 96 columns
      const __m512 sv = G == 16 ? _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scale_buffer[c / 16]),
                                                       _mm512_set1_ps(scale_buffer[c / 16 + 1]))
                                : _mm512_set1_ps(scale_buffer[c / G]);
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
      const __m512i wv = _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), table);
      KT_UNROLL for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_loadu_si512(x + m * ldx + c);
        const __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wv, (__m512bh)xv);
        acc[m][0] = _mm512_fmadd_ps(part, sv, acc[m][0]);
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

void gemv_fp4_bf16(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out) {
  TORCH_INTERNAL_ASSERT(is_fp4(w.format) && w.cols % 32 == 0 && (w.group == 16 || w.group == 32));
  const int64_t K = w.cols, steps = K / kStep;
  AlignedFloats xp_buffer((M * steps * kStep + 1) / 2), scale_buffer(K / w.group);
  uint16_t* xp = reinterpret_cast<uint16_t*>(xp_buffer.data());
  bf16_x_mod4(x, ldx, M, K, xp, nullptr);
  for_row_chunks(M, [&](int64_t m0, auto rows) {
    constexpr int R = decltype(rows)::value;
    const uint16_t* xm = x + m0 * ldx;
    const uint16_t* xpm = xp + m0 * steps * kStep;
    float* om = out + m0 * w.rows;
    if (w.group == 16) return fp4_gemv_bf16<R, 16>(xm, ldx, xpm, w, scale_buffer.data(), om);
    fp4_gemv_bf16<R, 32>(xm, ldx, xpm, w, scale_buffer.data(), om);
  });
}

void gemv_fp4(const float* x, int64_t M, const WeightMatrix& w, bool avx512, float* out) {
  TORCH_INTERNAL_ASSERT(is_fp4(w.format) && w.cols % 32 == 0 && (w.group == 16 || w.group == 32));
  for_row_chunks(M, [&](int64_t m0, auto rows) {
    // each chunk's rows of out: [rows, R] at out + m0 · R
    fp4_gemv_rows<decltype(rows)::value>(x + m0 * w.cols, w, avx512, out + m0 * w.rows);
  });
}

}  // namespace qgemv
}  // namespace kt
