// Kernels of swiglu.h: the reference loops (any floating dtype), then float32/bfloat16
// kernels per instruction set. The SIMD kernels do 16 (AVX-512) or 8 (AVX2) elements per
// step and finish each row with the reference loop's formula.
#include "kernels/swiglu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <cmath>

#include "platform/simd.h"

namespace kt {
namespace {

// ---- reference ---------------------------------------------------------------------------

// torch.clamp(v, max=limit) and torch.clamp(v, -limit, limit): NaN stays NaN.
template <typename acc_t>
acc_t clamp_gate(acc_t v, acc_t limit) { return v > limit ? limit : v; }
template <typename acc_t>
acc_t clamp_up(acc_t v, acc_t limit) { return v > limit ? limit : v < -limit ? -limit : v; }
// Where their gradient passes (torch.clamp's: inside the range, bounds included; not NaN).
template <typename acc_t>
bool gate_passes(acc_t v, acc_t limit) { return v <= limit; }
template <typename acc_t>
bool up_passes(acc_t v, acc_t limit) { return v >= -limit && v <= limit; }

// act(g) = g·σ(z) (swiglu.h): z and dz/dg per activation.
constexpr double kGeluK = 1.5957691216057308;  // 2·sqrt(2/π)
constexpr double kGeluC = 0.044715;

template <GatedActivation kAct, typename acc_t>
acc_t act_arg(acc_t g, acc_t alpha) {
  if constexpr (kAct == GatedActivation::kSilu) return g;
  if constexpr (kAct == GatedActivation::kSwigluOai) return alpha * g;
  return acc_t(kGeluK) * g * (acc_t(1) + acc_t(kGeluC) * g * g);
}
template <GatedActivation kAct, typename acc_t>
acc_t act_arg_slope(acc_t g, acc_t alpha) {
  if constexpr (kAct == GatedActivation::kSilu) return acc_t(1);
  if constexpr (kAct == GatedActivation::kSwigluOai) return alpha;
  return acc_t(kGeluK) * (acc_t(1) + acc_t(3 * kGeluC) * g * g);
}
// swigluoai multiplies by u + 1 (after the clamp); the others by u.
template <GatedActivation kAct>
constexpr bool kShiftsUp = kAct == GatedActivation::kSwigluOai;

// One row of the forward, elements [j0, I).
template <typename scalar_t, typename acc_t, bool kClamp, GatedActivation kAct>
void forward_row_reference(const scalar_t* gr, const scalar_t* ur, scalar_t* hr, int64_t j0, int64_t I,
                           acc_t limit, acc_t alpha) {
  for (int64_t j = j0; j < I; ++j) {
    acc_t gv = static_cast<acc_t>(gr[j]), uv = static_cast<acc_t>(ur[j]);
    if constexpr (kClamp) gv = clamp_gate(gv, limit), uv = clamp_up(uv, limit);
    if constexpr (kShiftsUp<kAct>) uv += acc_t(1);
    hr[j] = static_cast<scalar_t>(gv / (acc_t(1) + std::exp(-act_arg<kAct>(gv, alpha))) * uv);
  }
}

template <typename scalar_t, typename acc_t, bool kClamp, GatedActivation kAct>
void forward_reference(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, acc_t limit, acc_t alpha) {
  const int64_t n = h.size(0), I = h.size(1);
  for (int64_t i = 0; i < n; ++i) {
    forward_row_reference<scalar_t, acc_t, kClamp, kAct>(g.const_data_ptr<scalar_t>() + i * g.stride(0),
                                                   u.const_data_ptr<scalar_t>() + i * u.stride(0),
                                                   h.mutable_data_ptr<scalar_t>() + i * h.stride(0), 0, I, limit,
                                                   alpha);
  }
}

// One row of the backward, elements [j0, I): returns Σ dh'·h over them.
template <typename scalar_t, typename acc_t, bool kClamp, GatedActivation kAct>
acc_t backward_row_reference(const scalar_t* gr, const scalar_t* ur, const scalar_t* dhr, acc_t w, scalar_t* dgr,
                             scalar_t* dur, scalar_t* hwr, int64_t j0, int64_t I, acc_t limit, acc_t alpha) {
  acc_t dw = 0;
  for (int64_t j = j0; j < I; ++j) {
    const acc_t g_in = static_cast<acc_t>(gr[j]), u_in = static_cast<acc_t>(ur[j]);
    const acc_t gv = kClamp ? clamp_gate(g_in, limit) : g_in;
    const acc_t uv = (kClamp ? clamp_up(u_in, limit) : u_in) + acc_t(kShiftsUp<kAct> ? 1 : 0);
    const acc_t sig = acc_t(1) / (acc_t(1) + std::exp(-act_arg<kAct>(gv, alpha)));
    const acc_t silu = gv * sig;  // act(g)
    const acc_t dh_unweighted = static_cast<acc_t>(dhr[j]);
    const acc_t dh = w * dh_unweighted;
    dw += dh_unweighted * silu * uv;
    acc_t du = dh * silu, dg = dh * uv * (sig + silu * (acc_t(1) - sig) * act_arg_slope<kAct>(gv, alpha));
    if constexpr (kClamp) {
      if (!up_passes(u_in, limit)) du = 0;
      if (!gate_passes(g_in, limit)) dg = 0;
    }
    dur[j] = static_cast<scalar_t>(du);
    dgr[j] = static_cast<scalar_t>(dg);
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

template <typename scalar_t, typename acc_t, bool kClamp, GatedActivation kAct>
void backward_reference(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                        SwigluBackwardOut& out, acc_t limit, acc_t alpha) {
  const int64_t n = g.size(0), I = g.size(1);
  const acc_t* wp = w.const_data_ptr<acc_t>();
  for (int64_t i = 0; i < n; ++i) {
    const acc_t dw = backward_row_reference<scalar_t, acc_t, kClamp, kAct>(
        g.const_data_ptr<scalar_t>() + i * g.stride(0), u.const_data_ptr<scalar_t>() + i * u.stride(0),
        dh.const_data_ptr<scalar_t>() + i * dh.stride(0), wp[i], row_ptr<scalar_t>(out.dg, i),
        row_ptr<scalar_t>(out.du, i), row_ptr<scalar_t>(out.hw, i), 0, I, limit, alpha);
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

// z and dz/dg of act(g) = g·σ(z) in vectors (act_arg / act_arg_slope).
template <GatedActivation kAct>
KT_TARGET_AVX512 inline __m512 act_arg16(__m512 g, __m512 alpha) {
  if constexpr (kAct == GatedActivation::kSilu) return g;
  if constexpr (kAct == GatedActivation::kSwigluOai) return _mm512_mul_ps(alpha, g);
  const __m512 g2 = _mm512_mul_ps(g, g);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(float(kGeluK)), g),
                       _mm512_fmadd_ps(_mm512_set1_ps(float(kGeluC)), g2, _mm512_set1_ps(1.f)));
}
template <GatedActivation kAct>
KT_TARGET_AVX512 inline __m512 act_arg_slope16(__m512 g, __m512 alpha) {
  if constexpr (kAct == GatedActivation::kSilu) return _mm512_set1_ps(1.f);
  if constexpr (kAct == GatedActivation::kSwigluOai) return alpha;
  return _mm512_fmadd_ps(_mm512_set1_ps(float(3 * kGeluC * kGeluK)), _mm512_mul_ps(g, g), _mm512_set1_ps(float(kGeluK)));
}
template <GatedActivation kAct>
KT_TARGET_AVX2 inline __m256 act_arg8(__m256 g, __m256 alpha) {
  if constexpr (kAct == GatedActivation::kSilu) return g;
  if constexpr (kAct == GatedActivation::kSwigluOai) return _mm256_mul_ps(alpha, g);
  const __m256 g2 = _mm256_mul_ps(g, g);
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(float(kGeluK)), g),
                       _mm256_fmadd_ps(_mm256_set1_ps(float(kGeluC)), g2, _mm256_set1_ps(1.f)));
}
template <GatedActivation kAct>
KT_TARGET_AVX2 inline __m256 act_arg_slope8(__m256 g, __m256 alpha) {
  if constexpr (kAct == GatedActivation::kSilu) return _mm256_set1_ps(1.f);
  if constexpr (kAct == GatedActivation::kSwigluOai) return alpha;
  return _mm256_fmadd_ps(_mm256_set1_ps(float(3 * kGeluC * kGeluK)), _mm256_mul_ps(g, g), _mm256_set1_ps(float(kGeluK)));
}

// The AVX-512 kernels are compiled with the AVX512-BF16 target so that one body serves both
// paths; kNativeBf16 = false never emits a BF16 instruction, so it runs on any AVX-512 CPU.
// The clamps in vectors: min/max return their second operand where either is NaN, so the
// input goes second and NaN stays NaN; the ordered compares are false for NaN.
template <typename scalar_t, bool kNativeBf16, bool kClamp, GatedActivation kAct>
KT_TARGET_AVX512_BF16 void forward_avx512(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, float limit,
                                          float alpha) {
  const int64_t n = h.size(0), I = h.size(1), I16 = I / 16 * 16;
  const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit);
  const __m512 alpha16 = _mm512_set1_ps(alpha), one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* gr = g.const_data_ptr<scalar_t>() + i * g.stride(0);
    const scalar_t* ur = u.const_data_ptr<scalar_t>() + i * u.stride(0);
    scalar_t* hr = h.mutable_data_ptr<scalar_t>() + i * h.stride(0);
    for (int64_t j = 0; j < I16; j += 16) {
      __m512 gv = ld16(gr + j), uv = ld16(ur + j);
      if constexpr (kClamp) gv = _mm512_min_ps(hi, gv), uv = _mm512_max_ps(lo, _mm512_min_ps(hi, uv));
      if constexpr (kShiftsUp<kAct>) uv = _mm512_add_ps(uv, one);
      st16<scalar_t, kNativeBf16>(hr + j,
                                  _mm512_mul_ps(_mm512_mul_ps(gv, simd::sigmoid16(act_arg16<kAct>(gv, alpha16))), uv));
    }
    forward_row_reference<scalar_t, float, kClamp, kAct>(gr, ur, hr, I16, I, limit, alpha);
  }
}

