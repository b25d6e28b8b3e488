// kt.linear and its two gradient ops: nn.Linear's GEMMs on kt's base-GEMM paths (gemm/base_gemm.h), so
// that a model's bf16 layers outside the experts (attention, dense MLPs, the LM head) run at float32
// speed on CPUs without AVX512-BF16, from bf16 storage, as the experts do. ATen's own bf16 GEMMs there
// are a slow fallback: at x [512, 2048], W [2048, 2048] on 2 Zen 3 cores, F.linear took 213 ms, its
// input gradient g·W 14.6 s and its weight gradient 359 ms, against 34 / 38 / 42 ms here (fp32: 28 /
// 33 / 33). Where bf16 GEMMs are native (avx512_bf16), base_gemm takes oneDNN's; float32 and float64
// take ATen's. Schemas in registration.cpp, fakes in meta_kernels/linear.py, autograd in kt_ops/linear.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "gemm/base_gemm.h"

namespace kt {
namespace {

// Up to this many rows (decode), ATen's own bf16 x·Wᵀ streams W once and beats converting W into
// float32 panels (1 row x [8192, 2048], 2 Zen 3 threads: 8.0 ms against 12.8; 64 rows: 192 against 78).
// Only the forward layout: ATen's bf16 d·W (the input gradient) is slow at every size.
constexpr int64_t kAtenForwardMaxRows = 16;

// a and w on the CPU, of one floating dtype; w 2-d (a weight) unless w_is_weight is false.
void check_operands(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& w,
                    const char* w_name, bool w_is_weight = true) {
  TORCH_CHECK(a.device().is_cpu() && w.device().is_cpu(), "kt.", op, ": ", a_name, " and ", w_name,
              " must be CPU tensors, got ", a.device(), " and ", w.device());
  TORCH_CHECK(a.scalar_type() == w.scalar_type() && at::isFloatingType(a.scalar_type()), "kt.", op, ": ", a_name,
              " and ", w_name, " must have one floating dtype, got ", a.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(a.dim() >= 1 && (w_is_weight ? w.dim() == 2 : w.dim() >= 1), "kt.", op, ": ", w_name, " must be ",
              w_is_weight ? "2-d" : "at least 1-d", " and ", a_name, " at least 1-d, got ", w.sizes(), " and ",
              a.sizes());
}

// x [..., in], weight [out, in], bias [out] or none -> [..., out]
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_operands("linear", x, "x", weight, "weight");
  TORCH_CHECK(x.size(-1) == weight.size(1), "kt.linear: x's last dim (", x.size(-1), ") must equal weight's in ",
              "features (", weight.size(1), ")");
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor out = rows.size(0) <= kAtenForwardMaxRows ? at::mm(rows, weight.t())
                                                       : base_mm_nt(rows, weight.contiguous());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type(),
                "kt.linear: bias must be [", weight.size(0), "] of x's dtype, got ", bias->sizes(), " ",
                bias->scalar_type());
    out.add_(*bias);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  return out.view(shape);
}

// grad [..., out], weight [out, in] -> grad·weight [..., in]
at::Tensor linear_input_grad(const at::Tensor& grad, const at::Tensor& weight) {
  check_operands("linear_input_grad", grad, "grad", weight, "weight");
  TORCH_CHECK(grad.size(-1) == weight.size(0), "kt.linear_input_grad: grad's last dim (", grad.size(-1),
              ") must equal weight's out features (", weight.size(0), ")");
  at::Tensor out = base_mm_nn(grad.reshape({-1, grad.size(-1)}).contiguous(), weight.contiguous());
  std::vector<int64_t> shape(grad.sizes().begin(), grad.sizes().end());
  shape.back() = weight.size(1);
  return out.view(shape);
}

// grad [..., out], x [..., in] -> gradᵀ·x [out, in], summed over every leading index
at::Tensor linear_weight_grad(const at::Tensor& grad, const at::Tensor& x) {
  check_operands("linear_weight_grad", grad, "grad", x, "x", /*w_is_weight=*/false);
  TORCH_CHECK(grad.sizes().slice(0, grad.dim() - 1) == x.sizes().slice(0, x.dim() - 1),
              "kt.linear_weight_grad: grad and x must share their leading dims, got ", grad.sizes(), " and ",
              x.sizes());
  at::Tensor out = at::empty({grad.size(-1), x.size(-1)}, x.options());
  base_mm_tn_out(out, grad.reshape({-1, grad.size(-1)}).contiguous(), x.reshape({-1, x.size(-1)}).contiguous());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_input_grad", &linear_input_grad);
  m.impl("linear_weight_grad", &linear_weight_grad);
}

}  // namespace kt
