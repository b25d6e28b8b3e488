// The int4 decode GEMV of quant_gemv_nt on float32 x, written once for both vector widths: V
// is simd::F32x8 (AVX2) or simd::F32x16 (AVX-512), and the includer defines KT_VEC_TARGET as
// that path's target attribute. GCC inlines an intrinsic only into a function compiled for its
// instruction set, so one template cannot serve both paths; this file is therefore included
// once per path (quant_gemv.cpp, quant_gemv_avx512.cpp), each inside its own namespace, as
// Highway's per-target headers are. No #pragma once for that reason.
//
// Per group of G columns: lanes bytes (2 · lanes columns, decode_int4: the low nibbles are the
// even columns, the high ones the odd; x permuted alike by int4_permuted_x) zero-extended and
// converted, q + 8 in 0..15; the 8 comes back out through the group's sum of x: two chains per
// x row, the first starting from -8 · (the group's sum of x) spread over the lanes, add up to
// sum(x · (q + 8)) - 8 · sum(x) = sum(x · q); times the group's scale. The reference loop is
// quant_gemv.cpp's gemv_reference.
#ifndef KT_VEC_TARGET
#error "define KT_VEC_TARGET (the target attribute of the including path) before including quant_gemv_int4-inl.h"
#endif

// One group of G columns (its bytes at p, its scale at s) into chain J of each x row's total.
template <class V, int M, int C, int G, int J>
KT_VEC_TARGET inline void int4_group(const float* x, int64_t K, const uint8_t* p, const float* s,
                                     const float* neg_sums, int64_t groups, typename V::Reg (&total)[M][C]) {
  using Reg = typename V::Reg;
  constexpr int L = V::kLanes;
  Reg part[M][2];
  KT_UNROLL for (int m = 0; m < M; ++m) {
    part[m][0] = V::load(neg_sums + m * groups * L);
    part[m][1] = V::zero();
  }
  KT_UNROLL for (int c = 0; c < G; c += 2 * L) {
    Reg lo, hi;
    decode_int4(p + c / 2, lo, hi);
    KT_UNROLL for (int m = 0; m < M; ++m) {
      part[m][0] = V::fmadd(V::load(x + m * K + c), lo, part[m][0]);
      part[m][1] = V::fmadd(V::load(x + m * K + c + L), hi, part[m][1]);
    }
  }
  const Reg sv = V::set1(*s);
  KT_UNROLL for (int m = 0; m < M; ++m) total[m][J] = V::fmadd(sv, V::add(part[m][0], part[m][1]), total[m][J]);
}

// Groups of G columns, scales of dtype bf16 (Bf16) or float32: both compile-time, so that a
// group is straight-line code. Group gi goes to chain gi % C, unrolled by C so that the totals
// stay in registers. x permuted and the negated group sums (L per group) from int4_permuted_x.
template <class V, int M, int G, bool Bf16>
KT_VEC_TARGET void gemv_int4_groups(const float* x, const float* neg_sums, const WeightMatrix& w, float* scale_buffer,
                                    float* out) {
  using Reg = typename V::Reg;
  constexpr int L = V::kLanes;
  constexpr int C = qgemv::kTotalChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const float* s = qgemv::row_scales<Bf16>(scales, r * groups, groups, scale_buffer);
    Reg total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = V::zero();
    int64_t gi = 0;
    for (; gi + C <= groups; gi += C) {
      if (row_ahead != nullptr) prefetch_lines(row_ahead, gi * (G / 2), (gi + C) * (G / 2));
      const float* xg = x + gi * G;
      const float* ng = neg_sums + gi * L;
      const uint8_t* pg = row + gi * (G / 2);
      int4_group<V, M, C, G, 0>(xg, K, pg, s + gi, ng, groups, total);
      if constexpr (C > 1) int4_group<V, M, C, G, (C > 1)>(xg + G, K, pg + G / 2, s + gi + 1, ng + L, groups, total);
      if constexpr (C > 2) {
        int4_group<V, M, C, G, 2 * (C > 2)>(xg + 2 * G, K, pg + G, s + gi + 2, ng + 2 * L, groups, total);
        int4_group<V, M, C, G, 3 * (C > 2)>(xg + 3 * G, K, pg + 3 * G / 2, s + gi + 3, ng + 3 * L, groups, total);
      }
    }
    for (; gi < groups; ++gi) {
      int4_group<V, M, C, G, 0>(x + gi * G, K, row + gi * (G / 2), s + gi, neg_sums + gi * L, groups, total);
    }
    KT_UNROLL for (int m = 0; m < M; ++m) {
      Reg sum = total[m][0];
      KT_UNROLL for (int j = 1; j < C; ++j) sum = V::add(sum, total[m][j]);
      out[m * R + r] = V::reduce_add(sum);
    }
  }
}