template <typename scalar_t, bool kNativeBf16, bool kClamp, GatedActivation kAct>
KT_TARGET_AVX512_BF16 void backward_avx512(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh,
                                           const at::Tensor& w, SwigluBackwardOut& out, float limit, float alpha) {
  const int64_t n = g.size(0), I = g.size(1), I16 = I / 16 * 16;
  const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit), alpha16 = _mm512_set1_ps(alpha);
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
      const __m512 g_in = ld16(gr + j), u_in = ld16(ur + j), dhu = ld16(dhr + j);
      const __m512 gv = kClamp ? _mm512_min_ps(hi, g_in) : g_in;
      __m512 uv = kClamp ? _mm512_max_ps(lo, _mm512_min_ps(hi, u_in)) : u_in;
      if constexpr (kShiftsUp<kAct>) uv = _mm512_add_ps(uv, one);
      const __m512 sig = simd::sigmoid16(act_arg16<kAct>(gv, alpha16));
      const __m512 silu = _mm512_mul_ps(gv, sig);
      const __m512 hv = _mm512_mul_ps(silu, uv);
      const __m512 dhv = _mm512_mul_ps(w16, dhu);
      dw16 = _mm512_fmadd_ps(dhu, hv, dw16);
      __m512 du = _mm512_mul_ps(dhv, silu);
      const __m512 dsilu = _mm512_fmadd_ps(_mm512_mul_ps(silu, _mm512_sub_ps(one, sig)), act_arg_slope16<kAct>(gv, alpha16), sig);
      __m512 dg = _mm512_mul_ps(_mm512_mul_ps(dhv, uv), dsilu);
      if constexpr (kClamp) {
        du = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u_in, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(u_in, hi, _CMP_LE_OQ), du);
        dg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(g_in, hi, _CMP_LE_OQ), dg);
      }
      st16<scalar_t, kNativeBf16>(dur + j, du);
      st16<scalar_t, kNativeBf16>(dgr + j, dg);
      if (hwr) st16<scalar_t, kNativeBf16>(hwr + j, _mm512_mul_ps(w16, hv));
    }
    const float dw = _mm512_reduce_add_ps(dw16) +
                     backward_row_reference<scalar_t, float, kClamp, kAct>(gr, ur, dhr, wp[i], dgr, dur, hwr, I16, I, limit,
                                                                          alpha);
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

