// Kernels of dequantize_rows (see dequantize.h): the reference loop, then the AVX2 kernel.
// Each row is cut into segments of one scale (an fp8 block's 128 columns, an int4 group, the
// whole row for int8); a segment is 8 (fp8, int8) or 16 (int4) values per vector step.
#include "ops/dequantize.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <immintrin.h>

#include "ops/simd.h"

namespace kt {
namespace {

// The scale of (row, column segment starting at col) and the segment's end column.
struct Segment {
  float scale;
  int64_t end;
};

inline float scale_at(const WeightMatrix& w, int64_t i) {
  const void* p = w.scale.const_data_ptr();
  return w.scale.scalar_type() == at::kFloat ? static_cast<const float*>(p)[i]
                                             : simd::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

inline Segment segment(const WeightMatrix& w, int64_t row, int64_t col) {
  switch (w.format) {
    case WeightFormat::kFp8: {
      const int64_t blocks_per_row = w.scale.size(1);
      return {scale_at(w, (row / kFp8Block) * blocks_per_row + col / kFp8Block),
              std::min(w.cols, (col / kFp8Block + 1) * kFp8Block)};
    }
    case WeightFormat::kInt8: return {scale_at(w, row), w.cols};
    default: return {scale_at(w, row * w.scale.size(1) + col / w.group), (col / w.group + 1) * w.group};
  }
}

inline const uint8_t* row_bytes(const WeightMatrix& w, int64_t row) {
  return static_cast<const uint8_t*>(w.data.const_data_ptr()) + row * w.data.stride(0);
}

// The raw (unscaled) value of column c of a row.
inline float raw_value(const WeightMatrix& w, const uint8_t* row, int64_t c) {
  switch (w.format) {
    case WeightFormat::kFp8: return fp8_e4m3_to_float(row[c]);
    case WeightFormat::kInt8: return static_cast<float>(static_cast<int8_t>(row[c]));
    default: return static_cast<float>(((row[c / 2] >> ((c & 1) * 4)) & 0xF) - 8);
  }
}

void dequantize_reference(const WeightMatrix& w, int64_t row0, int64_t rows, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = row_bytes(w, row0 + r);
    for (int64_t c = 0; c < w.cols;) {
      const Segment seg = segment(w, row0 + r, c);
      for (; c < seg.end; ++c) dst[r * ld + c] = raw_value(w, src, c) * seg.scale;
    }
  }
}

// 8 float8 e4m3fn bytes -> 8 floats, exactly: the 7 magnitude bits shifted into an fp16's
// exponent and mantissa give the value / 2^8 (F16C converts fp16 subnormals exactly, so fp8
// subnormals are exact too); the magnitude 0x7f is NaN.
KT_TARGET_AVX2 inline __m256 fp8x8_times(const uint8_t* p, __m256 scale_times_256) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(int16_t(0x8000))));
  h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7e00)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), scale_times_256);
}

KT_TARGET_AVX2 inline __m256 int8x8_times(const uint8_t* p, __m256 scale) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(v), scale);
}

// 8 bytes of int4 (16 values, in column order) -> two vectors of 8 floats.
KT_TARGET_AVX2 inline void int4x16_times(const uint8_t* p, __m256 scale, __m256& lo8, __m256& hi8) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  const __m128i values = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), _mm_set1_epi8(8));  // 16 columns in order
  lo8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values)), scale);
  hi8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8))), scale);
}

KT_TARGET_AVX2 void dequantize_avx2(const WeightMatrix& w, int64_t row0, int64_t rows, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = row_bytes(w, row0 + r);
    float* out = dst + r * ld;
    for (int64_t c = 0; c < w.cols;) {
      const Segment seg = segment(w, row0 + r, c);
      if (w.format == WeightFormat::kInt4) {  // segments are whole groups: multiples of 32 columns
        const __m256 s = _mm256_set1_ps(seg.scale);
        for (; c < seg.end; c += 16) {
          __m256 a, b;
          int4x16_times(src + c / 2, s, a, b);
          _mm256_storeu_ps(out + c, a);
          _mm256_storeu_ps(out + c + 8, b);
        }
        continue;
      }
      if (w.format == WeightFormat::kFp8) {
        const __m256 s = _mm256_set1_ps(seg.scale * 256.0f);
        for (; c + 8 <= seg.end; c += 8) _mm256_storeu_ps(out + c, fp8x8_times(src + c, s));
      } else {
        const __m256 s = _mm256_set1_ps(seg.scale);
        for (; c + 8 <= seg.end; c += 8) _mm256_storeu_ps(out + c, int8x8_times(src + c, s));
      }
      for (; c < seg.end; ++c) out[c] = raw_value(w, src, c) * seg.scale;
    }
  }
}

}  // namespace

float fp8_e4m3_to_float(uint8_t v) { return static_cast<float>(c10::Float8_e4m3fn(v, c10::Float8_e4m3fn::from_bits())); }

void dequantize_rows(const WeightMatrix& w, int64_t row0, int64_t rows, float* dst, int64_t ld, CpuIsa isa) {
  TORCH_INTERNAL_ASSERT(w.quantized() && row0 >= 0 && row0 + rows <= w.rows);
  if (isa == CpuIsa::kPortable) {
    dequantize_reference(w, row0, rows, dst, ld);
  } else {
    dequantize_avx2(w, row0, rows, dst, ld);
  }
}

}  // namespace kt
