// Ops that expose the instruction-set, weight-packing and buffer-cache switches (schemas in
// registration.cpp) and the fused kernels one by one (test-only: schemas in the fragment below).
// Tests use them to run every path on one machine.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "gemm/base_gemm.h"
#include "kernels/convert_rows.h"
#include "platform/cpu_isa.h"
#include "kernels/dequantize.h"
#include "platform/isa_peak.h"
#include "gemm/amx_gemm.h"
#include "kernels/dequantize_packed.h"
#include "kernels/expert_weights.h"
#include "kernels/quant_gemv.h"
#include "platform/large_alloc.h"
#include "ops/moe_checks.h"
#include "gemm/packed_layout.h"
#include "gemm/packed_weights.h"
#include "kernels/small_gemm.h"
#include "kernels/swiglu.h"
#include "kernels/thin_gemm.h"
#include "kernels/thin_gemm_nn.h"

namespace kt {
namespace {

std::string cpu_isa() { return cpu_isa_name(active_cpu_isa()); }

std::string best_isa() { return cpu_isa_name(best_cpu_isa()); }

void set_cpu_isa(const std::string& name) { set_active_cpu_isa(parse_cpu_isa(name, "isa")); }

std::string base_gemm_path_op(at::ScalarType dtype) { return base_gemm_path(dtype); }

// The path's multiply-add peak, FLOP/s of each of torch's intra-op threads, all running at once
// (their sum is the machine's peak at these threads).
std::vector<double> isa_peak_flops_op(const std::string& isa, int64_t iterations) {
  const CpuIsa path = parse_cpu_isa(isa, "isa");
  std::vector<double> rates(at::get_num_threads(), 0.0);
  at::parallel_for(0, static_cast<int64_t>(rates.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rates[t] = isa_peak_flops_one_thread(path, iterations);
  });
  return rates;
}

// src [rows, cols] (rows contiguous) bf16 -> float32 or float32 -> bf16 on one path.
at::Tensor convert_rows_op(const at::Tensor& src, at::ScalarType dtype, const std::string& isa) {
  TORCH_CHECK(src.dim() == 2 && src.stride(1) == 1, "_convert_rows: src must be 2-d with contiguous rows");
  const CpuIsa path = parse_cpu_isa(isa, "isa");
  at::Tensor dst = at::empty(src.sizes(), src.options().dtype(dtype));
  if (src.scalar_type() == at::kBFloat16 && dtype == at::kFloat) {
    bf16_rows_to_float(reinterpret_cast<const uint16_t*>(src.const_data_ptr()), src.stride(0),
                       dst.mutable_data_ptr<float>(), dst.stride(0), src.size(0), src.size(1), path);
  } else if (src.scalar_type() == at::kFloat && dtype == at::kBFloat16) {
    float_rows_to_bf16(src.const_data_ptr<float>(), src.stride(0), reinterpret_cast<uint16_t*>(dst.mutable_data_ptr()),
                       dst.stride(0), src.size(0), src.size(1), path);
  } else {
    TORCH_CHECK_VALUE(false, "_convert_rows: expected bfloat16 -> float32 or float32 -> bfloat16");
  }
  return dst;
}

at::Tensor panel_mm_tn_op(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty({a.size(1), b.size(1)}, a.options());
  panel_mm_tn_out(out, a, b);
  return out;
}

// One expert's quantized weight [N, K] (int4: [N, K/2]) and its scale (expert_weights.h).
WeightMatrix quantized_matrix(const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight_format_of(weight.scalar_type()) != WeightFormat::kDense,
                    "expected a 2-d float8_e4m3fn, int8 or uint8 (int4) weight");
  return expert_weights(weight.unsqueeze(0), scale.unsqueeze(0)).expert(0);
}

at::Tensor dequantize_op(const at::Tensor& weight, const at::Tensor& scale, const std::string& isa,
                         at::ScalarType dtype, int64_t col0, int64_t cols) {
  const WeightMatrix w = quantized_matrix(weight, scale);
  if (cols < 0) cols = w.cols - col0;
  TORCH_CHECK_VALUE(col0 >= 0 && col0 % kFp8Block == 0 && col0 + cols <= w.cols &&
                        ((col0 + cols) % kFp8Block == 0 || col0 + cols == w.cols),
                    "_dequantize: columns [col0, col0 + cols) must start at a multiple of 128 and end at one or at ",
                    "the last column, got col0=", col0, " cols=", cols, " of ", w.cols);
  const CpuIsa path = parse_cpu_isa(isa, "isa");
  at::Tensor out = at::empty({w.rows, cols}, weight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize_block(w, 0, w.rows, col0, cols, out.mutable_data_ptr<float>(), cols, path);
  } else {
    TORCH_CHECK_VALUE(dtype == at::kBFloat16, "_dequantize: dtype must be float32 or bfloat16, got ", dtype);
    dequantize_block(w, 0, w.rows, col0, cols, reinterpret_cast<uint16_t*>(out.mutable_data_ptr()), cols, path);
  }
  return out;
}

// Rows [start, start + count) of the weight (transposed: its columns, as wᵀ's rows) in oneDNN's
// packed layout, filled on a path: dense (to_dense, the values as oneDNN reads them) or, for
// timing, this thread's packed buffer itself (overwritten by the next call).
// The input dimension of rows [start, start + count) of w (or of wᵀ: transposed) as the packed kernels' operand,
// after checking those rows for `op`.
int64_t packed_operand_in(const WeightMatrix& w, bool transposed, int64_t start, int64_t count, const char* op) {
  TORCH_CHECK_VALUE(start >= 0 && count > 0 && start + count <= (transposed ? w.cols : w.rows), op,
                    ": rows [start, start + count) out of range");
  TORCH_CHECK_VALUE(start % (transposed ? kFp8Block : 16) == 0 && (!transposed || count % 32 == 0), op,
                    ": start must be a multiple of ", transposed ? kFp8Block : 16, transposed ? " and count of 32" : "");
  return transposed ? w.rows : w.cols;
}

at::Tensor dequantize_packed_op(const at::Tensor& weight, const at::Tensor& scale, bool transposed, int64_t start,
                                int64_t count, const std::string& isa, bool dense) {
  const WeightMatrix w = quantized_matrix(weight, scale);
  const CpuIsa path = parse_cpu_isa(isa, "isa");
  const int64_t out = count, in = packed_operand_in(w, transposed, start, count, "_dequantize_packed");
  const PackedBf16Layout* layout = packed_bf16_layout(out, in);
  TORCH_CHECK_VALUE(layout != nullptr, "_dequantize_packed: no packed layout known for [", out, ", ", in,
                    "] on this path");
  const at::Tensor& packed = thread_packed_weight(out, in);
  if (transposed) {
    dequantize_packed_cols(w, start, *layout, packed_bf16_data(packed), path);
  } else {
    dequantize_packed_rows(w, start, *layout, packed_bf16_data(packed), path);
  }
  return dense ? packed.to_dense() : packed;
}

// The same kernels into a plain buffer in a given layout of the family (out_block, in_block), without oneDNN:
// what tests use to check the kernels on every layout, and on CPUs whose oneDNN cannot pack bf16 (the AVX-512
// emulation). Returns the buffer [out * in] in layout order.
at::Tensor dequantize_into_layout_op(const at::Tensor& weight, const at::Tensor& scale, bool transposed,
                                     int64_t start, int64_t count, int64_t out_block, int64_t in_block,
                                     const std::string& isa) {
  const WeightMatrix w = quantized_matrix(weight, scale);
  const CpuIsa path = parse_cpu_isa(isa, "isa");
  const int64_t out = count, in = packed_operand_in(w, transposed, start, count, "_dequantize_into_layout");
  TORCH_CHECK_VALUE(out_block % 16 == 0 && out % out_block == 0 && in_block % 32 == 0 && in % in_block == 0,
                    "_dequantize_into_layout: out_block must be a multiple of 16 dividing ", out,
                    " and in_block one of 32 dividing ", in, ", got ", out_block, " and ", in_block);
  const PackedBf16Layout layout{out, in, out_block, in_block};
  at::Tensor dst = at::empty({out * in}, weight.options().dtype(at::kBFloat16));
  auto* data = reinterpret_cast<uint16_t*>(dst.mutable_data_ptr());
  if (transposed) {
    dequantize_packed_cols(w, start, layout, data, path);
  } else {
    dequantize_packed_rows(w, start, layout, data, path);
  }
  return dst;
}

std::vector<int64_t> packed_layout_op(int64_t out, int64_t in) {
  const PackedBf16Layout* l = packed_bf16_layout(out, in);
  if (l == nullptr) return {};
  return {l->out_block, l->in_block};
}

std::string quant_gemm_path_op(at::ScalarType dtype) { return quantized_gemm_path(dtype); }

at::Tensor quant_gemv_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const std::string& isa) {
  return quant_gemv_nt(x, quantized_matrix(weight, scale), parse_cpu_isa(isa, "isa"));
}

