// Decode GEMV of bf16 activations on int4 weights through AVX512-VNNI integer dot products
// (quant_gemv.h), on the avx512_bf16 path. The bf16 kernel (quant_gemv_avx512.cpp) multiplies
// with vdpbf16ps, of which one thread of an Intel Xeon with AMX ran 1.6-1.8 G a second against
// 5.0 G vpdpwssd (benchmarks/RESULTS.md); so, as the avx2 path's integer kernel
// (quant_gemv_int16.cpp) does:
//   x, per row and group of 32 columns, as 16-bit block floating point: x16 = x · 2^-e with the
//   group's largest |x| in [2^14, 2^15) (a bf16 value within 2^7 of it is an integer there,
//   exactly; a smaller one is rounded to a multiple of 2^e, by at most 2^-15 of the group's
//   largest |x|), reordered once per call into each 128 columns' four classes mod 4;
//   each 64 bytes (128 columns) one load, the k-th nibble of each 16-bit word masked out
//   (q + 8, 0..15) and multiplied with x16's class k by vpdpwssd: sum lane i holds columns
//   8i .. 8i+7 in int32, exactly, starting from -8 Σ x16 over them (the stored +8 taken out);
//   each lane's sum converted once and scaled by its group scale · 2^e.
// Only rows of whole 128-column steps; x holding a NaN or an inf, or a 32-column group whose
// largest |x| is below 2^-101, is refused (gemv_int4_vnni returns false) and the bf16 kernel
// runs instead.
//
// Tested against float64 on every byte value, against x rounded the same way in float64 and
// within the rounding bound, for its refusals, and that quant_gemv_nt takes it
// (tests/test_quant_gemv_int4_vnni.py).
#include <cmath>
#include <memory>
#include <vector>

#include "kernels/quant_gemv_internal.h"

namespace kt {
namespace qgemv {
namespace {

constexpr int64_t kStep = 128;   // columns per step: one 64-byte load of nibbles
constexpr int64_t kXGroup = 32;  // columns per exponent of x (4 sum lanes)

// x rows as the kernel reads them, per row and step: the 128 x16 values as four classes of 32
// (columns 4j + k for k = 0..3), -8 times each sum lane's Σ x16, and each lane's 2^e.
struct VnniX {
  VnniX(int64_t M, int64_t steps) : steps(steps), values(M * steps * kStep), neg_bias(M * steps * 16), pow2(M * steps * 16) {}
  int64_t steps;
  AlignedArray<int16_t> values;   // [M, steps, 128]
  AlignedArray<int32_t> neg_bias; // [M, steps, 16]
  AlignedFloats pow2;             // [M, steps, 16]
};

// Fills vx from M rows of bf16 x (rows ldx apart). False for a NaN or an inf, or a group whose
// largest |x| is too small for block_float_exponent.
KT_TARGET_AVX512_VNNI bool block_float_x(const uint16_t* x, int64_t ldx, int64_t M, VnniX& vx) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 inf = _mm512_set1_ps(INFINITY);
  const __m512i ones = _mm512_set1_epi16(1);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < vx.steps; ++b) {
      const uint16_t* src = x + m * ldx + b * kStep;
      const int64_t at = m * vx.steps + b;
      __m512i words[4];  // the step's x16 in column order, 32 a vector
      for (int g = 0; g < 4; ++g) {
        const __m512 lo = simd::load16_bf16(src + g * kXGroup), hi = simd::load16_bf16(src + g * kXGroup + 16);
        const __m512 alo = _mm512_and_ps(lo, magnitude), ahi = _mm512_and_ps(hi, magnitude);
        // not below inf: inf or NaN (unordered); checked before max, which drops a NaN operand
        if ((_mm512_cmp_ps_mask(alo, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(ahi, inf, _CMP_NLT_UQ)) != 0) return false;
        const __m512 a = _mm512_max_ps(alo, ahi);
        const float most = _mm512_reduce_max_ps(a);
        int e;
        if (!block_float_exponent(most, e)) return false;
        const __m512 scale = _mm512_set1_ps(std::ldexp(1.f, -e));
        const __m256i l16 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, scale)));
        const __m256i h16 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, scale)));
        words[g] = _mm512_inserti64x4(_mm512_castsi256_si512(l16), h16, 1);
        _mm_storeu_ps(vx.pow2.data() + at * 16 + 4 * g, _mm_set1_ps(std::ldexp(1.f, e)));
      }
      __m512i cls[4];
      columns_mod4(words, cls);
      __m512i sum = _mm512_setzero_si512();
      int16_t* dst = vx.values.data() + at * kStep;
      for (int k = 0; k < 4; ++k) {
        _mm512_store_si512(dst + 32 * k, cls[k]);
        sum = _mm512_dpwssd_epi32(sum, cls[k], ones);
      }
      _mm512_store_si512(vx.neg_bias.data() + at * 16, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 3)));
    }
  }
  return true;
}

