// The SIMD SwiGLU kernels of swiglu.cpp, written once for both vector widths: V is
// simd::F32x8 (AVX2) or simd::F32x16 (AVX-512), and swiglu.cpp includes this file once per
// path, each inside its own namespace, with KT_VEC_TARGET defined as that path's target
// attribute (GCC inlines an intrinsic only into a function of its target, so one template
// cannot serve both; see quant_gemv_int4-inl.h). No #pragma once for that reason. Each row's
// last I % lanes columns go through the reference loop's formula (swiglu.cpp).
// The clamps in vectors: min/max return their second operand where either is NaN, so the input
// goes second and NaN stays NaN; the ordered compares are false for NaN.
#ifndef KT_VEC_TARGET
#error "define KT_VEC_TARGET (the target attribute of the including path) before including swiglu-inl.h"
#endif

// float, or bf16 rounded to nearest even: with vcvtneps2bf16 where kNativeBf16 (AVX512-BF16),
// else with integer instructions.
template <class V, typename scalar_t, bool kNativeBf16>
KT_VEC_TARGET inline void store_values(scalar_t* p, typename V::Reg v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    V::store(p, v);
  } else if constexpr (kNativeBf16) {
    V::store_bf16_native(reinterpret_cast<uint16_t*>(p), v);
  } else {
    V::store_bf16(reinterpret_cast<uint16_t*>(p), v);
  }
}

// z and dz/dg of act(g) = g·σ(z) in vectors (act_arg / act_arg_slope of the reference).
template <class V, GatedActivation kAct>
KT_VEC_TARGET inline typename V::Reg act_arg(typename V::Reg g, typename V::Reg alpha) {
  if constexpr (kAct == GatedActivation::kSilu) return g;
  if constexpr (kAct == GatedActivation::kSwigluOai) return V::mul(alpha, g);
  const auto g2 = V::mul(g, g);
  return V::mul(V::mul(V::set1(float(kGeluK)), g), V::fmadd(V::set1(float(kGeluC)), g2, V::set1(1.f)));
}
template <class V, GatedActivation kAct>
KT_VEC_TARGET inline typename V::Reg act_arg_slope(typename V::Reg g, typename V::Reg alpha) {
  if constexpr (kAct == GatedActivation::kSilu) return V::set1(1.f);
  if constexpr (kAct == GatedActivation::kSwigluOai) return alpha;
  return V::fmadd(V::set1(float(3 * kGeluC * kGeluK)), V::mul(g, g), V::set1(float(kGeluK)));
}

template <class V, typename scalar_t, bool kNativeBf16, bool kClamp, GatedActivation kAct>
KT_VEC_TARGET void forward_simd(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, float limit, float alpha) {
  using Reg = typename V::Reg;
  constexpr int L = V::kLanes;
  const int64_t n = h.size(0), I = h.size(1), IL = I / L * L;
  const Reg hi = V::set1(limit), lo = V::set1(-limit), alpha_v = V::set1(alpha), one = V::set1(1.f);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* gr = g.const_data_ptr<scalar_t>() + i * g.stride(0);
    const scalar_t* ur = u.const_data_ptr<scalar_t>() + i * u.stride(0);
    scalar_t* hr = h.mutable_data_ptr<scalar_t>() + i * h.stride(0);
    for (int64_t j = 0; j < IL; j += L) {
      Reg gv = V::load_values(gr + j), uv = V::load_values(ur + j);
      if constexpr (kClamp) gv = V::min(hi, gv), uv = V::max(lo, V::min(hi, uv));
      if constexpr (kShiftsUp<kAct>) uv = V::add(uv, one);
      store_values<V, scalar_t, kNativeBf16>(hr + j, V::mul(V::mul(gv, V::sigmoid(act_arg<V, kAct>(gv, alpha_v))), uv));
    }
    forward_row_reference<scalar_t, float, kClamp, kAct>(gr, ur, hr, IL, I, limit, alpha);
  }
}

template <class V, typename scalar_t, bool kNativeBf16, bool kClamp, GatedActivation kAct>
KT_VEC_TARGET void backward_simd(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                                 SwigluBackwardOut& out, float limit, float alpha) {
  using Reg = typename V::Reg;
  constexpr int L = V::kLanes;
  const int64_t n = g.size(0), I = g.size(1), IL = I / L * L;
  const Reg hi = V::set1(limit), lo = V::set1(-limit), alpha_v = V::set1(alpha), one = V::set1(1.f);
  const float* wp = w.const_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* gr = g.const_data_ptr<scalar_t>() + i * g.stride(0);
    const scalar_t* ur = u.const_data_ptr<scalar_t>() + i * u.stride(0);
    const scalar_t* dhr = dh.const_data_ptr<scalar_t>() + i * dh.stride(0);
    scalar_t* dgr = row_ptr<scalar_t>(out.dg, i);
    scalar_t* dur = row_ptr<scalar_t>(out.du, i);
    scalar_t* hwr = row_ptr<scalar_t>(out.hw, i);
    const Reg wv = V::set1(wp[i]);
    Reg dw_v = V::zero();
    for (int64_t j = 0; j < IL; j += L) {
      const Reg g_in = V::load_values(gr + j), u_in = V::load_values(ur + j), dhu = V::load_values(dhr + j);
      const Reg gv = kClamp ? V::min(hi, g_in) : g_in;
      Reg uv = kClamp ? V::max(lo, V::min(hi, u_in)) : u_in;
      if constexpr (kShiftsUp<kAct>) uv = V::add(uv, one);
      const Reg sig = V::sigmoid(act_arg<V, kAct>(gv, alpha_v));
      const Reg silu = V::mul(gv, sig);
      const Reg hv = V::mul(silu, uv);
      const Reg dhv = V::mul(wv, dhu);
      dw_v = V::fmadd(dhu, hv, dw_v);
      Reg du = V::mul(dhv, silu);
      const Reg dsilu = V::fmadd(V::mul(silu, V::sub(one, sig)), act_arg_slope<V, kAct>(gv, alpha_v), sig);
      Reg dg = V::mul(V::mul(dhv, uv), dsilu);
      if constexpr (kClamp) {
        du = V::keep(V::both(V::ge(u_in, lo), V::le(u_in, hi)), du);
        dg = V::keep(V::le(g_in, hi), dg);
      }
      store_values<V, scalar_t, kNativeBf16>(dur + j, du);
      store_values<V, scalar_t, kNativeBf16>(dgr + j, dg);
      if (hwr) store_values<V, scalar_t, kNativeBf16>(hwr + j, V::mul(wv, hv));
    }
    const float dw = V::reduce_add(dw_v) + backward_row_reference<scalar_t, float, kClamp, kAct>(
                                               gr, ur, dhr, wp[i], dgr, dur, hwr, IL, I, limit, alpha);
    if (out.dw.defined()) out.dw.mutable_data_ptr<float>()[i] = dw;
  }
}
