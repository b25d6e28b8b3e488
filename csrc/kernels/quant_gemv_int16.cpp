// Decode GEMVs of bf16 activations on int4 and int8 weights through integer dot products: the
// avx2 path's kernels for them (quant_gemv.h). AVX2 has no bf16 dot product, and its float
// kernels (quant_gemv.cpp) spend most of their instructions turning each weight into a float
// (int4: widen, mask or shift, vcvtdq2ps, then an FMA per 8 weights). Here the weights stay
// integers and x becomes one:
//   x, per row and group of G columns, as 16-bit block floating point: x16 = x · 2^-e, with e
//   chosen so that the group's largest |x| lands in [2^14, 2^15). A bf16 value (8 significant
//   bits) within 2^7 of its group's largest is an integer there, exactly; a smaller one is
//   rounded to a multiple of 2^e, by at most 2^-15 of the group's largest |x| (bf16 itself
//   rounded that largest value by up to 2^-9 of it);
//   weights widened to 16 bits (int4: 16 bytes -> 16 words, low nibble, high nibble: 3
//   instructions per 32 weights; int8: vpmovsxbw, 1 per 16), multiplied with vpmaddwd
//   (16 products a vector, summed in pairs into 32-bit lanes) and summed in int32, exactly;
//   each group's sum converted to float once and scaled by its 2^e (and int4's group scale).
// Where x holds a NaN or an inf, or a group whose largest |x| is below 2^-101, the float
// kernels run instead (gemv_int16_avx2 returns false). float32 activations always take the
// float kernels: there the rounding of small values would be above float32's own.
//
// Tested against float64, against x rounded the same way in float64, and through quant_gemv_nt
// against the reference loop of quant_gemv.cpp (tests/test_quant_gemv_int16.py,
// tests/test_quant_decode_gemv.py).

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/quant_gemv_internal.h"
#include "platform/simd.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace qgemv {
namespace {

// Exponent groups of int8 rows (int4 rows use their own scale groups): 64 columns keep the
// per-group conversion and scaling (2 instructions) small against the group's 12, and each
// 32-bit lane's sum within 2^25.
constexpr int64_t kInt8XGroup = 64;

// x [M, cols] (float32 values that are bf16 values) as block floating point over groups of G
// columns. Int4 layout: each 32 columns stored as their 16 even columns, then their 16 odd ones
// (a byte's low nibble is the even column, its high nibble the odd one), and the group sums
// for int4's bias; int8's is the columns in order.
struct BlockFloatX {
  BlockFloatX(int64_t M, int64_t cols, int64_t G)
      : cols(cols), groups(cols / G), values(M * cols), neg_sums(M * groups * 8), pow2(M * groups) {}
  int64_t cols, groups;
  AlignedArray<int16_t> values;    // [M, cols]: x16
  AlignedArray<int32_t> neg_sums;  // [M, groups, 8]: minus the group's sum of x16 in every lane (int4 only)
  AlignedFloats pow2;              // [M, groups]: 2^e
};

KT_TARGET_AVX2 inline __m256i round_to_int(const float* p, __m256 scale) {
  return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p), scale));
}

// Fills bx from x (row stride ldx). False when a value is not finite or a group's largest |x|
// is too small for block_float_exponent.
template <int G, bool Int4Layout>
KT_TARGET_AVX2 bool block_float_x(const float* x, int64_t ldx, int64_t M, BlockFloatX& bx) {
  static_assert(G % 32 == 0, "groups are whole 32-column steps");
  const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  const __m256i evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < bx.groups; ++g) {
      const float* xg = x + m * ldx + g * G;
      __m256 largest = _mm256_setzero_ps(), not_finite = _mm256_setzero_ps();
      KT_UNROLL for (int c = 0; c < G; c += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xg + c), magnitude_mask);
        not_finite = _mm256_or_ps(not_finite, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // also true for NaN
        largest = _mm256_max_ps(largest, a);
      }
      if (_mm256_movemask_ps(not_finite) != 0) return false;
      __m128 l = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
      l = _mm_max_ps(l, _mm_movehl_ps(l, l));
      l = _mm_max_ss(l, _mm_shuffle_ps(l, l, 1));
      const float most = _mm_cvtss_f32(l);
      int e;
      if (!block_float_exponent(most, e)) return false;
      bx.pow2.data()[m * bx.groups + g] = std::ldexp(1.f, e);
      const __m256 scale = _mm256_set1_ps(std::ldexp(1.f, -e));
      int16_t* out = bx.values.data() + m * bx.cols + g * G;
      __m256i sum = _mm256_setzero_si256();
      KT_UNROLL for (int c = 0; c < G; c += 32) {
        __m256i v[4];
        KT_UNROLL for (int q = 0; q < 4; ++q) {
          v[q] = round_to_int(xg + c + 8 * q, scale);
          if constexpr (Int4Layout) sum = _mm256_add_epi32(sum, v[q]);
        }
        if constexpr (Int4Layout) {
          // Each 8 columns as their 4 evens, then their 4 odds; packing two such vectors gives
          // evens | odds in each 128-bit half; the halves of the two packs make the 16 evens
          // and the 16 odds.
          KT_UNROLL for (int q = 0; q < 4; ++q) v[q] = _mm256_permutevar8x32_epi32(v[q], evens_first);
          const __m256i a = _mm256_packs_epi32(v[0], v[1]), b = _mm256_packs_epi32(v[2], v[3]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + c), _mm256_permute2x128_si256(a, b, 0x20));
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + c + 16), _mm256_permute2x128_si256(a, b, 0x31));
        } else {
          // packs interleaves the 128-bit halves: columns 0-3, 8-11, 4-7, 12-15 back in order.
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + c),
                             _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xd8));
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + c + 16),
                             _mm256_permute4x64_epi64(_mm256_packs_epi32(v[2], v[3]), 0xd8));
        }
      }
      if constexpr (!Int4Layout) continue;
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(bx.neg_sums.data() + (m * bx.groups + g) * 8),
                         _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_broadcastd_epi32(s)));
    }
  }
  return true;
}

