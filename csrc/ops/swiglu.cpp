// Kernels of swiglu.h: the reference loops (any floating dtype), then float32/bfloat16
// kernels per instruction set. The SIMD kernels do 16 (AVX-512) or 8 (AVX2) elements per
// step and finish each row with the reference loop's formula.
#include "ops/swiglu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <cmath>

#include "ops/simd.h"

namespace kt {
namespace {

// ---- reference ---------------------------------------------------------------------------

// One row of the forward, elements [j0, I).
template <typename scalar_t, typename acc_t>
void forward_row_reference(const scalar_t* gr, const scalar_t* ur, scalar_t* hr, int64_t j0, int64_t I) {
  for (int64_t j = j0; j < I; ++j) {
    const acc_t gv = static_cast<acc_t>(gr[j]);
    hr[j] = static_cast<scalar_t>(gv / (acc_t(1) + std::exp(-gv)) * static_cast<acc_t>(ur[j]));
  }
}

template <typename scalar_t, typename acc_t>
void forward_reference(const at::Tensor& g, const at::Tensor& u, at::Tensor& h) {
  const int64_t n = h.size(0), I = h.size(1);
  for (int64_t i = 0; i < n; ++i) {
    forward_row_reference<scalar_t, acc_t>(g.const_data_ptr<scalar_t>() + i * g.stride(0),
                                           u.const_data_ptr<scalar_t>() + i * u.stride(0),
                                           h.mutable_data_ptr<scalar_t>() + i * h.stride(0), 0, I);
  }
}

// One row of the backward, elements [j0, I): returns Σ dh'·h over them.
template <typename scalar_t, typename acc_t>
acc_t backward_row_reference(const scalar_t* gr, const scalar_t* ur, const scalar_t* dhr, acc_t w, scalar_t* dgr,
                             scalar_t* dur, scalar_t* hwr, int64_t j0, int64_t I) {
  acc_t dw = 0;
  for (int64_t j = j0; j < I; ++j) {
    const acc_t gv = static_cast<acc_t>(gr[j]), uv = static_cast<acc_t>(ur[j]);
    const acc_t sig = acc_t(1) / (acc_t(1) + std::exp(-gv));
    const acc_t silu = gv * sig;
    const acc_t dh_unweighted = static_cast<acc_t>(dhr[j]);
    const acc_t dh = w * dh_unweighted;
    dw += dh_unweighted * silu * uv;
    dur[j] = static_cast<scalar_t>(dh * silu);
    dgr[j] = static_cast<scalar_t>(dh * uv * (sig + silu * (acc_t(1) - sig)));
    if (hwr) hwr[j] = static_cast<scalar_t>(w * silu * uv);
  }
  return dw;
}

template <typename scalar_t>
scalar_t* row_ptr(at::Tensor& t, int64_t i) {
  return t.defined() ? t.mutable_data_ptr<scalar_t>() + i * t.stride(0) : nullptr;
}

// Zero rows [n, p) of the outputs (the GEMMs that follow read padded blocks).
void zero_tail_rows(SwigluBackwardOut& out, int64_t n) {
  const int64_t p = out.dg.size(0);
  out.dg.narrow(0, n, p - n).zero_();
  out.du.narrow(0, n, p - n).zero_();
  if (out.hw.defined()) out.hw.narrow(0, n, p - n).zero_();
}

template <typename scalar_t, typename acc_t>
void backward_reference(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                        SwigluBackwardOut& out) {
  const int64_t n = g.size(0), I = g.size(1);
  const acc_t* wp = w.const_data_ptr<acc_t>();
  for (int64_t i = 0; i < n; ++i) {
    const acc_t dw = backward_row_reference<scalar_t, acc_t>(
        g.const_data_ptr<scalar_t>() + i * g.stride(0), u.const_data_ptr<scalar_t>() + i * u.stride(0),
        dh.const_data_ptr<scalar_t>() + i * dh.stride(0), wp[i], row_ptr<scalar_t>(out.dg, i),
        row_ptr<scalar_t>(out.du, i), row_ptr<scalar_t>(out.hw, i), 0, I);
    if (out.dw.defined()) out.dw.mutable_data_ptr<acc_t>()[i] = dw;
  }
}

// ---- SIMD: one template per vector width, instantiated for float and bfloat16 -------------

template <typename scalar_t>
KT_TARGET_AVX512 inline __m512 ld16(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return simd::load16_bf16(reinterpret_cast<const uint16_t*>(p));
  }
}

template <typename scalar_t, bool kNativeBf16>
KT_TARGET_AVX512_BF16 inline void st16(scalar_t* p, __m512 v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm512_storeu_ps(p, v);
  } else if constexpr (kNativeBf16) {
    simd::store16_bf16_native(reinterpret_cast<uint16_t*>(p), v);
  } else {
    simd::store16_bf16(reinterpret_cast<uint16_t*>(p), v);
  }
}

