// Kernels of swiglu.h: the reference loops (any floating dtype), then float32/bfloat16
// kernels per instruction set. The SIMD kernels (one body, swiglu-inl.h) do 16 (AVX-512) or 8
// (AVX2) elements per step and finish each row with the reference loop's formula.
#include "kernels/swiglu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <cmath>
#include <type_traits>

#include "platform/vec.h"

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

// ---- SIMD: one body for both vector widths (swiglu-inl.h), for float and bfloat16 ----------

// The AVX-512 kernels are compiled with the AVX512-BF16 target so that one body serves both
// AVX-512 paths; kNativeBf16 = false never emits a BF16 instruction, so it runs on any AVX-512
// CPU.
namespace width16 {
#define KT_VEC_TARGET KT_TARGET_AVX512_BF16
#include "kernels/swiglu-inl.h"
#undef KT_VEC_TARGET
}  // namespace width16

namespace width8 {
#define KT_VEC_TARGET KT_TARGET_AVX2
#include "kernels/swiglu-inl.h"
#undef KT_VEC_TARGET
}  // namespace width8

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
  void avx512() const { width16::forward_simd<simd::F32x16, T, kNativeBf16, kClamp, kAct>(g, u, h, limit, alpha); }
  template <typename T, bool kClamp, GatedActivation kAct>
  void avx2() const { width8::forward_simd<simd::F32x8, T, false, kClamp, kAct>(g, u, h, limit, alpha); }
};

struct BackwardKernels {
  const at::Tensor &g, &u, &dh, &w;
  SwigluBackwardOut& out;
  float limit, alpha;
  template <typename T, bool kNativeBf16, bool kClamp, GatedActivation kAct>
  void avx512() const {
    width16::backward_simd<simd::F32x16, T, kNativeBf16, kClamp, kAct>(g, u, dh, w, out, limit, alpha);
  }
  template <typename T, bool kClamp, GatedActivation kAct>
  void avx2() const { width8::backward_simd<simd::F32x8, T, false, kClamp, kAct>(g, u, dh, w, out, limit, alpha); }
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