template <int M, int C>
KT_TARGET_AVX2 inline void store_rows(const __m256 (&total)[M][C], float row_scale, float* out, int64_t R, int64_t r) {
  KT_UNROLL for (int m = 0; m < M; ++m) {
    __m256 t = total[m][0];
    KT_UNROLL for (int j = 1; j < C; ++j) t = _mm256_add_ps(t, total[m][j]);
    out[m * R + r] = row_scale * simd::hsum8(t);
  }
}

// One int4 group (G columns, bytes at p) against M rows of x16 (xg: the group's first value of
// row 0, rows `cols` apart): the 32-bit sums start from -Σ x16 in every lane (the stored q + 8
// then counts as q), take the products of each 32 columns' 16 low and 16 high nibbles, and go
// into chain J of each row's total times sf (the group's scale · 2^e, rows `groups` apart).
template <int M, int G, int C, int J>
KT_TARGET_AVX2 inline void int4_group(const int16_t* xg, int64_t cols, const int32_t* neg, const uint8_t* p,
                                      const float* sf, int64_t groups, __m256 (&total)[M][C]) {
  __m256i acc[M];
  KT_UNROLL for (int m = 0; m < M; ++m) acc[m] = _mm256_load_si256(reinterpret_cast<const __m256i*>(neg + m * groups * 8));
  KT_UNROLL for (int c = 0; c < G; c += 32) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c / 2)));
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi16(0x0f)), hi = _mm256_srli_epi16(b, 4);
    KT_UNROLL for (int m = 0; m < M; ++m) {
      const __m256i* xv = reinterpret_cast<const __m256i*>(xg + m * cols + c);
      acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_load_si256(xv)),
                                                         _mm256_madd_epi16(hi, _mm256_load_si256(xv + 1))));
    }
  }
  KT_UNROLL for (int m = 0; m < M; ++m)
    total[m][J] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_broadcast_ss(sf + m * groups), total[m][J]);
}

// Groups g.. g + C - 1 of a row, group g + J into chain J.
template <int M, int G, int C, int... J>
KT_TARGET_AVX2 inline void int4_groups(const BlockFloatX& bx, const uint8_t* row, const float* sf, int64_t g,
                                       __m256 (&total)[M][C], std::integer_sequence<int, J...>) {
  (int4_group<M, G, C, J>(bx.values.data() + (g + J) * G, bx.cols, bx.neg_sums.data() + (g + J) * 8,
                          row + (g + J) * (G / 2), sf + g + J, bx.groups, total),
   ...);
}

template <int M, int G, bool Bf16>
KT_TARGET_AVX2 void int4_rows(const BlockFloatX& bx, const WeightMatrix& w, float* out) {
  constexpr int C = kTotalChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G;
  TORCH_INTERNAL_ASSERT(bx.groups == groups);
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  AlignedFloats scale_buffer(groups), sf(M * groups);
  const float* pow2 = bx.pow2.data();
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    // Each group's scale times each x row's 2^e for the group: one broadcast per group below.
    const float* s = row_scales<Bf16>(scales, r * groups, groups, scale_buffer.data());
    for (int m = 0; m < M; ++m) {
      float* sfm = sf.data() + m * groups;
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8) {
        _mm256_storeu_ps(sfm + g, _mm256_mul_ps(_mm256_loadu_ps(s + g), _mm256_loadu_ps(pow2 + m * groups + g)));
      }
      for (; g < groups; ++g) sfm[g] = s[g] * pow2[m * groups + g];
    }
    __m256 total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + C <= groups; g += C) {
      if (row_ahead != nullptr) prefetch_lines(row_ahead, g * (G / 2), (g + C) * (G / 2));
      int4_groups<M, G, C>(bx, row, sf.data(), g, total, std::make_integer_sequence<int, C>{});
    }
    for (; g < groups; ++g) int4_groups<M, G, C>(bx, row, sf.data(), g, total, std::integer_sequence<int, 0>{});
    store_rows<M, C>(total, 1.f, out, R, r);
  }
}