template <typename scalar_t, bool kClamp, GatedActivation kAct>
KT_TARGET_AVX2 void forward_avx2(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, float limit, float alpha) {
  const int64_t n = h.size(0), I = h.size(1), I8 = I / 8 * 8;
  const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
  const __m256 alpha8 = _mm256_set1_ps(alpha), one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* gr = g.const_data_ptr<scalar_t>() + i * g.stride(0);
    const scalar_t* ur = u.const_data_ptr<scalar_t>() + i * u.stride(0);
    scalar_t* hr = h.mutable_data_ptr<scalar_t>() + i * h.stride(0);
    for (int64_t j = 0; j < I8; j += 8) {
      __m256 gv = ld8(gr + j), uv = ld8(ur + j);
      if constexpr (kClamp) gv = _mm256_min_ps(hi, gv), uv = _mm256_max_ps(lo, _mm256_min_ps(hi, uv));
      if constexpr (kShiftsUp<kAct>) uv = _mm256_add_ps(uv, one);
      st8(hr + j, _mm256_mul_ps(_mm256_mul_ps(gv, simd::sigmoid8(act_arg8<kAct>(gv, alpha8))), uv));
    }
    forward_row_reference<scalar_t, float, kClamp, kAct>(gr, ur, hr, I8, I, limit, alpha);
  }
}

