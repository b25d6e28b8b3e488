// Kernels of dequantize_block (see dequantize.h): the reference loop, then the AVX2 and the
// AVX-512 kernels. Each row is cut into segments of one scale (an fp8 block's 128 columns, an
// int4 group, the whole row for int8); a segment is 8 / 16 values per AVX2 / AVX-512 step (16 /
// 32 for int4), its last few fp8 / int8 columns through the reference's scalar decode.
#include "kernels/dequantize.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/dequantize_internal.h"
#include "platform/simd.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace {

using dequant::row_bytes;
using dequant::scale_at;
using dequant::segment;
using dequant::Segment;

// The raw (unscaled) value of column c of a row.
inline float raw_value(const WeightMatrix& w, const uint8_t* row, int64_t c) {
  switch (w.format) {
    case WeightFormat::kFp8: return fp8_e4m3_to_float(row[c]);
    case WeightFormat::kInt8: return static_cast<float>(static_cast<int8_t>(row[c]));
    default: return static_cast<float>(nibble_values(w.format)[(row[c / 2] >> ((c & 1) * 4)) & 0xF]);
  }
}

// One dequantized value into a float32 or (rounded to nearest even) bfloat16 element.
inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = simd::float_to_bf16(v); }

template <typename T>
void dequantize_reference(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t col1, T* dst,
                          int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = row_bytes(w, row0 + r);
    T* out = dst + r * ld;
    for (int64_t c = col0; c < col1;) {
      const Segment seg = segment(w, row0 + r, c);
      for (const int64_t end = std::min(seg.end, col1); c < end; ++c) put(out + (c - col0), raw_value(w, src, c) * seg.scale);
    }
  }
}

// ---- AVX2 / F16C: 8 values per step ----------------------------------------------------------

// 8 float8 e4m3fn bytes -> 8 floats, exactly: the 7 magnitude bits shifted into an fp16's
// exponent and mantissa give the value / 2^8 (F16C converts fp16 subnormals exactly, so fp8
// subnormals are exact too); the magnitude 0x7f is NaN.
KT_TARGET_AVX2 inline __m128i fp8x8_as_fp16(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(int16_t(0x8000))));
  return _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7e00)));
}

KT_TARGET_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
KT_TARGET_AVX2 inline void store8(uint16_t* p, __m256 v) { simd::store8_bf16(p, v); }

template <typename T>
KT_TARGET_AVX2 void dequantize_avx2(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t col1,
                                    T* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = row_bytes(w, row0 + r);
    T* out = dst + r * ld;
    if (is_nibble_format(w.format)) {  // whole groups of 16 (nvfp4), 32, 64 or 128 columns
      const int64_t G = w.group, s0 = (row0 + r) * (w.cols / G);
      // the codes' values by a byte shuffle: int4's q - 8, fp4's 2 * e2m1 (nibble_values)
      const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibble_values(w.format)));
      for (int64_t g0 = col0; g0 < col1; g0 += G) {
        const __m256 s = _mm256_set1_ps(scale_at(w, s0 + g0 / G));
        for (int64_t c = g0; c < g0 + G; c += 16) {
          const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + c / 2));
          const __m128i mask = _mm_set1_epi8(0x0f);
          const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
          const __m128i values = _mm_shuffle_epi8(table, _mm_unpacklo_epi8(lo, hi));  // 16 columns in order
          store8(out + (c - col0), _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values)), s));
          store8(out + (c - col0) + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8))), s));
        }
      }
      continue;
    }
    for (int64_t c = col0; c < col1;) {
      const Segment seg = segment(w, row0 + r, c);
      const int64_t end = std::min(seg.end, col1);
      if (w.format == WeightFormat::kFp8) {
        const __m256 s = _mm256_set1_ps(seg.scale * 256.0f);
        for (; c + 8 <= end; c += 8) store8(out + (c - col0), _mm256_mul_ps(_mm256_cvtph_ps(fp8x8_as_fp16(src + c)), s));
      } else {
        const __m256 s = _mm256_set1_ps(seg.scale);
        for (; c + 8 <= end; c += 8) {
          const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + c)));
          store8(out + (c - col0), _mm256_mul_ps(_mm256_cvtepi32_ps(v), s));
        }
      }
      for (; c < end; ++c) put(out + (c - col0), raw_value(w, src, c) * seg.scale);
    }
  }
}

// ---- AVX-512: 16 values per step (32 for int4) --------------------------------------------------

using dequant::decode16;
using dequant::decoder_scale;

KT_TARGET_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// bf16 output on the avx512 path (the avx512_bf16 path converts natively, below).
KT_TARGET_AVX512 inline void store16(uint16_t* p, __m512 v) { simd::store16_bf16(p, v); }