// The AVX-512 kernels are compiled with the AVX512-BF16 target so that one body serves both
// paths; kNativeBf16 = false never emits a BF16 instruction, so it runs on any AVX-512 CPU.
template <typename scalar_t, bool kNativeBf16>
KT_TARGET_AVX512_BF16 void forward_avx512(const at::Tensor& g, const at::Tensor& u, at::Tensor& h) {
  const int64_t n = h.size(0), I = h.size(1), I16 = I / 16 * 16;
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* gr = g.const_data_ptr<scalar_t>() + i * g.stride(0);
    const scalar_t* ur = u.const_data_ptr<scalar_t>() + i * u.stride(0);
    scalar_t* hr = h.mutable_data_ptr<scalar_t>() + i * h.stride(0);
    for (int64_t j = 0; j < I16; j += 16) {
      const __m512 gv = ld16(gr + j);
      st16<scalar_t, kNativeBf16>(hr + j, _mm512_mul_ps(_mm512_mul_ps(gv, simd::sigmoid16(gv)), ld16(ur + j)));
    }
    forward_row_reference<scalar_t, float>(gr, ur, hr, I16, I);
  }
}

template <typename scalar_t, bool kNativeBf16>
KT_TARGET_AVX512_BF16 void backward_avx512(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh,
                                           const at::Tensor& w, SwigluBackwardOut& out) {
  const int64_t n = g.size(0), I = g.size(1), I16 = I / 16 * 16;
  const float* wp = w.const_data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* gr = g.const_data_ptr<scalar_t>() + i * g.stride(0);
    const scalar_t* ur = u.const_data_ptr<scalar_t>() + i * u.stride(0);
    const scalar_t* dhr = dh.const_data_ptr<scalar_t>() + i * dh.stride(0);
    scalar_t* dgr = row_ptr<scalar_t>(out.dg, i);
    scalar_t* dur = row_ptr<scalar_t>(out.du, i);
    scalar_t* hwr = row_ptr<scalar_t>(out.hw, i);
    const __m512 w16 = _mm512_set1_ps(wp[i]);
    __m512 dw16 = _mm512_setzero_ps();
    for (int64_t j = 0; j < I16; j += 16) {
      const __m512 gv = ld16(gr + j), uv = ld16(ur + j), dhu = ld16(dhr + j);
      const __m512 sig = simd::sigmoid16(gv);
      const __m512 silu = _mm512_mul_ps(gv, sig);
      const __m512 hv = _mm512_mul_ps(silu, uv);
      const __m512 dhv = _mm512_mul_ps(w16, dhu);
      dw16 = _mm512_fmadd_ps(dhu, hv, dw16);
      st16<scalar_t, kNativeBf16>(dur + j, _mm512_mul_ps(dhv, silu));
      const __m512 dsilu = _mm512_fmadd_ps(silu, _mm512_sub_ps(one, sig), sig);
      st16<scalar_t, kNativeBf16>(dgr + j, _mm512_mul_ps(_mm512_mul_ps(dhv, uv), dsilu));
      if (hwr) st16<scalar_t, kNativeBf16>(hwr + j, _mm512_mul_ps(w16, hv));
    }
    const float dw = _mm512_reduce_add_ps(dw16) +
                     backward_row_reference<scalar_t, float>(gr, ur, dhr, wp[i], dgr, dur, hwr, I16, I);
    if (out.dw.defined()) out.dw.mutable_data_ptr<float>()[i] = dw;
  }
}

template <typename scalar_t>
KT_TARGET_AVX2 inline __m256 ld8(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(p);
  } else {
    return simd::load8_bf16(reinterpret_cast<const uint16_t*>(p));
  }
}

template <typename scalar_t>
KT_TARGET_AVX2 inline void st8(scalar_t* p, __m256 v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm256_storeu_ps(p, v);
  } else {
    simd::store8_bf16(reinterpret_cast<uint16_t*>(p), v);
  }
}

template <typename scalar_t>
KT_TARGET_AVX2 void forward_avx2(const at::Tensor& g, const at::Tensor& u, at::Tensor& h) {
  const int64_t n = h.size(0), I = h.size(1), I8 = I / 8 * 8;
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* gr = g.const_data_ptr<scalar_t>() + i * g.stride(0);
    const scalar_t* ur = u.const_data_ptr<scalar_t>() + i * u.stride(0);
    scalar_t* hr = h.mutable_data_ptr<scalar_t>() + i * h.stride(0);
    for (int64_t j = 0; j < I8; j += 8) {
      const __m256 gv = ld8(gr + j);
      st8(hr + j, _mm256_mul_ps(_mm256_mul_ps(gv, simd::sigmoid8(gv)), ld8(ur + j)));
    }
    forward_row_reference<scalar_t, float>(gr, ur, hr, I8, I);
  }
}

