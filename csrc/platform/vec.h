// One vector of floats per width, as a type: the operations of the kernel bodies written once
// for both vector widths (kernels/quant_gemv_int4-inl.h). Each member carries its path's target
// attribute, as simd.h's helpers do, so F32x16 is only usable from AVX-512 code.
#pragma once

#include "platform/simd.h"

namespace kt {
namespace simd {

struct F32x8 {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  KT_TARGET_AVX2 static Reg zero() { return _mm256_setzero_ps(); }
  KT_TARGET_AVX2 static Reg set1(float v) { return _mm256_set1_ps(v); }
  KT_TARGET_AVX2 static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  KT_TARGET_AVX2 static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  KT_TARGET_AVX2 static Reg load_bf16(const uint16_t* p) { return load8_bf16(p); }
  KT_TARGET_AVX2 static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  KT_TARGET_AVX2 static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  KT_TARGET_AVX2 static float reduce_add(Reg v) { return hsum8(v); }
};

struct F32x16 {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  KT_TARGET_AVX512 static Reg zero() { return _mm512_setzero_ps(); }
  KT_TARGET_AVX512 static Reg set1(float v) { return _mm512_set1_ps(v); }
  KT_TARGET_AVX512 static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  KT_TARGET_AVX512 static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  KT_TARGET_AVX512 static Reg load_bf16(const uint16_t* p) { return load16_bf16(p); }
  KT_TARGET_AVX512 static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  KT_TARGET_AVX512 static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  KT_TARGET_AVX512 static float reduce_add(Reg v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace simd
}  // namespace kt
