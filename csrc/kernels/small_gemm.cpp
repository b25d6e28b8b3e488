// Kernels of small_gemm (see small_gemm.h): the reference loop, then one kernel per
// instruction set. Each SIMD kernel computes tiles of MR rows × NR columns in registers,
// walking the inner dimension once per tile, row tiles outermost (so that a tile's rows are
// written left to right; column-tile-outer order touched MR rows 4 KiB apart per tile and
// thrashed L1 sets); columns past the last full tile go through the reference loop.
#include "kernels/small_gemm.h"

#include <vector>

#include "platform/simd.h"

namespace kt {
namespace {

using simd::bf16_to_float;
using simd::float_to_bf16;

// Raw view of the operands; a is packed to float32 [M, Kd] by the caller.
struct GemmView {
  int64_t M, N, Kd;
  const float* a;  // [M, Kd] contiguous
  const void* b;
  bool b_bf16;
  int64_t ldb;
  const void* c;  // nullptr: no addend
  bool c_bf16;
  int64_t ldc;
  void* out;
  bool out_bf16;
  int64_t ldo;
  float alpha;
};

inline float load_scalar(const void* p, bool bf16, int64_t i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store_scalar(void* p, bool bf16, int64_t i, float v) {
  if (bf16) {
    static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// Reference: the plain loop, for columns [n0, N).
void gemm_reference(const GemmView& g, int64_t n0) {
  for (int64_t m = 0; m < g.M; ++m) {
    for (int64_t n = n0; n < g.N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < g.Kd; ++k) acc += g.a[m * g.Kd + k] * load_scalar(g.b, g.b_bf16, k * g.ldb + n);
      float v = g.alpha * acc;
      if (g.c) v += load_scalar(g.c, g.c_bf16, m * g.ldc + n);
      store_scalar(g.out, g.out_bf16, m * g.ldo + n, v);
    }
  }
}

// Runs Tile<MR>::run(args..., m0, n0) over the tiles of the first n_full columns: row tiles of
// kMaxRows rows, then one tile of the remaining rows (MR picked at compile time, so that every
// tile keeps its accumulators in registers).
template <int MR, template <int> class Tile, typename... Args>
void remainder_tile(int64_t rows, int64_t m0, int64_t n0, const Args&... args) {
  if constexpr (MR > 0) {
    if (rows == MR) return Tile<MR>::run(args..., m0, n0);
    remainder_tile<MR - 1, Tile>(rows, m0, n0, args...);
  }
}

template <int kMaxRows, int NR, template <int> class Tile, typename... Args>
void for_each_tile(int64_t M, int64_t n_full, const Args&... args) {
  int64_t m0 = 0;
  for (; m0 + kMaxRows <= M; m0 += kMaxRows) {
    for (int64_t n0 = 0; n0 < n_full; n0 += NR) Tile<kMaxRows>::run(args..., m0, n0);
  }
  if (m0 == M) return;
  for (int64_t n0 = 0; n0 < n_full; n0 += NR) remainder_tile<kMaxRows - 1, Tile>(M - m0, m0, n0, args...);
}

// ---- AVX2: tiles of 4 rows × 16 columns (8 accumulators) ------------------------------------

KT_TARGET_AVX2 inline __m256 load8(const void* p, bool bf16, int64_t i) {
  return bf16 ? simd::load8_bf16(static_cast<const uint16_t*>(p) + i) : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

KT_TARGET_AVX2 inline void store8(void* p, bool bf16, int64_t i, __m256 v) {
  if (bf16) {
    simd::store8_bf16(static_cast<uint16_t*>(p) + i, v);
  } else {
    _mm256_storeu_ps(static_cast<float*>(p) + i, v);
  }
}

template <bool kBf16B>
struct TileAvx2 {
template <int MR>
struct Rows {
KT_TARGET_AVX2 static void run(const GemmView& g, int64_t m0, int64_t n0) {
  __m256 acc[MR][2];
  KT_UNROLL for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < g.Kd; ++k) {
    const __m256 b0 = load8(g.b, kBf16B, k * g.ldb + n0);
    const __m256 b1 = load8(g.b, kBf16B, k * g.ldb + n0 + 8);
    KT_UNROLL for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(g.a + (m0 + i) * g.Kd + k);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  const __m256 alpha = _mm256_set1_ps(g.alpha);
  KT_UNROLL for (int i = 0; i < MR; ++i) {
    KT_UNROLL for (int j = 0; j < 2; ++j) {
      __m256 v = _mm256_mul_ps(alpha, acc[i][j]);
      if (g.c) v = _mm256_add_ps(v, load8(g.c, g.c_bf16, (m0 + i) * g.ldc + n0 + 8 * j));
      store8(g.out, g.out_bf16, (m0 + i) * g.ldo + n0 + 8 * j, v);
    }
  }
}
};
};

template <bool kBf16B>
void gemm_avx2_b(const GemmView& g) {
  constexpr int NR = 16;
  const int64_t n_full = g.N / NR * NR;
  for_each_tile<4, NR, TileAvx2<kBf16B>::template Rows>(g.M, n_full, g);
  gemm_reference(g, n_full);
}

void gemm_avx2(const GemmView& g) { g.b_bf16 ? gemm_avx2_b<true>(g) : gemm_avx2_b<false>(g); }

// ---- AVX-512: tiles of 8 rows × 32 columns (16 accumulators), float32 FMAs ------------------

KT_TARGET_AVX512 inline __m512 load16(const void* p, bool bf16, int64_t i) {
  return bf16 ? simd::load16_bf16(static_cast<const uint16_t*>(p) + i) : _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

KT_TARGET_AVX512 inline void store16(void* p, bool bf16, int64_t i, __m512 v) {
  if (bf16) {
    simd::store16_bf16(static_cast<uint16_t*>(p) + i, v);
  } else {
    _mm512_storeu_ps(static_cast<float*>(p) + i, v);
  }
}

template <int MR>
KT_TARGET_AVX512 void epilogue_avx512(const GemmView& g, int64_t m0, int64_t n0, __m512 (&acc)[MR][2]) {
  const __m512 alpha = _mm512_set1_ps(g.alpha);
  KT_UNROLL for (int i = 0; i < MR; ++i) {
    KT_UNROLL for (int j = 0; j < 2; ++j) {
      __m512 v = _mm512_mul_ps(alpha, acc[i][j]);
      if (g.c) v = _mm512_add_ps(v, load16(g.c, g.c_bf16, (m0 + i) * g.ldc + n0 + 16 * j));
      store16(g.out, g.out_bf16, (m0 + i) * g.ldo + n0 + 16 * j, v);
    }
  }
}

template <bool kBf16B>
struct TileAvx512 {
template <int MR>
struct Rows {
KT_TARGET_AVX512 static void run(const GemmView& g, int64_t m0, int64_t n0) {
  __m512 acc[MR][2];
  KT_UNROLL for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < g.Kd; ++k) {
    const __m512 b0 = load16(g.b, kBf16B, k * g.ldb + n0);
    const __m512 b1 = load16(g.b, kBf16B, k * g.ldb + n0 + 16);
    KT_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(g.a[(m0 + i) * g.Kd + k]);
      acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  epilogue_avx512<MR>(g, m0, n0, acc);
}
};
};

template <bool kBf16B>
void gemm_avx512_b(const GemmView& g) {
  constexpr int NR = 32;
  const int64_t n_full = g.N / NR * NR;
  for_each_tile<8, NR, TileAvx512<kBf16B>::template Rows>(g.M, n_full, g);
  gemm_reference(g, n_full);
}

void gemm_avx512(const GemmView& g) { g.b_bf16 ? gemm_avx512_b<true>(g) : gemm_avx512_b<false>(g); }

// ---- AVX512-BF16: vdpbf16ps on pairs of the inner dimension ---------------------------------
// Used when a and b are both bfloat16 (a is then exactly representable, so pairing it back to
// bf16 loses nothing). Both operands are packed once per call into the pair layout vdpbf16ps
// reads: a_pairs[m][kp] = (a[m, 2kp], a[m, 2kp+1]) and b_pairs[kp][n] = (b[2kp, n],
// b[2kp+1, n]), two bf16 in one 32-bit lane (an odd last k pairs with zero). Packing b costs
// one pass over it; every row tile then reads it with plain loads.

KT_TARGET_AVX512_BF16 void pack_b_pairs(const GemmView& g, int64_t kp_count, int64_t n_full, uint32_t* b_pairs) {
  const uint16_t* b = static_cast<const uint16_t*>(g.b);
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    const uint16_t* r0 = b + 2 * kp * g.ldb;
    const uint16_t* r1 = r0 + g.ldb;
    const bool has_r1 = 2 * kp + 1 < g.Kd;
    uint32_t* dst = b_pairs + kp * n_full;
    for (int64_t n = 0; n < n_full; n += 16) {
      __m512i pair = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + n)));
      if (has_r1) {
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + n)));
        pair = _mm512_or_si512(pair, _mm512_slli_epi32(hi, 16));
      }
      _mm512_storeu_si512(dst + n, pair);
    }
  }
}