std::tuple<at::Tensor, bool> quant_gemv_int4_vnni_op(const at::Tensor& x, const at::Tensor& weight,
                                                      const at::Tensor& scale) {
  return quant_gemv_int4_vnni(x, quantized_matrix(weight, scale));
}

std::tuple<at::Tensor, bool> quant_gemv_int16_op(const at::Tensor& x, const at::Tensor& weight,
                                                 const at::Tensor& scale) {
  return quant_gemv_int16_avx2(x, quantized_matrix(weight, scale));
}

at::Tensor quant_mm_nt_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  return panel_mm_nt(x, quantized_matrix(weight, scale));
}

at::Tensor quant_mm_nn_op(const at::Tensor& d, const at::Tensor& weight, const at::Tensor& scale,
                          const std::optional<at::Tensor>& addend) {
  return panel_mm_nn(d, quantized_matrix(weight, scale), addend);
}

// One expert's weight [N, K] in any format base_gemm.h takes: dense (no scale) or quantized.
WeightMatrix any_matrix(const at::Tensor& weight, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK_VALUE(weight.dim() == 2, "expected a 2-d weight, got ", weight.sizes());
  if (weight_format_of(weight.scalar_type()) != WeightFormat::kDense) {
    TORCH_CHECK_VALUE(scale.has_value(), "a quantized weight needs its scale");
    return quantized_matrix(weight, *scale);
  }
  return expert_weights(weight.unsqueeze(0), std::nullopt).expert(0);
}

