// One vector of floats per width, as a type: the operations of the kernel bodies written once
// for both vector widths (kernels/quant_gemv_int4-inl.h, kernels/swiglu-inl.h). Each member
// carries its path's target attribute, as simd.h's helpers do, so F32x16 is only usable from
// AVX-512 code. Masks are what each width compares into (a vector of all-ones lanes on AVX2, a
// mask register on AVX-512); keep(m, v) is v where m holds and 0 elsewhere.
#pragma once

#include <type_traits>

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
  KT_TARGET_AVX2 static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  KT_TARGET_AVX2 static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  KT_TARGET_AVX2 static Reg min(Reg a, Reg b) { return _mm256_min_ps(a, b); }
  KT_TARGET_AVX2 static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  KT_TARGET_AVX2 static Reg sigmoid(Reg v) { return sigmoid8(v); }
  // float, or bf16 (any 2-byte type) widened exactly.
  template <class T>
  KT_TARGET_AVX2 static Reg load_values(const T* p) {
    if constexpr (std::is_same_v<T, float>) return load(p);
    else return load_bf16(reinterpret_cast<const uint16_t*>(p));
  }
  KT_TARGET_AVX2 static void store_bf16(uint16_t* p, Reg v) { store8_bf16(p, v); }
  using Mask = __m256;
  KT_TARGET_AVX2 static Mask le(Reg a, Reg b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  KT_TARGET_AVX2 static Mask ge(Reg a, Reg b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  KT_TARGET_AVX2 static Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
  KT_TARGET_AVX2 static Reg keep(Mask m, Reg v) { return _mm256_and_ps(m, v); }
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
  KT_TARGET_AVX512 static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  KT_TARGET_AVX512 static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  KT_TARGET_AVX512 static Reg min(Reg a, Reg b) { return _mm512_min_ps(a, b); }
  KT_TARGET_AVX512 static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  KT_TARGET_AVX512 static Reg sigmoid(Reg v) { return sigmoid16(v); }
  template <class T>
  KT_TARGET_AVX512 static Reg load_values(const T* p) {
    if constexpr (std::is_same_v<T, float>) return load(p);
    else return load_bf16(reinterpret_cast<const uint16_t*>(p));
  }
  KT_TARGET_AVX512 static void store_bf16(uint16_t* p, Reg v) { store16_bf16(p, v); }
  // vcvtneps2bf16: AVX512-BF16 CPUs only.
  KT_TARGET_AVX512_BF16 static void store_bf16_native(uint16_t* p, Reg v) { store16_bf16_native(p, v); }
  using Mask = __mmask16;
  KT_TARGET_AVX512 static Mask le(Reg a, Reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  KT_TARGET_AVX512 static Mask ge(Reg a, Reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  KT_TARGET_AVX512 static Mask both(Mask a, Mask b) { return a & b; }
  KT_TARGET_AVX512 static Reg keep(Mask m, Reg v) { return _mm512_maskz_mov_ps(m, v); }
  KT_TARGET_AVX512 static float reduce_add(Reg v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace simd
}  // namespace kt