template <int MR>
struct TileAvx512Bf16 {
KT_TARGET_AVX512_BF16 static void run(const GemmView& g, const uint32_t* a_pairs, const uint32_t* b_pairs,
                                      int64_t kp_count, int64_t n_full, int64_t m0, int64_t n0) {
  __m512 acc[MR][2];
  KT_UNROLL for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const uint32_t* a_rows = a_pairs + m0 * kp_count;
  const uint32_t* b_col = b_pairs + n0;
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b_col + kp * n_full);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b_col + kp * n_full + 16);
    KT_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(a_rows[i * kp_count + kp]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
  const __m512 alpha = _mm512_set1_ps(g.alpha);
  KT_UNROLL for (int i = 0; i < MR; ++i) {
    KT_UNROLL for (int j = 0; j < 2; ++j) {
      __m512 v = _mm512_mul_ps(alpha, acc[i][j]);
      if (g.c) v = _mm512_add_ps(v, load16(g.c, g.c_bf16, (m0 + i) * g.ldc + n0 + 16 * j));
      const int64_t o = (m0 + i) * g.ldo + n0 + 16 * j;
      if (g.out_bf16) {
        simd::store16_bf16_native(static_cast<uint16_t*>(g.out) + o, v);
      } else {
        _mm512_storeu_ps(static_cast<float*>(g.out) + o, v);
      }
    }
  }
}
};

