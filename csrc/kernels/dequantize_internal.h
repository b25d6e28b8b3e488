// What dequantize.cpp and dequantize_packed.cpp share: the scale of a weight segment (per call
// from the tensors, or from QuantView's raw pointers in the packed kernels' inner loops), a
// row's bytes, and the AVX-512 decoders of a row's values.
#pragma once

#include <algorithm>
#include <cstdint>

#include "platform/cpu_isa.h"
#include "kernels/expert_weights.h"
#include "platform/simd.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace dequant {

// The scale of (row, column segment starting at col) and the segment's end column.
struct Segment {
  float scale;
  int64_t end;
};

// The scale a kernel multiplies scale i's values by: float32 or bf16 as stored; for the fp4
// formats the table's entry for the stored byte (half the scale, see nibble_values).
inline float scale_at(const WeightMatrix& w, int64_t i) {
  const void* p = w.scale.const_data_ptr();
  if (w.scale_table != nullptr) return w.scale_table[static_cast<const uint8_t*>(p)[i]];
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

// A quantized matrix's bytes and scales as raw pointers, for kernels that look a scale up
// every few dozen values (at::Tensor's accessors cost more than that).
struct QuantView {
  const uint8_t* data;
  int64_t row_stride;          // bytes
  const float* scale_f32;      // one of the three is set
  const uint16_t* scale_bf16;
  const uint8_t* scale_bytes;  // fp4: looked up in scale_table
  const float* scale_table;
  int64_t scales_per_row;      // fp8: blocks per row of blocks; int4 / fp4: groups per row
  int group_shift;             // int4 / fp4: log2(group)

  explicit QuantView(const WeightMatrix& w)
      : data(static_cast<const uint8_t*>(w.data.const_data_ptr())),
        row_stride(w.data.stride(0)),
        scale_f32(w.scale.scalar_type() == at::kFloat ? w.scale.const_data_ptr<float>() : nullptr),
        scale_bf16(w.scale.scalar_type() == at::kBFloat16 ? static_cast<const uint16_t*>(w.scale.const_data_ptr())
                                                          : nullptr),
        scale_bytes(w.scale_table != nullptr ? static_cast<const uint8_t*>(w.scale.const_data_ptr()) : nullptr),
        scale_table(w.scale_table),
        scales_per_row(w.format == WeightFormat::kInt8 ? 1 : w.scale.size(1)),
        group_shift(is_nibble_format(w.format) ? __builtin_ctzll(w.group) : 0) {}

  const uint8_t* row(int64_t r) const { return data + r * row_stride; }

  // The index of w[r, c]'s scale in format F.
  template <WeightFormat F>
  int64_t scale_index(int64_t r, int64_t c) const {
    return F == WeightFormat::kFp8    ? (r / kFp8Block) * scales_per_row + c / kFp8Block
           : F == WeightFormat::kInt8 ? r
                                      : r * scales_per_row + (c >> group_shift);
  }

  // The scale of w[r, c] in format F (fp4: as the kernels multiply nibble_values by it).
  template <WeightFormat F>
  float scale(int64_t r, int64_t c) const {
    const int64_t i = scale_index<F>(r, c);
    if constexpr (is_fp4(F)) return scale_table[scale_bytes[i]];
    return scale_f32 != nullptr ? scale_f32[i] : simd::bf16_to_float(scale_bf16[i]);
  }

  // Where w[r, c]'s scale lies (for prefetching).
  template <WeightFormat F>
  const char* scale_address(int64_t r, int64_t c) const {
    const int64_t i = scale_index<F>(r, c);
    if constexpr (is_fp4(F)) return reinterpret_cast<const char*>(scale_bytes + i);
    return scale_f32 != nullptr ? reinterpret_cast<const char*>(scale_f32 + i)
                                : reinterpret_cast<const char*>(scale_bf16 + i);
  }
};

// 16 float8 e4m3fn bytes -> 16 fp16 values of value / 2^8, exactly: the 7 magnitude bits
// shifted into an fp16's exponent and mantissa (vcvtph2ps converts fp16 subnormals exactly, so
// fp8 subnormals are exact too); the magnitude 0x7f is NaN.
KT_TARGET_AVX512 inline __m256i fp8x16_as_fp16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                                    _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16(int16_t(0x8000))));
  return _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7e00)));
}

