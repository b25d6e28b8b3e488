// AVX-512 (F, BW, VL, DQ, BF16, VNNI, VBMI) and AMX-BF16's tiles emulated on AVX2, for the test build of the kernels only
// (KT_OPS_EMULATE_AVX512, built by tests/avx512_emulation.py with -mavx2 -mfma -mf16c). It lets the avx512 and
// avx512_bf16 kernels run, and be compared with their reference loops, on CPUs without AVX-512, as CI's
// often are. Never part of the library users build.
//
// SIMDe (Debian's libsimde-dev) provides most intrinsics under their own names (its "native aliases", switched
// on here for the AVX-512 extensions only, so the AVX2 kernels keep the compiler's). The ones SIMDe 0.7 lacks
// follow, lane by lane, as Intel's pseudocode defines them, and so do the AMX tile instructions (a thread's
// eight tiles as plain memory; SIMDe has no AMX). Where this differs from the hardware, it stays within what
// the kernels may rely on: _mm512_rcp14_ps is an exact reciprocal (the hardware's is within 2^-14);
// _mm512_reduce_add_ps / _max_ps reduce in GCC's order (halves first), which the hardware leaves to the compiler;
// SIMDe's _mm512_dpbf16_ps reads denormal bf16 operands as they are, where VDPBF16PS reads them as zero.
#pragma once

#ifndef KT_OPS_EMULATE_AVX512
#error "avx512_emulation.h is for the emulated test build only (KT_OPS_EMULATE_AVX512)"
#endif
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the emulated AVX-512 build needs -mavx2 -mfma -mf16c"
#endif

#define SIMDE_X86_AVX512F_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512BW_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VL_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512DQ_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512BF16_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VNNI_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VBMI_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kt_avx512_emulation {

// A vector's lanes as an array, and back: the vector types are plain bits.
template <typename Lane, typename Vec>
struct Lanes {
  static constexpr int kCount = sizeof(Vec) / sizeof(Lane);
  Lane v[kCount];
  explicit Lanes(const Vec& vec) { std::memcpy(v, &vec, sizeof vec); }
  Lanes() : v{} {}
  Vec vec() const {
    Vec out;
    std::memcpy(&out, v, sizeof out);
    return out;
  }
};

// Widening and narrowing moves: lane i of the result is lane i of a, converted.
template <typename To, typename ToVec, typename From, typename FromVec>
inline ToVec convert_lanes(const FromVec& a) {
  const Lanes<From, FromVec> in(a);
  Lanes<To, ToVec> out;
  static_assert(Lanes<To, ToVec>::kCount <= Lanes<From, FromVec>::kCount, "too few source lanes");
  for (int i = 0; i < Lanes<To, ToVec>::kCount; ++i) out.v[i] = static_cast<To>(in.v[i]);
  return out.vec();
}

// VCVTNEPS2BF16: round to nearest even; NaN stays NaN, quieted; denormal inputs become signed zero.
inline uint16_t float_to_bf16_as_hardware(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t exponent = (bits >> 23) & 0xff, mantissa = bits & 0x7fffff;
  if (exponent == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000);
  if (exponent == 0xff && mantissa != 0) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// Loads of the lanes whose mask bit is set, zero elsewhere; masked-off lanes are never read (the
// hardware suppresses their faults, and the kernels rely on it at the ends of rows).
template <typename Lane, typename Vec, typename Mask>
inline Vec maskz_load(Mask k, const void* p) {
  Lanes<Lane, Vec> out;
  const Lane* src = static_cast<const Lane*>(p);
  for (int i = 0; i < Lanes<Lane, Vec>::kCount; ++i) {
    if ((k >> i) & 1) std::memcpy(&out.v[i], src + i, sizeof(Lane));
  }
  return out.vec();
}

inline simde__mmask32 cmpeq_epi16_mask(simde__m512i a, simde__m512i b) {
  const Lanes<int16_t, simde__m512i> x(a), y(b);
  uint32_t k = 0;
  for (int i = 0; i < 32; ++i) k |= static_cast<uint32_t>(x.v[i] == y.v[i]) << i;
  return k;
}

inline simde__m256bh cvtneps_pbh(simde__m512 a) {
  const Lanes<float, simde__m512> in(a);
  Lanes<uint16_t, simde__m256bh> out;
  for (int i = 0; i < 16; ++i) out.v[i] = float_to_bf16_as_hardware(in.v[i]);
  return out.vec();
}

// Lanes 0-15 from b, 16-31 from a.
inline simde__m512bh cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  const Lanes<float, simde__m512> hi(a), lo(b);
  Lanes<uint16_t, simde__m512bh> out;
  for (int i = 0; i < 16; ++i) {
    out.v[i] = float_to_bf16_as_hardware(lo.v[i]);
    out.v[16 + i] = float_to_bf16_as_hardware(hi.v[i]);
  }
  return out.vec();
}