KT_TARGET_AVX512_BF16 void gemm_avx512_bf16(const GemmView& g) {
  constexpr int NR = 32;
  const int64_t kp_count = (g.Kd + 1) / 2;
  const int64_t n_full = g.N / NR * NR;
  std::vector<uint32_t> a_pairs(g.M * kp_count);
  for (int64_t m = 0; m < g.M; ++m) {
    for (int64_t kp = 0; kp < kp_count; ++kp) {
      const uint32_t lo = float_to_bf16(g.a[m * g.Kd + 2 * kp]);
      const uint32_t hi = 2 * kp + 1 < g.Kd ? float_to_bf16(g.a[m * g.Kd + 2 * kp + 1]) : 0;
      a_pairs[m * kp_count + kp] = lo | (hi << 16);
    }
  }
  std::vector<uint32_t> b_pairs(kp_count * n_full);
  pack_b_pairs(g, kp_count, n_full, b_pairs.data());
  for_each_tile<8, NR, TileAvx512Bf16>(g.M, n_full, g, a_pairs.data(), b_pairs.data(), kp_count, n_full);
  gemm_reference(g, n_full);
}

bool is_f32_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

void small_gemm(at::Tensor& out, const std::optional<at::Tensor>& c, const at::Tensor& a, const at::Tensor& b,
                double alpha, CpuIsa isa) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(0) &&
                  out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "small_gemm: shapes do not match");
  const bool fast = is_f32_or_bf16(out) && is_f32_or_bf16(a) && is_f32_or_bf16(b) &&
                    (!c || is_f32_or_bf16(*c)) && b.stride(1) == 1 && out.stride(1) == 1 &&
                    (!c || c->stride(1) == 1);
  if (!fast) {  // float64 and anything else: ATen
    at::Tensor prod = at::mm(a.to(out.scalar_type()), b.to(out.scalar_type()));
    if (c) prod = prod.mul_(alpha).add_(*c);
    else prod = prod.mul_(alpha);
    out.copy_(prod);
    return;
  }
  const int64_t M = a.size(0), Kd = a.size(1), N = b.size(1);
  if (M == 0 || N == 0) return;
  const at::Tensor a32 = a.to(at::kFloat).contiguous();
  GemmView g{M,
             N,
             Kd,
             a32.const_data_ptr<float>(),
             b.const_data_ptr(),
             b.scalar_type() == at::kBFloat16,
             b.stride(0),
             c ? c->const_data_ptr() : nullptr,
             c && c->scalar_type() == at::kBFloat16,
             c ? c->stride(0) : 0,
             out.mutable_data_ptr(),
             out.scalar_type() == at::kBFloat16,
             out.stride(0),
             static_cast<float>(alpha)};
  const bool both_bf16 = a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16;
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
      if (both_bf16) return gemm_avx512_bf16(g);
      return gemm_avx512(g);
    case CpuIsa::kAvx512: return gemm_avx512(g);
    case CpuIsa::kAvx2: return gemm_avx2(g);
    case CpuIsa::kPortable: return gemm_reference(g, 0);
  }
}

void small_gemm(at::Tensor& out, const std::optional<at::Tensor>& c, const at::Tensor& a, const at::Tensor& b,
                double alpha) {
  small_gemm(out, c, a, b, alpha, active_cpu_isa());
}

}  // namespace kt
