// Decode GEMV of bf16 activations on fp8 (E4M3) weights on AVX512-BF16 with AVX512-VBMI
// (quant_gemv.h). The float kernel (quant_gemv_avx512.cpp) spends four instructions per 16
// weights (widen, shift, mask, FMA) and a NaN scan; here each 64 weights take five:
//   the 64 codes of 64 columns are one load; two vpermt2b look up each code's magnitude (its low
//   7 bits) in 128-entry tables of the high and the low byte of the bf16 value it stands for
//   (exact: E4M3's 4 significant bits fit bf16's 8, and its subnormals 2^-9 .. 2^-6 are normal
//   bf16; code 0x7f is bf16 NaN); one vpternlogd puts the code's sign bit into the high bytes;
//   vpunpcklbw / vpunpckhbw make the bytes words: per 128-bit lane, columns 0-7 and 8-15.
//   vdpbf16ps multiplies them with x reordered to match once per call (products exact, float32
//   sums) and each 128-column block's sum is scaled by its block scale once.
// No special cases: a NaN code gives NaN in its row, as the dequantized weight does; an inf or
// NaN in x propagates as in x·wᵀ. vdpbf16ps reads bf16 denormals of x (|x| < 2^-126) as zero
// and flushes denormal partial sums, whatever MXCSR says (the int4 kernel does the same).
// Tested against float64 on every code, both scale dtypes, 128-row bands and column tails
// (tests/test_quant_decode_gemv.py), through quant_gemv_nt and the reference loop.
#include <cmath>
#include <cstring>

#include "kernels/quant_gemv_internal.h"

namespace kt {
namespace qgemv {
namespace {

constexpr int64_t kStep = 64;  // columns per step: one 64-byte load of codes

// The bf16 bits of the E4M3 value of magnitude code i (0..127), split into byte tables.
struct Fp8ByteTables {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
};

uint16_t e4m3_magnitude_to_bf16_bits(int i) {
  if (i == 0x7f) return 0x7fc0;  // NaN
  const int e = i >> 3, m = i & 7;
  const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return uint16_t(bits >> 16);  // exact: at most 4 significant bits
}

const Fp8ByteTables& fp8_byte_tables() {
  static const Fp8ByteTables tables = [] {
    Fp8ByteTables t;
    for (int i = 0; i < 128; ++i) {
      const uint16_t bits = e4m3_magnitude_to_bf16_bits(i);
      t.high[i] = uint8_t(bits >> 8);
      t.low[i] = uint8_t(bits & 0xff);
    }
    return t;
  }();
  return tables;
}

// x [M, K] bf16 (rows ldx apart) as the steps' word order: per 64 columns, 32 words matching
// the low words of the step's codes (columns 0-7, 16-23, 32-39, 48-55), then 32 matching the
// high ones (8-15, 24-31, 40-47, 56-63); the last partial step padded with zeros.
KT_TARGET_AVX512_BF16_VBMI void reorder_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp) {
  const int64_t steps = (K + kStep - 1) / kStep;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t c = s * kStep, left = K - c;
      const uint16_t* src = x + m * ldx + c;
      __m512i a0, a1;
      if (left >= kStep) {
        a0 = _mm512_loadu_si512(src);
        a1 = _mm512_loadu_si512(src + 32);
      } else {
        const auto mask = [](int64_t n) { return n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : (__mmask32(1) << n) - 1; };
        a0 = _mm512_maskz_loadu_epi16(mask(left), src);
        a1 = _mm512_maskz_loadu_epi16(mask(left - 32), src + 32);
      }
      uint16_t* dst = xp + (m * steps + s) * kStep;
      _mm512_storeu_si512(dst, _mm512_shuffle_i64x2(a0, a1, 0x88));       // 128-bit lanes 0, 2 of a0, then of a1
      _mm512_storeu_si512(dst + 32, _mm512_shuffle_i64x2(a0, a1, 0xdd));  // lanes 1, 3
    }
  }
}

// The 64 codes at p (Partial: those partial_mask selects, on a row's last partial step; zero for
// the rest) as bf16 words: low = the step's columns 0-7, 16-23, 32-39, 48-55, high = 8-15,
// 24-31, 40-47, 56-63.
template <bool Partial>
KT_TARGET_AVX512_BF16_VBMI inline void decode_step(const uint8_t* p, __mmask64 partial_mask, const __m512i (&tables)[4],
                                                   __m512bh& low, __m512bh& high) {
  const __m512i v = Partial ? _mm512_maskz_loadu_epi8(partial_mask, p) : _mm512_loadu_si512(p);
  const __m512i hb = _mm512_permutex2var_epi8(tables[0], v, tables[1]);
  const __m512i lb = _mm512_permutex2var_epi8(tables[2], v, tables[3]);
  constexpr int kOrAnd = 0xf8;  // a | (b & c)
  const __m512i signed_hb = _mm512_ternarylogic_epi32(hb, v, _mm512_set1_epi8(char(0x80)), kOrAnd);
  low = (__m512bh)_mm512_unpacklo_epi8(lb, signed_hb);
  high = (__m512bh)_mm512_unpackhi_epi8(lb, signed_hb);
}

