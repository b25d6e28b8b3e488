#include "kernels/convert_rows.h"

#include "platform/simd.h"

namespace kt {
namespace {

// Reference: the plain loops, for columns [c0, cols).
void to_float_reference(const uint16_t* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t rows,
                        int64_t c0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < cols; ++c) dst[r * ld_dst + c] = simd::bf16_to_float(src[r * ld_src + c]);
  }
}

void to_bf16_reference(const float* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst, int64_t rows,
                       int64_t c0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < cols; ++c) dst[r * ld_dst + c] = simd::float_to_bf16(src[r * ld_src + c]);
  }
}

KT_TARGET_AVX2 void to_float_avx2(const uint16_t* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t rows,
                                  int64_t cols) {
  const int64_t c8 = cols / 8 * 8;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < c8; c += 8) _mm256_storeu_ps(dst + r * ld_dst + c, simd::load8_bf16(src + r * ld_src + c));
  }
  to_float_reference(src, ld_src, dst, ld_dst, rows, c8, cols);
}

KT_TARGET_AVX2 void to_bf16_avx2(const float* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst, int64_t rows,
                                 int64_t cols) {
  const int64_t c8 = cols / 8 * 8;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < c8; c += 8) simd::store8_bf16(dst + r * ld_dst + c, _mm256_loadu_ps(src + r * ld_src + c));
  }
  to_bf16_reference(src, ld_src, dst, ld_dst, rows, c8, cols);
}

KT_TARGET_AVX512 void to_float_avx512(const uint16_t* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t rows,
                                      int64_t cols) {
  const int64_t c16 = cols / 16 * 16;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < c16; c += 16) _mm512_storeu_ps(dst + r * ld_dst + c, simd::load16_bf16(src + r * ld_src + c));
  }
  to_float_reference(src, ld_src, dst, ld_dst, rows, c16, cols);
}

KT_TARGET_AVX512 void to_bf16_avx512(const float* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst, int64_t rows,
                                     int64_t cols) {
  const int64_t c16 = cols / 16 * 16;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < c16; c += 16) simd::store16_bf16(dst + r * ld_dst + c, _mm512_loadu_ps(src + r * ld_src + c));
  }
  to_bf16_reference(src, ld_src, dst, ld_dst, rows, c16, cols);
}

}  // namespace

void bf16_rows_to_float(const uint16_t* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t rows,
                        int64_t cols, CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAvx512: return to_float_avx512(src, ld_src, dst, ld_dst, rows, cols);
    case CpuIsa::kAvx2: return to_float_avx2(src, ld_src, dst, ld_dst, rows, cols);
    case CpuIsa::kPortable: return to_float_reference(src, ld_src, dst, ld_dst, rows, 0, cols);
  }
}

void float_rows_to_bf16(const float* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst, int64_t rows,
                        int64_t cols, CpuIsa isa) {
  switch (isa) {
    // The integer rounding of store16_bf16 equals vcvtneps2bf16's; one kernel serves both.
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAvx512: return to_bf16_avx512(src, ld_src, dst, ld_dst, rows, cols);
    case CpuIsa::kAvx2: return to_bf16_avx2(src, ld_src, dst, ld_dst, rows, cols);
    case CpuIsa::kPortable: return to_bf16_reference(src, ld_src, dst, ld_dst, rows, 0, cols);
  }
}

}  // namespace kt