// 16 halves, exactly (F16C's conversion, eight at a time).
inline simde__m512 cvtph_ps(__m256i a) {
  const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(a));
  const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
  Lanes<float, simde__m512> out;
  std::memcpy(out.v, &lo, sizeof lo);
  std::memcpy(out.v + 8, &hi, sizeof hi);
  return out.vec();
}

// VSHUFI32X4 / VSHUFI64X2 (the same without a mask): quarters 0-1 of the result from a, 2-3 from b, each picked
// by two bits of imm.
inline simde__m512i shuffle_128_bit_quarters(simde__m512i a, simde__m512i b, int imm) {
  const Lanes<__m128i, simde__m512i> x(a), y(b);
  Lanes<__m128i, simde__m512i> out;
  for (int q = 0; q < 4; ++q) out.v[q] = (q < 2 ? x : y).v[(imm >> (2 * q)) & 3];
  return out.vec();
}

inline simde__m512 rcp14_ps(simde__m512 a) {
  Lanes<float, simde__m512> r(a);
  for (float& x : r.v) x = 1.0f / x;
  return r.vec();
}

inline float reduce_add_ps(simde__m512 a) {
  Lanes<float, simde__m512> r(a);
  for (int width = 8; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) r.v[i] += r.v[i + width];
  }
  return r.v[0];
}

// VMAXPS's order reduced (GCC's, halves first); the kernels reduce magnitudes, never NaN.
inline float reduce_max_ps(simde__m512 a) {
  Lanes<float, simde__m512> r(a);
  for (int width = 8; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) r.v[i] = r.v[i] > r.v[i + width] ? r.v[i] : r.v[i + width];
  }
  return r.v[0];
}

// VCVTPS2DQ under MXCSR's default rounding (to nearest even); NaN and out-of-range values give
// the "integer indefinite" 0x80000000, as the hardware does.
inline simde__m512i cvtps_epi32(simde__m512 a) {
  const Lanes<float, simde__m512> in(a);
  Lanes<int32_t, simde__m512i> out;
  for (int i = 0; i < 16; ++i) {
    const float r = std::nearbyint(in.v[i]);
    out.v[i] = r >= -2147483648.0f && r < 2147483648.0f ? static_cast<int32_t>(r) : INT32_MIN;
  }
  return out.vec();
}

// ---- AMX-BF16 tiles (amx_gemm.cpp): eight 1 KiB tiles of 16 rows of 64 bytes per thread ------------------

struct TileState {
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][1024] = {};
};

inline TileState& tile_state() {
  thread_local TileState state;
  return state;
}

// LDTILECFG's 64-byte layout: palette, start row, 14 reserved bytes, colsb[16] (uint16), rows[16].
inline void tile_loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  TileState& s = tile_state();
  for (int t = 0; t < 8; ++t) {
    std::memcpy(&s.colsb[t], c + 16 + 2 * t, 2);
    s.rows[t] = c[48 + t];
  }
}

inline void tile_zero(int t) { std::memset(tile_state().data[t], 0, 1024); }

inline void tile_loadd(int t, const void* base, int64_t stride) {
  TileState& s = tile_state();
  std::memset(s.data[t], 0, 1024);
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(s.data[t] + 64 * r, static_cast<const uint8_t*>(base) + r * stride, s.colsb[t]);
}

inline void tile_stored(int t, void* base, int64_t stride) {
  const TileState& s = tile_state();
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t] + 64 * r, s.colsb[t]);
}