// One int8 group (kInt8XGroup columns at p) against M rows of x16, into chain J: the 32-bit sums
// of vpmaddwd on the sign-extended bytes, converted and times the group's 2^e.
template <int M, int C, int J>
KT_TARGET_AVX2 inline void int8_group(const BlockFloatX& bx, const uint8_t* p, int64_t g, __m256 (&total)[M][C]) {
  constexpr int G = kInt8XGroup;
  __m256i acc[M];
  KT_UNROLL for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
  KT_UNROLL for (int c = 0; c < G; c += 16) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c)));
    KT_UNROLL for (int m = 0; m < M; ++m) {
      const int16_t* xv = bx.values.data() + m * bx.cols + g * G + c;
      acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(xv))));
    }
  }
  KT_UNROLL for (int m = 0; m < M; ++m) {
    total[m][J] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_broadcast_ss(bx.pow2.data() + m * bx.groups + g),
                                  total[m][J]);
  }
}

template <int M, int C, int... J>
KT_TARGET_AVX2 inline void int8_groups(const BlockFloatX& bx, const uint8_t* row, int64_t g, __m256 (&total)[M][C],
                                       std::integer_sequence<int, J...>) {
  (int8_group<M, C, J>(bx, row + (g + J) * kInt8XGroup, g + J, total), ...);
}

// int8 rows over the first bx.cols columns (whole kInt8XGroup groups); the row's scale once.
template <int M, bool Bf16>
KT_TARGET_AVX2 void int8_rows(const BlockFloatX& bx, const WeightMatrix& w, float* out) {
  constexpr int C = kTotalChains<M>;
  const int64_t R = w.rows, ld = w.data.stride(0), groups = bx.groups;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  const int64_t ahead = prefetch_ahead_rows(ld, 1, kBytePrefetchAheadBytes);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    __m256 total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + C <= groups; g += C) {
      if (row_ahead != nullptr) {
        KT_UNROLL for (int j = 0; j < C; ++j) prefetch_into_l2(row_ahead + (g + j) * kInt8XGroup);
      }
      int8_groups<M, C>(bx, row, g, total, std::make_integer_sequence<int, C>{});
    }
    for (; g < groups; ++g) int8_groups<M, C>(bx, row, g, total, std::integer_sequence<int, 0>{});
    store_rows<M, C>(total, load_scale<Bf16>(scales, r), out, R, r);
  }
}

template <int M>
void int4_dispatch(const BlockFloatX& bx, const WeightMatrix& w, float* out) {
  const bool bf16 = bf16_scales(w);
  switch (w.group) {
    case 32: return bf16 ? int4_rows<M, 32, true>(bx, w, out) : int4_rows<M, 32, false>(bx, w, out);
    case 64: return bf16 ? int4_rows<M, 64, true>(bx, w, out) : int4_rows<M, 64, false>(bx, w, out);
    default: return bf16 ? int4_rows<M, 128, true>(bx, w, out) : int4_rows<M, 128, false>(bx, w, out);
  }
}

template <int M>
void int8_dispatch(const BlockFloatX& bx, const WeightMatrix& w, float* out) {
  return bf16_scales(w) ? int8_rows<M, true>(bx, w, out) : int8_rows<M, false>(bx, w, out);
}

}  // namespace

bool gemv_int16_avx2(const float* x, int64_t M, const WeightMatrix& w, float* out) {
  TORCH_INTERNAL_ASSERT(w.format == WeightFormat::kInt4 || w.format == WeightFormat::kInt8);
  const int64_t K = w.cols, R = w.rows;
  const bool int4 = w.format == WeightFormat::kInt4;
  const int64_t G = int4 ? w.group : kInt8XGroup, cols = K / G * G;
  // Every chunk's x is checked before any output is written, so that a refusal leaves out
  // untouched for the float kernels.
  std::vector<std::unique_ptr<BlockFloatX>> chunks;
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t rows = std::min<int64_t>(4, M - m0);
    auto bx = std::make_unique<BlockFloatX>(rows, cols, G);
    const float* xm = x + m0 * K;
    bool ok;
    switch (G) {
      case 32: ok = block_float_x<32, true>(xm, K, rows, *bx); break;
      case 64: ok = int4 ? block_float_x<64, true>(xm, K, rows, *bx) : block_float_x<64, false>(xm, K, rows, *bx); break;
      default: ok = block_float_x<128, true>(xm, K, rows, *bx); break;
    }
    if (!ok) return false;
    chunks.push_back(std::move(bx));
  }
  for_row_chunks(M, [&](int64_t m0, auto rows) {
    constexpr int Rows = decltype(rows)::value;
    const BlockFloatX& bx = *chunks[m0 / 4];
    float* om = out + m0 * R;
    if (int4) {
      int4_dispatch<Rows>(bx, w, om);
    } else {
      int8_dispatch<Rows>(bx, w, om);
    }
  });
  if (!int4) int8_tail_columns(x, M, w, cols, out);
  return true;
}

}  // namespace qgemv
}  // namespace kt
