// Kernels of thin_gemm_nt (see thin_gemm.h): the reference loop, then one kernel per
// instruction set. The SIMD kernels keep MR rows of x × RJ rows of w as MR·RJ vector
// accumulators, walk K once with masked loads for the tail, and reduce each accumulator to
// one output at the end.
#include "kernels/thin_gemm.h"

#include "platform/simd.h"

namespace kt {
namespace {

struct ThinView {
  int64_t M, R, K;
  const void* x;
  int64_t ldx;
  const void* w;
  int64_t ldw;
  bool in_bf16;  // x and w have the same dtype in the SIMD kernels
  void* out;
  int64_t ldo;
  bool out_bf16;
};

inline float load_scalar(const void* p, bool bf16, int64_t i) {
  return bf16 ? simd::bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store_out(const ThinView& v, int64_t m, int64_t r, float value) {
  if (v.out_bf16) {
    static_cast<uint16_t*>(v.out)[m * v.ldo + r] = simd::float_to_bf16(value);
  } else {
    static_cast<float*>(v.out)[m * v.ldo + r] = value;
  }
}

void thin_reference(const ThinView& v) {
  for (int64_t m = 0; m < v.M; ++m) {
    for (int64_t r = 0; r < v.R; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < v.K; ++k) {
        acc += load_scalar(v.x, v.in_bf16, m * v.ldx + k) * load_scalar(v.w, v.in_bf16, r * v.ldw + k);
      }
      store_out(v, m, r, acc);
    }
  }
}

// Runs tile<MR, RJ>(v, m0, r0) over all (row, rank) tiles: MR rows (MR or 1 for the tail)
// and RJ ranks (up to 8; the rank tail picks RJ at run time). Rows of w outermost: each
// group of 8 w rows is read from memory once and stays in L1/L2 while every x row passes
// over it, which is what makes the kernel a bandwidth-bound GEMV when w is a whole expert
// weight and x a few decode rows (x rows outermost re-streamed w once per 2 rows).
template <template <int, int> class Tile>
void for_each_tile(const ThinView& v) {
  constexpr int MR = 2;
  for (int64_t r0 = 0; r0 < v.R; r0 += 8) {
    for (int64_t m0 = 0; m0 < v.M; m0 += MR) {
      const bool two = m0 + 1 < v.M;
      switch (std::min<int64_t>(8, v.R - r0) + (two ? 0 : 8)) {
        case 1: Tile<2, 1>::run(v, m0, r0); break;
        case 2: Tile<2, 2>::run(v, m0, r0); break;
        case 3: Tile<2, 3>::run(v, m0, r0); break;
        case 4: Tile<2, 4>::run(v, m0, r0); break;
        case 5: Tile<2, 5>::run(v, m0, r0); break;
        case 6: Tile<2, 6>::run(v, m0, r0); break;
        case 7: Tile<2, 7>::run(v, m0, r0); break;
        case 8: Tile<2, 8>::run(v, m0, r0); break;
        case 9: Tile<1, 1>::run(v, m0, r0); break;
        case 10: Tile<1, 2>::run(v, m0, r0); break;
        case 11: Tile<1, 3>::run(v, m0, r0); break;
        case 12: Tile<1, 4>::run(v, m0, r0); break;
        case 13: Tile<1, 5>::run(v, m0, r0); break;
        case 14: Tile<1, 6>::run(v, m0, r0); break;
        case 15: Tile<1, 7>::run(v, m0, r0); break;
        case 16: Tile<1, 8>::run(v, m0, r0); break;
        default: break;
      }
    }
  }
}

// Software prefetch of the next tile's weight rows (for_each_tile's next r0 = r0 + 8), one
// cache line of each per 64 bytes of this tile's rows: with rows of 1.5 KB (bf16, K = 768:
// a Qwen3-30B-A3B down projection) a tile's 8 short row streams ended before the hardware
// prefetcher caught up, and the GEMV streamed weights at 7 GB/s instead of 16 (AVX2 Zen 3).
// Every path's tiles prefetch: without it the AVX512-BF16 tiles' bf16 decode ran 10-17%
// slower than the AVX2 tiles with it on the same Zen 4.
template <int RJ>
inline void prefetch_next_tile(const ThinView& v, int64_t r0, int64_t byte_offset, int element_bytes) {
  KT_UNROLL for (int j = 0; j < RJ; ++j) {
    const int64_t r = r0 + 8 + j;
    if (r < v.R) {
      _mm_prefetch(static_cast<const char*>(v.w) + (r * v.ldw) * element_bytes + byte_offset, _MM_HINT_T1);
    }
  }
}

// ---- AVX512-BF16: 32 bf16 per step, vdpbf16ps straight on the rows -------------------------

template <int MR, int RJ>
struct TileAvx512Bf16 {
  KT_TARGET_AVX512_BF16 static void run(const ThinView& v, int64_t m0, int64_t r0) {
    const uint16_t* x = static_cast<const uint16_t*>(v.x);
    const uint16_t* w = static_cast<const uint16_t*>(v.w);
    __m512 acc[MR][RJ];
    KT_UNROLL for (int i = 0; i < MR; ++i)
      KT_UNROLL for (int j = 0; j < RJ; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < v.K; k += 32) {
      prefetch_next_tile<RJ>(v, r0, k * 2, 2);  // 64 bytes of each row per step
      const __mmask32 mask = v.K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (v.K - k)) - 1;
      __m512bh xv[MR];
      KT_UNROLL for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + i) * v.ldx + k);
      KT_UNROLL for (int j = 0; j < RJ; ++j) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (r0 + j) * v.ldw + k);
        KT_UNROLL for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
      }
    }
    KT_UNROLL for (int i = 0; i < MR; ++i)
      KT_UNROLL for (int j = 0; j < RJ; ++j) store_out(v, m0 + i, r0 + j, _mm512_reduce_add_ps(acc[i][j]));
  }
};

