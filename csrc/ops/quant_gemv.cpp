#include "ops/quant_gemv.h"

#include <immintrin.h>

#include <vector>

#include "ops/dequantize.h"
#include "ops/simd.h"

namespace kt {
namespace {

void dots_reference(const float* x, int64_t M, int64_t K, const float* w_row, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * w_row[k];
    out[m * ldo] = acc;
  }
}

KT_TARGET_AVX2 inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// out[m * ldo] = x[m]·w_row for each of the M rows of x: two accumulators per row (FMA latency).
KT_TARGET_AVX2 void dots_avx2(const float* x, int64_t M, int64_t K, const float* w_row, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k), _mm256_loadu_ps(w_row + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 8), _mm256_loadu_ps(w_row + k + 8), a1);
    }
    float acc = sum8(_mm256_add_ps(a0, a1));
    for (; k < K; ++k) acc += xm[k] * w_row[k];
    out[m * ldo] = acc;
  }
}

}  // namespace

at::Tensor quant_gemv_nt(const at::Tensor& x, const WeightMatrix& w, CpuIsa isa) {
  TORCH_INTERNAL_ASSERT(w.quantized() && x.dim() == 2 && x.size(1) == w.cols);
  const int64_t M = x.size(0), K = w.cols, R = w.rows;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, R}, x.options().dtype(at::kFloat));
  if (M == 0 || R == 0) return out.to(x.scalar_type());
  std::vector<float> row(K);
  const float* xp = xf.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    dequantize_rows(w, r, 1, row.data(), K, isa);
    if (isa == CpuIsa::kPortable) {
      dots_reference(xp, M, K, row.data(), op + r, R);
    } else {
      dots_avx2(xp, M, K, row.data(), op + r, R);
    }
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace kt