// The scale a decoder of format F multiplies by: fp8's decoder yields value / 2^8.
template <WeightFormat F>
inline float decoder_scale(float scale) {
  return F == WeightFormat::kFp8 ? scale * 256.0f : scale;
}

// Columns c .. c+15 of an fp8 or int8 row (its bytes `row`) as float32 q·s, s =
// decoder_scale<F>(the segment's scale) broadcast; the 16 columns lie in one segment. (int4
// rows decode 32 columns per 16 bytes, in dequantize.cpp's loop.)
template <WeightFormat F>
KT_TARGET_AVX512 inline __m512 decode16(const uint8_t* row, int64_t c, __m512 s) {
  static_assert(F == WeightFormat::kFp8 || F == WeightFormat::kInt8, "fp8 or int8");
  if constexpr (F == WeightFormat::kFp8) {
    return _mm512_mul_ps(_mm512_cvtph_ps(fp8x16_as_fp16(row + c)), s);
  } else {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(v), s);
  }
}

// Columns c .. c+31 of a row as 32 bf16 values of q·s (float32 q·s rounded to nearest even;
// vcvtneps2bf16 flushes float32 denormals), s the scale of the 32 columns' segment; c is even.
// fp8 widens 32 bytes at once in 16-bit lanes to the fp16 of value / 2^8 (fp8x16_as_fp16's
// bits), then converts and multiplies; int8 converts and multiplies; int4 looks its values up
// in the table of the 16 products (q − 8)·s made per call (vpermw: 32 lookups in one
// instruction; 10-15% faster than converting each value, Zen 4). A table of fp8's 8 mantissas
// with the exponent added as an integer ran 25% slower than the conversion.
//
// decode32_bytes_bf16: the same for fp8 and int8 from 32 bytes already in a register, value j
// scaled by s_lo[j] (j < 16) or s_hi[j - 16] (decoder_scale<F> applied), for kernels that
// rearrange the bytes before decoding.
template <WeightFormat F>
KT_TARGET_AVX512_BF16 inline __m512i decode32_bytes_bf16(__m256i bytes, __m512 s_lo, __m512 s_hi) {
  static_assert(F == WeightFormat::kFp8 || F == WeightFormat::kInt8, "fp8 or int8");
  if constexpr (F == WeightFormat::kFp8) {
    const __m512i b = _mm512_cvtepu8_epi16(bytes);
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    // (mag << 7) | ((b << 8) & 0x8000); NaN for the magnitude 0x7f
    __m512i h = _mm512_ternarylogic_epi32(_mm512_slli_epi16(mag, 7), _mm512_slli_epi16(b, 8),
                                          _mm512_set1_epi16(int16_t(0x8000)), 0xf8);
    h = _mm512_mask_mov_epi16(h, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)),
                              _mm512_or_si512(h, _mm512_set1_epi16(0x7e00)));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s_lo);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s_hi);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes))), s_lo);
    const __m512 hi =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1))), s_hi);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

// The fp4 formats' 16 nibble values (2 · e2m1) as floats.
KT_TARGET_AVX512 inline __m512 fp4_values_ps() {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1TwiceValues))));
}

// Columns c .. c+31 of a row of a nibble format F (int4, mxfp4, nvfp4) as 32 bf16 values of
// value · s: the 32 products of its nibble_values by the scales s_lo (columns c .. c+15) and
// s_hi (c+16 .. c+31; the same but for nvfp4's groups of 16) in one table of 32 bf16, and one
// vpermw. Word 2j of byte j widened to a dword, OR-ed with itself shifted by 12, holds byte j
// (its low nibble and, above it, bits vpermw must not see), word 2j + 1 its high nibble:
// masked to the nibble, plus 16 for the words of columns 16-31.
template <WeightFormat F>
KT_TARGET_AVX512_BF16 inline __m512i decode32_nibbles_bf16(const uint8_t* row, int64_t c, float s_lo, float s_hi) {
  static_assert(F == WeightFormat::kNvfp4, "int4 and mxfp4 take decode32_bf16");
  const __m512 values = fp4_values_ps();
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(values, _mm512_set1_ps(s_hi)),
                                                     _mm512_mul_ps(values, _mm512_set1_ps(s_lo)));
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
  const __m512i words = _mm512_or_si512(d, _mm512_slli_epi32(d, 12));
  const __m512i upper = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 16);
  // (words & 0xF) | upper
  return _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(words, _mm512_set1_epi16(0xF), upper, 0xEA), table);
}