// ---- AVX-512: 16 floats per step -------------------------------------------------------------

KT_TARGET_AVX512 inline __m512 masked_load16(const void* p, bool bf16, int64_t i, __mmask16 mask) {
  if (bf16) {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
}

template <int MR, int RJ>
struct TileAvx512 {
  KT_TARGET_AVX512 static void run(const ThinView& v, int64_t m0, int64_t r0) {
    __m512 acc[MR][RJ];
    KT_UNROLL for (int i = 0; i < MR; ++i)
      KT_UNROLL for (int j = 0; j < RJ; ++j) acc[i][j] = _mm512_setzero_ps();
    const int element_bytes = v.in_bf16 ? 2 : 4;
    for (int64_t k = 0; k < v.K; k += 16) {
      if ((k * element_bytes) % 64 == 0) prefetch_next_tile<RJ>(v, r0, k * element_bytes, element_bytes);
      const __mmask16 mask = v.K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (v.K - k)) - 1);
      __m512 xv[MR];
      KT_UNROLL for (int i = 0; i < MR; ++i) xv[i] = masked_load16(v.x, v.in_bf16, (m0 + i) * v.ldx + k, mask);
      KT_UNROLL for (int j = 0; j < RJ; ++j) {
        const __m512 wv = masked_load16(v.w, v.in_bf16, (r0 + j) * v.ldw + k, mask);
        KT_UNROLL for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
      }
    }
    KT_UNROLL for (int i = 0; i < MR; ++i)
      KT_UNROLL for (int j = 0; j < RJ; ++j) store_out(v, m0 + i, r0 + j, _mm512_reduce_add_ps(acc[i][j]));
  }
};

// ---- AVX2: 8 floats per step, the K tail through the reference formula ---------------------