template <bool Partial, int M>
KT_TARGET_AVX512_BF16_VBMI inline void step(const uint8_t* p, __mmask64 partial_mask, const __m512i (&tables)[4],
                                            const uint16_t* xs, int64_t x_row_stride, __m512 (&part)[M][2]) {
  __m512bh low, high;
  decode_step<Partial>(p, partial_mask, tables, low, high);
  KT_UNROLL for (int m = 0; m < M; ++m) {
    const uint16_t* xm = xs + m * x_row_stride;
    part[m][0] = _mm512_dpbf16_ps(part[m][0], low, (__m512bh)_mm512_loadu_si512(xm));
    part[m][1] = _mm512_dpbf16_ps(part[m][1], high, (__m512bh)_mm512_loadu_si512(xm + 32));
  }
}

template <int M, bool Bf16Scales>
KT_TARGET_AVX512_BF16_VBMI void fp8_bf16_rows(const uint16_t* xp, const WeightMatrix& w, float* out) {
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), blocks = w.scale.size(1);
  const int64_t steps = (K + kStep - 1) / kStep, full_steps = K / kStep;
  const __mmask64 partial_mask = K % kStep == 0 ? 0 : (__mmask64(1) << (K % kStep)) - 1;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  const Fp8ByteTables& t = fp8_byte_tables();
  const __m512i tables[4] = {_mm512_load_si512(t.high), _mm512_load_si512(t.high + 64), _mm512_load_si512(t.low),
                             _mm512_load_si512(t.low + 64)};
  const int64_t x_row_stride = steps * kStep;
  const int64_t ahead = prefetch_ahead_rows(ld, 1, kBytePrefetchAheadBytes);
  AlignedFloats block_scales(blocks);
  for (int64_t r = 0; r < R; ++r) {
    if (r % kFp8Block == 0) {
      for (int64_t b = 0; b < blocks; ++b) block_scales.data()[b] = load_scale<Bf16Scales>(scales, (r / kFp8Block) * blocks + b);
    }
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    __m512 total[M][2];
    KT_UNROLL for (int m = 0; m < M; ++m) total[m][0] = total[m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 part[M][2];
      KT_UNROLL for (int m = 0; m < M; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
      const int64_t s1 = std::min(steps, (b + 1) * (kFp8Block / kStep));
      for (int64_t s = b * (kFp8Block / kStep); s < s1; ++s) {
        if (row_ahead != nullptr) prefetch_into_l2(row_ahead + s * kStep);
        const uint16_t* xs = xp + s * kStep;
        if (s < full_steps) {
          step<false, M>(row + s * kStep, 0, tables, xs, x_row_stride, part);
        } else {
          step<true, M>(row + s * kStep, partial_mask, tables, xs, x_row_stride, part);
        }
      }
      const __m512 sv = _mm512_set1_ps(block_scales.data()[b]);
      KT_UNROLL for (int m = 0; m < M; ++m) {
        total[m][b & 1] = _mm512_fmadd_ps(_mm512_add_ps(part[m][0], part[m][1]), sv, total[m][b & 1]);
      }
    }
    KT_UNROLL for (int m = 0; m < M; ++m) out[m * R + r] = _mm512_reduce_add_ps(_mm512_add_ps(total[m][0], total[m][1]));
  }
}

}  // namespace

void gemv_fp8_bf16(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out) {
  TORCH_INTERNAL_ASSERT(w.format == WeightFormat::kFp8);
  const int64_t K = w.cols, padded = (K + kStep - 1) / kStep * kStep;
  AlignedArray<uint16_t> xp(M * padded);
  reorder_x(x, ldx, M, K, xp.data());
  const bool bf16_scales = w.scale.scalar_type() == at::kBFloat16;
  for_row_chunks(M, [&](int64_t m0, auto rows) {
    constexpr int Rows = decltype(rows)::value;
    const uint16_t* xm = xp.data() + m0 * padded;
    float* om = out + m0 * w.rows;
    bf16_scales ? fp8_bf16_rows<Rows, true>(xm, w, om) : fp8_bf16_rows<Rows, false>(xm, w, om);
  });
}

}  // namespace qgemv
}  // namespace kt