template <typename scalar_t>
KT_TARGET_AVX2 void backward_avx2(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh,
                                  const at::Tensor& w, SwigluBackwardOut& out) {
  const int64_t n = g.size(0), I = g.size(1), I8 = I / 8 * 8;
  const float* wp = w.const_data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* gr = g.const_data_ptr<scalar_t>() + i * g.stride(0);
    const scalar_t* ur = u.const_data_ptr<scalar_t>() + i * u.stride(0);
    const scalar_t* dhr = dh.const_data_ptr<scalar_t>() + i * dh.stride(0);
    scalar_t* dgr = row_ptr<scalar_t>(out.dg, i);
    scalar_t* dur = row_ptr<scalar_t>(out.du, i);
    scalar_t* hwr = row_ptr<scalar_t>(out.hw, i);
    const __m256 w8 = _mm256_set1_ps(wp[i]);
    __m256 dw8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < I8; j += 8) {
      const __m256 gv = ld8(gr + j), uv = ld8(ur + j), dhu = ld8(dhr + j);
      const __m256 sig = simd::sigmoid8(gv);
      const __m256 silu = _mm256_mul_ps(gv, sig);
      const __m256 hv = _mm256_mul_ps(silu, uv);
      const __m256 dhv = _mm256_mul_ps(w8, dhu);
      dw8 = _mm256_fmadd_ps(dhu, hv, dw8);
      st8(dur + j, _mm256_mul_ps(dhv, silu));
      const __m256 dsilu = _mm256_fmadd_ps(silu, _mm256_sub_ps(one, sig), sig);
      st8(dgr + j, _mm256_mul_ps(_mm256_mul_ps(dhv, uv), dsilu));
      if (hwr) st8(hwr + j, _mm256_mul_ps(w8, hv));
    }
    const float dw = simd::hsum8(dw8) +
                     backward_row_reference<scalar_t, float>(gr, ur, dhr, wp[i], dgr, dur, hwr, I8, I);
    if (out.dw.defined()) out.dw.mutable_data_ptr<float>()[i] = dw;
  }
}

}  // namespace

void swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, CpuIsa isa) {
  const auto t = h.scalar_type();
  if (h.size(0) == 0 || h.size(1) == 0) return;
  if (t == at::kDouble || isa == CpuIsa::kPortable) {
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, t, "kt_swiglu_forward", [&] {
      forward_reference<scalar_t, at::opmath_type<scalar_t>>(g, u, h);
    });
    return;
  }
  const bool bf16 = t == at::kBFloat16;
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
      return bf16 ? forward_avx512<c10::BFloat16, true>(g, u, h) : forward_avx512<float, true>(g, u, h);
    case CpuIsa::kAvx512:
      return bf16 ? forward_avx512<c10::BFloat16, false>(g, u, h) : forward_avx512<float, false>(g, u, h);
    default:
      return bf16 ? forward_avx2<c10::BFloat16>(g, u, h) : forward_avx2<float>(g, u, h);
  }
}

void swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h) {
  swiglu_forward(g, u, h, active_cpu_isa());
}

void swiglu_backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                     SwigluBackwardOut& out, CpuIsa isa) {
  const auto t = g.scalar_type();
  const int64_t n = g.size(0);
  if (g.size(1) > 0 && n > 0) {
    if (t == at::kDouble || isa == CpuIsa::kPortable) {
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, t, "kt_swiglu_backward", [&] {
        backward_reference<scalar_t, at::opmath_type<scalar_t>>(g, u, dh, w, out);
      });
    } else {
      const bool bf16 = t == at::kBFloat16;
      switch (isa) {
        case CpuIsa::kAvx512Bf16:
          bf16 ? backward_avx512<c10::BFloat16, true>(g, u, dh, w, out)
               : backward_avx512<float, true>(g, u, dh, w, out);
          break;
        case CpuIsa::kAvx512:
          bf16 ? backward_avx512<c10::BFloat16, false>(g, u, dh, w, out)
               : backward_avx512<float, false>(g, u, dh, w, out);
          break;
        default:
          bf16 ? backward_avx2<c10::BFloat16>(g, u, dh, w, out) : backward_avx2<float>(g, u, dh, w, out);
      }
    }
  } else if (out.dw.defined()) {
    out.dw.zero_();
  }
  zero_tail_rows(out, n);
}

void swiglu_backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                     SwigluBackwardOut& out) {
  swiglu_backward(g, u, dh, w, out, active_cpu_isa());
}

}  // namespace kt