KT_TARGET_AVX2 inline __m256 load8(const void* p, bool bf16, int64_t i) {
  return bf16 ? simd::load8_bf16(static_cast<const uint16_t*>(p) + i) : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

template <int MR, int RJ>
struct TileAvx2 {
  KT_TARGET_AVX2 static void run(const ThinView& v, int64_t m0, int64_t r0) {
    __m256 acc[MR][RJ];
    KT_UNROLL for (int i = 0; i < MR; ++i)
      KT_UNROLL for (int j = 0; j < RJ; ++j) acc[i][j] = _mm256_setzero_ps();
    const int64_t k_full = v.K / 8 * 8;
    const int element_bytes = v.in_bf16 ? 2 : 4;
    for (int64_t k = 0; k < k_full; k += 8) {
      if ((k * element_bytes) % 64 == 0) prefetch_next_tile<RJ>(v, r0, k * element_bytes, element_bytes);
      __m256 xv[MR];
      KT_UNROLL for (int i = 0; i < MR; ++i) xv[i] = load8(v.x, v.in_bf16, (m0 + i) * v.ldx + k);
      KT_UNROLL for (int j = 0; j < RJ; ++j) {
        const __m256 wv = load8(v.w, v.in_bf16, (r0 + j) * v.ldw + k);
        KT_UNROLL for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
      }
    }
    KT_UNROLL for (int i = 0; i < MR; ++i) {
      KT_UNROLL for (int j = 0; j < RJ; ++j) {
        float sum = simd::hsum8(acc[i][j]);
        for (int64_t k = k_full; k < v.K; ++k) {
          sum += load_scalar(v.x, v.in_bf16, (m0 + i) * v.ldx + k) * load_scalar(v.w, v.in_bf16, (r0 + j) * v.ldw + k);
        }
        store_out(v, m0 + i, r0 + j, sum);
      }
    }
  }
};

// bf16 rows on AVX2, 16 values per step. Interleaving a 256-bit load of 16 bf16 with zeros
// (unpacklo/hi_epi16) gives two float vectors, elements {0-3, 8-11} and {4-7, 12-15}: x and w
// are permuted alike, so the products still pair up and the dot product is unchanged. That is
// one load and two unpacks per 16 values instead of two widening loads and two shifts. At
// most 8 accumulators (plus 2·MR + 3 operands: AVX2 has 16 registers): one x row takes 8 w rows
// at a time, as many concurrent weight streams as the fp32 tile; two x rows take 4, wider
// tiles run as two passes.
template <int MR, int RJ>
struct TileAvx2Bf16 {
  KT_TARGET_AVX2 static void run(const ThinView& v, int64_t m0, int64_t r0) {
    if constexpr (MR * RJ > 8) {
      TileAvx2Bf16<MR, RJ / 2>::run(v, m0, r0);
      TileAvx2Bf16<MR, RJ - RJ / 2>::run(v, m0, r0 + RJ / 2);
    } else {
      const uint16_t* x = static_cast<const uint16_t*>(v.x);
      const uint16_t* w = static_cast<const uint16_t*>(v.w);
      const __m256i zero = _mm256_setzero_si256();
      __m256 acc[MR][RJ];
      KT_UNROLL for (int i = 0; i < MR; ++i)
        KT_UNROLL for (int j = 0; j < RJ; ++j) acc[i][j] = _mm256_setzero_ps();
      const int64_t k_full = v.K / 16 * 16;
      for (int64_t k = 0; k < k_full; k += 16) {
        if (k % 32 == 0) prefetch_next_tile<RJ>(v, r0, 2 * k, 2);
        __m256 xlo[MR], xhi[MR];
        KT_UNROLL for (int i = 0; i < MR; ++i) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + (m0 + i) * v.ldx + k));
          xlo[i] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
          xhi[i] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
        }
        KT_UNROLL for (int j = 0; j < RJ; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r0 + j) * v.ldw + k));
          const __m256 wlo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
          const __m256 whi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
          KT_UNROLL for (int i = 0; i < MR; ++i) {
            acc[i][j] = _mm256_fmadd_ps(xlo[i], wlo, acc[i][j]);
            acc[i][j] = _mm256_fmadd_ps(xhi[i], whi, acc[i][j]);
          }
        }
      }
      KT_UNROLL for (int i = 0; i < MR; ++i) {
        KT_UNROLL for (int j = 0; j < RJ; ++j) {
          float sum = simd::hsum8(acc[i][j]);
          for (int64_t k = k_full; k < v.K; ++k) {
            sum += simd::bf16_to_float(x[(m0 + i) * v.ldx + k]) * simd::bf16_to_float(w[(r0 + j) * v.ldw + k]);
          }
          store_out(v, m0 + i, r0 + j, sum);
        }
      }
    }
  }
};

bool is_f32_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

void thin_gemm_nt(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, CpuIsa isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && x.size(1) == w.size(1) &&
                  out.size(0) == x.size(0) && out.size(1) == w.size(0),
              "thin_gemm_nt: shapes do not match");
  const bool fast = is_f32_or_bf16(out) && is_f32_or_bf16(x) && x.scalar_type() == w.scalar_type() &&
                    x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1;
  if (!fast) {
    out.copy_(at::mm(x.to(out.scalar_type()), w.to(out.scalar_type()).t()));
    return;
  }
  ThinView v{x.size(0), w.size(0), x.size(1), x.const_data_ptr(), x.stride(0), w.const_data_ptr(), w.stride(0),
             x.scalar_type() == at::kBFloat16, out.mutable_data_ptr(), out.stride(0),
             out.scalar_type() == at::kBFloat16};
  if (v.M == 0 || v.R == 0) return;
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
      if (v.in_bf16) return for_each_tile<TileAvx512Bf16>(v);
      return for_each_tile<TileAvx512>(v);
    case CpuIsa::kAvx512: return for_each_tile<TileAvx512>(v);
    case CpuIsa::kAvx2:
      if (v.in_bf16) return for_each_tile<TileAvx2Bf16>(v);
      return for_each_tile<TileAvx2>(v);
    case CpuIsa::kPortable: return thin_reference(v);
  }
}

void thin_gemm_nt(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  thin_gemm_nt(out, x, w, active_cpu_isa());
}

at::Tensor thin_gemm_nt(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  thin_gemm_nt(out, x, w);
  return out;
}

}  // namespace kt