// d·w (+ addend) by thin_gemm_nn on one path ("portable": the reference loop).
at::Tensor thin_gemm_nn_op(const at::Tensor& d, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                           const std::string& isa, const std::optional<at::Tensor>& addend) {
  return thin_gemm_nn(d, any_matrix(weight, scale), addend, parse_cpu_isa(isa, "isa"));
}

// d·w (+ addend) as kt.moe's backward computes it on the active path (base_gemm.h's choice).
at::Tensor base_mm_nn_op(const at::Tensor& d, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                         const std::optional<at::Tensor>& addend) {
  const WeightMatrix w = any_matrix(weight, scale);
  if (!addend.has_value()) return base_mm_nn(d, w);
  at::Tensor out = addend->clone();
  base_addmm_nn_(out, d, w);
  return out;
}

bool thin_gemm_nn_taken_op(const at::Tensor& d, const at::Tensor& weight, const std::optional<at::Tensor>& scale) {
  return takes_thin_gemm_nn(d, any_matrix(weight, scale));
}

at::Tensor panel_mm_nt_op(const at::Tensor& x, const at::Tensor& w) { return panel_mm_nt(x, w); }

at::Tensor panel_mm_nn_op(const at::Tensor& d, const at::Tensor& w, const std::optional<at::Tensor>& addend) {
  return panel_mm_nn(d, w, addend);
}

at::Tensor small_gemm_op(const std::optional<at::Tensor>& c, const at::Tensor& a, const at::Tensor& b,
                         double alpha, at::ScalarType out_dtype, const std::string& isa) {
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype));
  small_gemm(out, c, a, b, alpha, parse_cpu_isa(isa, "isa"));
  return out;
}