// Step b of a row into chain i of every x row's total.
template <int M, int C, int G>
KT_TARGET_AVX512_VNNI inline void step(const VnniX& vx, const uint8_t* row, const uint8_t* row_ahead, int64_t b,
                                       const float* s, int i, __m512 (&total)[M][C]) {
  const int64_t c = b * kStep;
  if (row_ahead != nullptr) prefetch_into_l2(row_ahead + c / 2);
  const __m512i v = _mm512_loadu_si512(row + c / 2);
  const __m512i nibble = _mm512_set1_epi16(0x000f);
  const __m512i w0 = _mm512_and_si512(v, nibble), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble),
                w2 = _mm512_and_si512(_mm512_srli_epi16(v, 8), nibble), w3 = _mm512_srli_epi16(v, 12);
  const __m512 sv = step_lane_scales<G>(s, c);
  KT_UNROLL for (int m = 0; m < M; ++m) {
    const int64_t at = m * vx.steps + b;
    const int16_t* xs = vx.values.data() + at * kStep;
    // two chains of two: each 32-bit lane's sum stays exact (|Σ| < 2^23)
    __m512i acc = _mm512_dpwssd_epi32(_mm512_load_si512(vx.neg_bias.data() + at * 16), w0, _mm512_load_si512(xs));
    __m512i acc2 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w1, _mm512_load_si512(xs + 32));
    acc = _mm512_dpwssd_epi32(acc, w2, _mm512_load_si512(xs + 64));
    acc2 = _mm512_dpwssd_epi32(acc2, w3, _mm512_load_si512(xs + 96));
    const __m512 lane_factor = _mm512_mul_ps(sv, _mm512_load_ps(vx.pow2.data() + at * 16));
    total[m][i] = _mm512_fmadd_ps(lane_factor, _mm512_cvtepi32_ps(_mm512_add_epi32(acc, acc2)), total[m][i]);
  }
}

template <int M, int G, bool Bf16Scales>
KT_TARGET_AVX512_VNNI void int4_vnni_rows(const VnniX& vx, const WeightMatrix& w, float* scale_buffer, float* out) {
  constexpr int C = kTotalChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G, steps = vx.steps;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  // 4 KB ahead into L2, as the byte GEMVs (kBytePrefetchAheadBytes says why).
  const int64_t ahead = prefetch_ahead_rows(ld, 1, kBytePrefetchAheadBytes);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const float* s = row_scales<Bf16Scales>(scales, r * groups, groups, scale_buffer);
    __m512 total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + C <= steps; b += C) {
      KT_UNROLL for (int i = 0; i < C; ++i) step<M, C, G>(vx, row, row_ahead, b + i, s, i, total);
    }
    for (; b < steps; ++b) step<M, C, G>(vx, row, row_ahead, b, s, 0, total);
    KT_UNROLL for (int m = 0; m < M; ++m) {
      __m512 sum = total[m][0];
      KT_UNROLL for (int j = 1; j < C; ++j) sum = _mm512_add_ps(sum, total[m][j]);
      out[m * R + r] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <int M>
void int4_vnni_dispatch(const VnniX& vx, const WeightMatrix& w, float* out) {
  AlignedFloats scale_buffer(w.cols / w.group);
  float* sb = scale_buffer.data();
  const bool bf16 = w.scale.scalar_type() == at::kBFloat16;
  switch (w.group) {
    case 32: return bf16 ? int4_vnni_rows<M, 32, true>(vx, w, sb, out) : int4_vnni_rows<M, 32, false>(vx, w, sb, out);
    case 64: return bf16 ? int4_vnni_rows<M, 64, true>(vx, w, sb, out) : int4_vnni_rows<M, 64, false>(vx, w, sb, out);
    default: return bf16 ? int4_vnni_rows<M, 128, true>(vx, w, sb, out) : int4_vnni_rows<M, 128, false>(vx, w, sb, out);
  }
}

}  // namespace

bool gemv_int4_vnni(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out) {
  TORCH_INTERNAL_ASSERT(w.format == WeightFormat::kInt4 && w.cols % kStep == 0);
  const int64_t steps = w.cols / kStep;
  // Every chunk's x is checked before any output is written, so that a refusal leaves out
  // untouched for the bf16 kernel.
  std::vector<std::unique_ptr<VnniX>> chunks;
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t rows = std::min<int64_t>(4, M - m0);
    auto vx = std::make_unique<VnniX>(rows, steps);
    if (!block_float_x(x + m0 * ldx, ldx, rows, *vx)) return false;
    chunks.push_back(std::move(vx));
  }
  for_row_chunks(M, [&](int64_t m0, auto rows) {
    int4_vnni_dispatch<decltype(rows)::value>(*chunks[m0 / 4], w, out + m0 * w.rows);
  });
  return true;
}

}  // namespace qgemv
}  // namespace kt