template <WeightFormat F>
KT_TARGET_AVX512_BF16 inline __m512i decode32_bf16(const uint8_t* row, int64_t c, float scale) {
  if constexpr (F == WeightFormat::kFp8) {
    const __m512 s = _mm512_set1_ps(decoder_scale<F>(scale));
    return decode32_bytes_bf16<F>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)), s, s);
  } else if constexpr (F == WeightFormat::kInt8) {  // two widening loads: no extract
    const __m512 s = _mm512_set1_ps(scale);
    const __m128i* p = reinterpret_cast<const __m128i*>(row + c);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), s);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), s);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    // int4's q - 8, or mxfp4's 2 · e2m1 (its one scale covers the 32 columns; nvfp4 takes
    // decode32_nibbles_bf16)
    const __m512 values = F == WeightFormat::kMxfp4
                              ? fp4_values_ps()
                              : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 products = _mm512_mul_ps(values, _mm512_set1_ps(scale));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(products, products);  // entries 16-31 = 0-15
    // vpermw reads an index's low 5 bits only, and the table repeats after 16 entries, so the
    // nibbles need no masking: byte j widened to dword j, OR-ed with itself shifted by 12, is
    // word 2j = byte j (low nibble, then bits that are ignored) and word 2j + 1 = its high
    // nibble. 3 instructions where unpacking the nibbles into bytes took 8.
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
    return _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), table);
  }
}

// ---- fp8 through a table of one scale's 128 magnitudes ---------------------------------------
//
// The packed kernels decode many tiles under one fp8 block scale, so they look values up in the
// bf16 of the 128 magnitudes times the scale (decode32_bytes_bf16's own results, so the bits are
// the same) and flip the sign bit for negative codes (-(v·s) rounds as v·s does). Per 32 values:
// a widening, two 64-entry vpermt2w, a test and a blend, and the sign, where converting through
// fp16 and float32 took about 15 instructions.
constexpr int64_t kFp8TableEntries = 128;

// table[0 .. 127] = the bf16 of magnitude m (code m) times `scale`.
KT_TARGET_AVX512_BF16 inline void fill_fp8_table(float scale, uint16_t* table) {
  const __m512 s = _mm512_set1_ps(decoder_scale<WeightFormat::kFp8>(scale));
  alignas(32) uint8_t codes[32];
  for (int64_t m0 = 0; m0 < kFp8TableEntries; m0 += 32) {
    for (int j = 0; j < 32; ++j) codes[j] = static_cast<uint8_t>(m0 + j);
    const __m256i bytes = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes));
    _mm512_storeu_si512(table + m0, decode32_bytes_bf16<WeightFormat::kFp8>(bytes, s, s));
  }
}

struct Fp8Table {
  __m512i m0, m32, m64, m96;  // magnitudes 0-31, 32-63, 64-95, 96-127
};

KT_TARGET_AVX512 inline Fp8Table load_fp8_table(const uint16_t* table) {
  return {_mm512_loadu_si512(table), _mm512_loadu_si512(table + 32), _mm512_loadu_si512(table + 64),
          _mm512_loadu_si512(table + 96)};
}

// 32 fp8 bytes -> their 32 bf16 values in the table's scale: decode32_bytes_bf16's bits.
KT_TARGET_AVX512 inline __m512i decode32_fp8_table(__m256i bytes, const Fp8Table& t) {
  const __m512i code = _mm512_cvtepu8_epi16(bytes);
  const __m512i low = _mm512_permutex2var_epi16(t.m0, code, t.m32);   // index bits 0-5
  const __m512i high = _mm512_permutex2var_epi16(t.m64, code, t.m96);
  const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(code, _mm512_set1_epi16(0x40)), low, high);
  // v ^ ((code << 8) & 0x8000): the code's sign bit onto the value's
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(code, 8), _mm512_set1_epi16(int16_t(0x8000)), 0x78);
}

}  // namespace dequant
}  // namespace kt