template <typename T>
KT_TARGET_AVX512 void dequantize_avx512(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t col1,
                                        T* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = row_bytes(w, row0 + r);
    T* out = dst + r * ld;
    if (is_nibble_format(w.format)) {  // whole groups of 16 (nvfp4), 32, 64 or 128 columns
      const int64_t G = w.group, s0 = (row0 + r) * (w.cols / G);
      // the codes' values by a byte shuffle: int4's q - 8, fp4's 2 * e2m1 (nibble_values)
      const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibble_values(w.format)));
      const __m128i mask = _mm_set1_epi8(0x0f);
      for (int64_t g0 = col0; g0 < col1; g0 += G) {
        const __m512 s = _mm512_set1_ps(scale_at(w, s0 + g0 / G));
        if (G == 16) {
          const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + g0 / 2));
          const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
          const __m128i values = _mm_shuffle_epi8(table, _mm_unpacklo_epi8(lo, hi));
          store16(out + (g0 - col0), _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(values)), s));
          continue;
        }
        for (int64_t c = g0; c < g0 + G; c += 32) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c / 2));
          const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
          const __m128i first = _mm_shuffle_epi8(table, _mm_unpacklo_epi8(lo, hi));   // columns c .. c+15
          const __m128i second = _mm_shuffle_epi8(table, _mm_unpackhi_epi8(lo, hi));  // c+16 .. c+31
          store16(out + (c - col0), _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)), s));
          store16(out + (c - col0) + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)), s));
        }
      }
      continue;
    }
    for (int64_t c = col0; c < col1;) {
      const Segment seg = segment(w, row0 + r, c);
      const int64_t end = std::min(seg.end, col1);
      if (w.format == WeightFormat::kFp8) {
        const __m512 s = _mm512_set1_ps(decoder_scale<WeightFormat::kFp8>(seg.scale));
        for (; c + 16 <= end; c += 16) store16(out + (c - col0), decode16<WeightFormat::kFp8>(src, c, s));
      } else {
        const __m512 s = _mm512_set1_ps(seg.scale);
        for (; c + 16 <= end; c += 16) store16(out + (c - col0), decode16<WeightFormat::kInt8>(src, c, s));
      }
      for (; c < end; ++c) put(out + (c - col0), raw_value(w, src, c) * seg.scale);
    }
  }
}

// ---- AVX512-BF16: bf16 output through vcvtneps2bf16 -----------------------------------------

// 16 floats to bf16 in one instruction (simd::store16_bf16_native), where store16_bf16's
// integer rounding takes about 8 (a third of the bf16 dequantization's time). Both round to
// nearest even; the instruction also flushes float32 denormals (|q·s| < 2^-126) to zero, which
// the integer rounding keeps.
KT_TARGET_AVX512_BF16 void floats_to_bf16_native(const float* src, uint16_t* dst, int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) simd::store16_bf16_native(dst + c, _mm512_loadu_ps(src + c));
  for (; c < n; ++c) dst[c] = simd::float_to_bf16(src[c]);
}

// Each row dequantized to float32 by the AVX-512 kernel into an L1-resident buffer, then
// converted.
void dequantize_avx512_bf16(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t col1,
                            uint16_t* dst, int64_t ld) {
  std::vector<float> row(col1 - col0);
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_avx512(w, row0 + r, 1, col0, col1, row.data(), col1 - col0);
    floats_to_bf16_native(row.data(), dst + r * ld, col1 - col0);
  }
}

template <typename T>
void dequantize_on(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t cols, T* dst, int64_t ld,
                   CpuIsa isa) {
  const int64_t col1 = col0 + cols;
  TORCH_INTERNAL_ASSERT(w.quantized() && row0 >= 0 && row0 + rows <= w.rows && col0 >= 0 && col1 <= w.cols &&
                        (col0 % kFp8Block == 0 || (is_nibble_format(w.format) && col0 % w.group == 0)) &&
                        (col1 % kFp8Block == 0 || col1 == w.cols || (is_nibble_format(w.format) && col1 % w.group == 0)));
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
      if constexpr (std::is_same_v<T, uint16_t>) return dequantize_avx512_bf16(w, row0, rows, col0, col1, dst, ld);
      return dequantize_avx512(w, row0, rows, col0, col1, dst, ld);
    case CpuIsa::kAvx512: return dequantize_avx512(w, row0, rows, col0, col1, dst, ld);
    case CpuIsa::kAvx2: return dequantize_avx2(w, row0, rows, col0, col1, dst, ld);
    case CpuIsa::kPortable: return dequantize_reference(w, row0, rows, col0, col1, dst, ld);
  }
}

}  // namespace

float fp8_e4m3_to_float(uint8_t v) { return static_cast<float>(c10::Float8_e4m3fn(v, c10::Float8_e4m3fn::from_bits())); }

void dequantize_block(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t cols, float* dst,
                      int64_t ld, CpuIsa isa) {
  dequantize_on(w, row0, rows, col0, cols, dst, ld, isa);
}

void dequantize_block(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t cols, uint16_t* dst,
                      int64_t ld, CpuIsa isa) {
  dequantize_on(w, row0, rows, col0, cols, dst, ld, isa);
}

void dequantize_rows(const WeightMatrix& w, int64_t row0, int64_t rows, float* dst, int64_t ld, CpuIsa isa) {
  dequantize_on(w, row0, rows, int64_t{0}, w.cols, dst, ld, isa);
}

}  // namespace kt