at::Tensor thin_gemm_op(const at::Tensor& x, const at::Tensor& w, at::ScalarType out_dtype, const std::string& isa) {
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options().dtype(out_dtype));
  thin_gemm_nt(out, x, w, parse_cpu_isa(isa, "isa"));
  return out;
}

at::Tensor swiglu_forward_op(const at::Tensor& g, const at::Tensor& u, const std::string& isa,
                             std::optional<double> limit, const std::string& activation, std::optional<double> alpha) {
  at::Tensor h = at::empty_like(g);
  swiglu_forward(g, u, h, parse_cpu_isa(isa, "isa"), checked_gating(limit, activation, alpha));
  return h;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> swiglu_backward_op(
    const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w, bool need_hw,
    bool need_dw, const std::string& isa, std::optional<double> limit, const std::string& activation,
    std::optional<double> alpha) {
  const int64_t p = dh.size(0), I = dh.size(1);
  SwigluBackwardOut out;
  out.dg = at::empty({p, I}, dh.options());
  out.du = at::empty({p, I}, dh.options());
  out.hw = need_hw ? at::empty({p, I}, dh.options()) : at::Tensor();
  out.dw = need_dw ? at::empty({g.size(0)}, w.options()) : at::Tensor();
  swiglu_backward(g, u, dh, w, out, parse_cpu_isa(isa, "isa"), checked_gating(limit, activation, alpha));
  auto none = [&] { return at::empty({0}, dh.options()); };
  return {out.dg, out.du, need_hw ? out.hw : none(), need_dw ? out.dw : none()};
}

}  // namespace