template <typename scalar_t, bool kClamp, GatedActivation kAct>
KT_TARGET_AVX2 void backward_avx2(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh,
                                  const at::Tensor& w, SwigluBackwardOut& out, float limit, float alpha) {
  const int64_t n = g.size(0), I = g.size(1), I8 = I / 8 * 8;
  const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit), alpha8 = _mm256_set1_ps(alpha);
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
      const __m256 g_in = ld8(gr + j), u_in = ld8(ur + j), dhu = ld8(dhr + j);
      const __m256 gv = kClamp ? _mm256_min_ps(hi, g_in) : g_in;
      __m256 uv = kClamp ? _mm256_max_ps(lo, _mm256_min_ps(hi, u_in)) : u_in;
      if constexpr (kShiftsUp<kAct>) uv = _mm256_add_ps(uv, one);
      const __m256 sig = simd::sigmoid8(act_arg8<kAct>(gv, alpha8));
      const __m256 silu = _mm256_mul_ps(gv, sig);
      const __m256 hv = _mm256_mul_ps(silu, uv);
      const __m256 dhv = _mm256_mul_ps(w8, dhu);
      dw8 = _mm256_fmadd_ps(dhu, hv, dw8);
      __m256 du = _mm256_mul_ps(dhv, silu);
      const __m256 dsilu = _mm256_fmadd_ps(_mm256_mul_ps(silu, _mm256_sub_ps(one, sig)), act_arg_slope8<kAct>(gv, alpha8), sig);
      __m256 dg = _mm256_mul_ps(_mm256_mul_ps(dhv, uv), dsilu);
      if constexpr (kClamp) {
        du = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(u_in, lo, _CMP_GE_OQ), _mm256_cmp_ps(u_in, hi, _CMP_LE_OQ)), du);
        dg = _mm256_and_ps(_mm256_cmp_ps(g_in, hi, _CMP_LE_OQ), dg);
      }
      st8(dur + j, du);
      st8(dgr + j, dg);
      if (hwr) st8(hwr + j, _mm256_mul_ps(w8, hv));
    }
    const float dw = simd::hsum8(dw8) +
                     backward_row_reference<scalar_t, float, kClamp, kAct>(gr, ur, dhr, wp[i], dgr, dur, hwr, I8, I, limit, alpha);
    if (out.dw.defined()) out.dw.mutable_data_ptr<float>()[i] = dw;
  }
}

// The kernel of path `isa` and dtype `t` for a clamp or none (kClamp) and an activation.
template <bool kClamp, GatedActivation kAct, typename Kernels>
void dispatch_isa(const Kernels& k, at::ScalarType t, CpuIsa isa) {
  const bool bf16 = t == at::kBFloat16;
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
      return bf16 ? k.template avx512<c10::BFloat16, true, kClamp, kAct>()
                  : k.template avx512<float, true, kClamp, kAct>();
    case CpuIsa::kAvx512:
      return bf16 ? k.template avx512<c10::BFloat16, false, kClamp, kAct>()
                  : k.template avx512<float, false, kClamp, kAct>();
    default:
      return bf16 ? k.template avx2<c10::BFloat16, kClamp, kAct>() : k.template avx2<float, kClamp, kAct>();
  }
}