// A bf16 operand as TDPBF16PS reads it: denormals as zero.
inline float bf16_operand(uint16_t v) {
  if ((v & 0x7f80) == 0) v &= 0x8000;
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// TDPBF16PS, in the order of Intel's pseudocode: c[m][n] += a[m][2k]·b[k][2n], then += a[m][2k+1]·b[k][2n+1].
inline void tile_dpbf16ps(int c, int a, int b) {
  TileState& s = tile_state();
  for (int m = 0; m < s.rows[a]; ++m) {
    float row[16];
    std::memcpy(row, s.data[c] + 64 * m, 64);
    uint16_t am[32];
    std::memcpy(am, s.data[a] + 64 * m, 64);
    for (int k = 0; k < s.colsb[a] / 4; ++k) {
      uint16_t bk[32];
      std::memcpy(bk, s.data[b] + 64 * k, 64);
      for (int n = 0; n < s.colsb[c] / 4; ++n) {
        row[n] += bf16_operand(am[2 * k]) * bf16_operand(bk[2 * n]);
        row[n] += bf16_operand(am[2 * k + 1]) * bf16_operand(bk[2 * n + 1]);
      }
    }
    std::memcpy(s.data[c] + 64 * m, row, 64);
  }
}

}  // namespace kt_avx512_emulation

// The intrinsics SIMDe 0.7 lacks, under their own names.
#undef _mm512_cmpeq_epi16_mask
#define _mm512_cmpeq_epi16_mask(a, b) kt_avx512_emulation::cmpeq_epi16_mask(a, b)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) (kt_avx512_emulation::convert_lanes<int16_t, __m256i, int32_t, simde__m512i>(a))
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a) (kt_avx512_emulation::convert_lanes<float, simde__m512, int32_t, simde__m512i>(a))
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) (kt_avx512_emulation::convert_lanes<int32_t, simde__m512i, int8_t, __m128i>(a))
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a) (kt_avx512_emulation::convert_lanes<int32_t, simde__m512i, uint8_t, __m128i>(a))
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a) (kt_avx512_emulation::convert_lanes<int16_t, simde__m512i, uint8_t, __m256i>(a))
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(a) (kt_avx512_emulation::convert_lanes<int32_t, simde__m512i, uint16_t, __m256i>(a))
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh(a) kt_avx512_emulation::cvtneps_pbh(a)
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) kt_avx512_emulation::cvtne2ps_pbh(a, b)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(a) kt_avx512_emulation::cvtph_ps(a)
#undef _mm512_maskz_loadu_epi8
#define _mm512_maskz_loadu_epi8(k, p) (kt_avx512_emulation::maskz_load<int8_t, simde__m512i>(k, p))
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16(k, p) (kt_avx512_emulation::maskz_load<int16_t, simde__m512i>(k, p))
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16(k, p) (kt_avx512_emulation::maskz_load<int16_t, __m256i>(k, p))
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) (kt_avx512_emulation::maskz_load<float, simde__m512>(k, p))
#undef _mm512_rcp14_ps
#define _mm512_rcp14_ps(a) kt_avx512_emulation::rcp14_ps(a)
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(a) kt_avx512_emulation::reduce_add_ps(a)
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps(a) kt_avx512_emulation::reduce_max_ps(a)
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32(a) kt_avx512_emulation::cvtps_epi32(a)
#undef _mm512_shuffle_i32x4
#define _mm512_shuffle_i32x4(a, b, imm) kt_avx512_emulation::shuffle_128_bit_quarters(a, b, imm)
#undef _mm512_shuffle_i64x2
#define _mm512_shuffle_i64x2(a, b, imm) kt_avx512_emulation::shuffle_128_bit_quarters(a, b, imm)
#undef _tile_loadconfig
#define _tile_loadconfig(config) kt_avx512_emulation::tile_loadconfig(config)
#undef _tile_zero
#define _tile_zero(t) kt_avx512_emulation::tile_zero(t)
#undef _tile_loadd
#define _tile_loadd(t, base, stride) kt_avx512_emulation::tile_loadd(t, base, stride)
#undef _tile_stored
#define _tile_stored(t, base, stride) kt_avx512_emulation::tile_stored(t, base, stride)
#undef _tile_dpbf16ps
#define _tile_dpbf16ps(c, a, b) kt_avx512_emulation::tile_dpbf16ps(c, a, b)
#undef _tile_release
#define _tile_release() ((void)0)