// Schemas of the test-only ops, a fragment of the kt library of registration.cpp.
TORCH_LIBRARY_FRAGMENT(kt, m) {
  // The fused kernels on their own, with an explicit path, so that tests compare every path
  // with the reference loop (the kernels below). Not part of the API.
  m.def("_isa_peak_flops(str isa, int iterations) -> float[]");
  m.def("_small_gemm(Tensor? c, Tensor a, Tensor b, float alpha, ScalarType out_dtype, str isa) -> Tensor");
  m.def("_thin_gemm_nt(Tensor x, Tensor w, ScalarType out_dtype, str isa) -> Tensor");
  m.def("_swiglu_forward(Tensor g, Tensor u, str isa, float? limit=None, str activation=\"silu\", "
        "float? alpha=None) -> Tensor");
  // The bf16-to-float32 panel GEMMs of base_gemm.h (x·wᵀ, d·w [+ addend], aᵀ·b).
  m.def("_panel_mm_nt(Tensor x, Tensor w) -> Tensor");
  m.def("_panel_mm_nn(Tensor d, Tensor w, Tensor? addend) -> Tensor");
  m.def("_panel_mm_tn(Tensor a, Tensor b) -> Tensor");
  m.def("_convert_rows(Tensor src, ScalarType dtype, str isa) -> Tensor");
  // One expert's quantized weight (csrc/kernels/expert_weights.h) dequantized to float32 or bf16
  // on a path (columns [col0, col0 + cols), all of them for cols = -1), its decode GEMV on a
  // path, its panel GEMMs x·wᵀ, d·w [+ addend] (active path), and the route those take.
  m.def("_dequantize(Tensor weight, Tensor scale, str isa, ScalarType dtype=float, int col0=0, int cols=-1) -> Tensor");
  // The same into oneDNN's packed bf16 layout (rows [start, start + count), or wᵀ's rows for
  // transposed), and that layout's (out_block, in_block) for a [out_features, in_features] weight ([] if none).
  m.def("_dequantize_packed(Tensor weight, Tensor scale, bool transposed, int start, int count, str isa, "
        "bool dense=True) -> Tensor");
  m.def("_packed_layout(int out_features, int in_features) -> int[]");
  // The same kernels into a plain buffer in a given layout of that family, without oneDNN.
  m.def("_dequantize_into_layout(Tensor weight, Tensor scale, bool transposed, int start, int count, "
        "int out_block, int in_block, str isa) -> Tensor");
  m.def("_quant_gemm_path(ScalarType dtype) -> str");
  m.def("_quant_gemv_nt(Tensor x, Tensor weight, Tensor scale, str isa) -> Tensor");
  // The avx2 integer-dot-product decode kernel alone (float32 x holding bf16 values): its float32
  // output and whether it ran (quant_gemv.h).
  m.def("_quant_gemv_int16(Tensor x, Tensor weight, Tensor scale) -> (Tensor, bool)");
  // The avx512_bf16 path's VNNI decode kernel for bf16 x on int4 weights alone: the same.
  m.def("_quant_gemv_int4_vnni(Tensor x, Tensor weight, Tensor scale) -> (Tensor, bool)");
  m.def("_quant_mm_nt(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("_quant_mm_nn(Tensor d, Tensor weight, Tensor scale, Tensor? addend) -> Tensor");
  // Backward's decode-sized d·w [+ addend] on bf16 or quantized weights on a path
  // (thin_gemm_nn.h), and d·w [+ addend] as kt.moe's backward routes it on the active path.
  m.def("_thin_gemm_nn(Tensor d, Tensor weight, Tensor? scale, str isa, Tensor? addend) -> Tensor");
  m.def("_base_mm_nn(Tensor d, Tensor weight, Tensor? scale, Tensor? addend) -> Tensor");
  m.def("_thin_gemm_nn_taken(Tensor d, Tensor weight, Tensor? scale) -> bool");
  m.def(
      "_swiglu_backward(Tensor g, Tensor u, Tensor dh, Tensor w, bool need_hw, bool need_dw, str isa, "
      "float? limit=None, str activation=\"silu\", float? alpha=None) "
      "-> (Tensor dg, Tensor du, Tensor hw, Tensor dw)");
}

TORCH_LIBRARY_IMPL(kt, CompositeExplicitAutograd, m) {
  m.impl("_cpu_isa", &cpu_isa);
  m.impl("_best_cpu_isa", &best_isa);
  m.impl("_set_cpu_isa", &set_cpu_isa);
  m.impl("_base_gemm_path", &base_gemm_path_op);
  m.impl("_isa_peak_flops", &isa_peak_flops_op);
  m.impl("_quant_gemm_path", &quant_gemm_path_op);
  m.impl("_set_weight_packing", &set_weight_packing);
  m.impl("_set_amx", &set_amx_enabled);
  m.impl("_amx_available", &amx_bf16_available);
  m.impl("_amx_supported", &amx_bf16_supported);
  m.impl("_weight_packing_enabled", &weight_packing_enabled);
  m.impl("_packed_weights_info", &packed_weights_info);
  m.impl("_packed_layout", &packed_layout_op);
  m.impl("_release_packed_weights", &release_packed_weights);
  m.impl("_cached_buffers_info", &cached_buffers_info);
  m.impl("_release_cached_buffers", &release_cached_buffers);
}

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("_small_gemm", &small_gemm_op);
  m.impl("_thin_gemm_nt", &thin_gemm_op);
  m.impl("_swiglu_forward", &swiglu_forward_op);
  m.impl("_swiglu_backward", &swiglu_backward_op);
  m.impl("_panel_mm_nt", &panel_mm_nt_op);
  m.impl("_panel_mm_nn", &panel_mm_nn_op);
  m.impl("_dequantize", &dequantize_op);
  m.impl("_dequantize_packed", &dequantize_packed_op);
  m.impl("_dequantize_into_layout", &dequantize_into_layout_op);
  m.impl("_quant_gemv_nt", &quant_gemv_op);
  m.impl("_quant_gemv_int16", &quant_gemv_int16_op);
  m.impl("_quant_gemv_int4_vnni", &quant_gemv_int4_vnni_op);
  m.impl("_quant_mm_nt", &quant_mm_nt_op);
  m.impl("_quant_mm_nn", &quant_mm_nn_op);
  m.impl("_thin_gemm_nn", &thin_gemm_nn_op);
  m.impl("_base_mm_nn", &base_mm_nn_op);
  m.impl("_thin_gemm_nn_taken", &thin_gemm_nn_taken_op);
  m.impl("_panel_mm_tn", &panel_mm_tn_op);
  m.impl("_convert_rows", &convert_rows_op);
}

}  // namespace kt