// f.template operator()<kClamp, kAct>() for the gating's runtime clamp and activation.
template <bool kClamp, typename F>
void with_activation(GatedActivation act, const F& f) {
  switch (act) {
    case GatedActivation::kGeluTanh: return f.template operator()<kClamp, GatedActivation::kGeluTanh>();
    case GatedActivation::kSwigluOai: return f.template operator()<kClamp, GatedActivation::kSwigluOai>();
    default: return f.template operator()<kClamp, GatedActivation::kSilu>();
  }
}
template <typename F>
void with_gating(const Gating& gating, const F& f) {
  gating.clamps() ? with_activation<true>(gating.act, f) : with_activation<false>(gating.act, f);
}

struct ForwardKernels {
  const at::Tensor &g, &u;
  at::Tensor& h;
  float limit, alpha;
  template <typename T, bool kNativeBf16, bool kClamp, GatedActivation kAct>
  void avx512() const { forward_avx512<T, kNativeBf16, kClamp, kAct>(g, u, h, limit, alpha); }
  template <typename T, bool kClamp, GatedActivation kAct>
  void avx2() const { forward_avx2<T, kClamp, kAct>(g, u, h, limit, alpha); }
};

struct BackwardKernels {
  const at::Tensor &g, &u, &dh, &w;
  SwigluBackwardOut& out;
  float limit, alpha;
  template <typename T, bool kNativeBf16, bool kClamp, GatedActivation kAct>
  void avx512() const { backward_avx512<T, kNativeBf16, kClamp, kAct>(g, u, dh, w, out, limit, alpha); }
  template <typename T, bool kClamp, GatedActivation kAct>
  void avx2() const { backward_avx2<T, kClamp, kAct>(g, u, dh, w, out, limit, alpha); }
};

}  // namespace

GatedActivation parse_gated_activation(const std::string& activation) {
  if (activation == "silu") return GatedActivation::kSilu;
  if (activation == "gelu_tanh") return GatedActivation::kGeluTanh;
  if (activation == "swigluoai") return GatedActivation::kSwigluOai;
  TORCH_CHECK_VALUE(false, "kt.moe: activation must be 'silu' (SwiGLU), 'gelu_tanh' (GeGLU with GELU's tanh "
                    "approximation) or 'swigluoai' (gpt-oss's g·σ(α·g)·(u + 1)), got '", activation, "'");
}

void swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, CpuIsa isa, const Gating& gating) {
  const auto t = h.scalar_type();
  if (h.size(0) == 0 || h.size(1) == 0) return;
  if (t == at::kDouble || isa == CpuIsa::kPortable) {
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, t, "kt_swiglu_forward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      with_gating(gating, [&]<bool kClamp, GatedActivation kAct>() {
        forward_reference<scalar_t, acc_t, kClamp, kAct>(g, u, h, acc_t(gating.limit), acc_t(gating.alpha));
      });
    });
    return;
  }
  const ForwardKernels k{g, u, h, static_cast<float>(gating.limit), static_cast<float>(gating.alpha)};
  with_gating(gating, [&]<bool kClamp, GatedActivation kAct>() { dispatch_isa<kClamp, kAct>(k, t, isa); });
}

void swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, const Gating& gating) {
  swiglu_forward(g, u, h, active_cpu_isa(), gating);
}

void swiglu_backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                     SwigluBackwardOut& out, CpuIsa isa, const Gating& gating) {
  const auto t = g.scalar_type();
  const int64_t n = g.size(0);
  if (g.size(1) > 0 && n > 0) {
    if (t == at::kDouble || isa == CpuIsa::kPortable) {
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, t, "kt_swiglu_backward", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        with_gating(gating, [&]<bool kClamp, GatedActivation kAct>() {
          backward_reference<scalar_t, acc_t, kClamp, kAct>(g, u, dh, w, out, acc_t(gating.limit), acc_t(gating.alpha));
        });
      });
    } else {
      const BackwardKernels k{g, u, dh, w, out, static_cast<float>(gating.limit), static_cast<float>(gating.alpha)};
      with_gating(gating, [&]<bool kClamp, GatedActivation kAct>() { dispatch_isa<kClamp, kAct>(k, t, isa); });
    }
  } else if (out.dw.defined()) {
    out.dw.zero_();
  }
  zero_tail_rows(out, n);
}

void swiglu_backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                     SwigluBackwardOut& out, const Gating& gating) {
  swiglu_backward(g, u, dh, w, out, active_cpu_isa(), gating);
}

}  // namespace kt
