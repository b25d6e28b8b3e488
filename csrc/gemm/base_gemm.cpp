#include "gemm/base_gemm.h"

#include <algorithm>
#include <initializer_list>

#include "gemm/amx_gemm.h"
#include "kernels/convert_rows.h"
#include "kernels/dequantize.h"
#include "kernels/dequantize_packed.h"
#include "gemm/packed_layout.h"
#include "gemm/packed_weights.h"
#include "kernels/quant_gemv.h"
#include "kernels/thin_gemm_nn.h"
#include "kernels/thin_gemm.h"

namespace kt {
namespace {

// Weight values converted per panel: 128 Ki floats (512 KiB) stay in L2 on the CPUs we target
// while ATen's GEMM packs them, and cost a few dozen µs of conversion per panel against a
// GEMM of hundreds of µs on a 64-row block.
constexpr int64_t kPanelValues = 128 * 1024;

// Rows of a [rows, row_len] panel: a multiple of 16 (GEMM tiles), at least 16, at most total.
int64_t panel_rows(int64_t row_len, int64_t total) {
  const int64_t rows = std::max<int64_t>(16, kPanelValues / std::max<int64_t>(row_len, 1) / 16 * 16);
  return std::min(rows, total);
}

// The dtype the panel path computes in: float64 for float64, float32 otherwise.
at::ScalarType work_type(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// dst = src (2-d, same shape): our conversion kernels for bf16 <-> float32 with contiguous
// rows (ATen's copy_ sets up a TensorIterator for every panel), ATen's copy_ for everything
// else.
void copy_rows(at::Tensor dst, const at::Tensor& src) {
  const bool rows_contiguous = (dst.size(1) <= 1 || dst.stride(1) == 1) && (src.size(1) <= 1 || src.stride(1) == 1);
  const auto from = src.scalar_type(), to = dst.scalar_type();
  if (rows_contiguous && from == at::kBFloat16 && to == at::kFloat) {
    bf16_rows_to_float(reinterpret_cast<const uint16_t*>(src.const_data_ptr()), src.stride(0),
                       dst.mutable_data_ptr<float>(), dst.stride(0), dst.size(0), dst.size(1), active_cpu_isa());
  } else if (rows_contiguous && from == at::kFloat && to == at::kBFloat16) {
    float_rows_to_bf16(src.const_data_ptr<float>(), src.stride(0), reinterpret_cast<uint16_t*>(dst.mutable_data_ptr()),
                       dst.stride(0), dst.size(0), dst.size(1), active_cpu_isa());
  } else {
    dst.copy_(src);
  }
}

// src in the work dtype, contiguous (src itself when it already is).
at::Tensor to_work(const at::Tensor& src, at::ScalarType work) {
  if (src.scalar_type() == work && src.is_contiguous()) return src;
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(work));
  copy_rows(out, src);
  return out;
}

// panel = rows [n0, n0 + rows) of w in the panel's dtype (float32, or float64).
void fill_panel(at::Tensor& panel, const WeightMatrix& w, int64_t n0, int64_t rows) {
  if (!w.quantized()) return copy_rows(panel, w.data.narrow(0, n0, rows));
  if (panel.scalar_type() == at::kFloat) {
    return dequantize_rows(w, n0, rows, panel.mutable_data_ptr<float>(), panel.stride(0), active_cpu_isa());
  }
  at::Tensor f = at::empty({rows, w.cols}, panel.options().dtype(at::kFloat));
  dequantize_rows(w, n0, rows, f.mutable_data_ptr<float>(), f.stride(0), active_cpu_isa());
  panel.copy_(f);
}

// ---- quantized weights, bf16 activations, native bf16 GEMMs (the avx512_bf16 path) -----------
//
// oneDNN's bf16 GEMMs run 2.3-2.5x ATen's float32 ones there (AVX512-BF16 Zen 4, one thread,
// [64, 2048] x [2048, 1536]; more with AMX), so float32 panels would make quantized experts 2-3x
// slower than bf16 ones at training sizes. The weights are dequantized into bf16 panels instead
// (each float32 value q·s rounded to nearest even: the weight a bf16 expert would hold) and
// multiplied by oneDNN with float32 accumulation, every output element in one GEMM call (one
// rounding). Panels of 1 Mi values (2 MiB), of equal size: oneDNN on 64-row panels (128 Ki
// values) ran 1.3-2x slower than on the whole matrix, on 256-row ones 5-15% slower, and 1 Mi
// panels made kt.moe's quantized forward 3-10% faster than 512 Ki ones (Zen 4, Qwen3 shapes).
//
// Where oneDNN's packed layout of the panel shapes is known (packed_layout.h: probed; on Zen 4
// every multiple-of-64 expert shape), the panels are dequantized straight into it
// (dequantize_packed.h) and multiplied with mkldnn's linear on the packed weight, which skips
// the re-pack at::mm does on every plain panel: kt.moe's LoRA step at T=1024 ran 5-7% faster
// (fp8, int8; Qwen3-30B-A3B, Zen 4, 2 threads). Plain panels remain for other shapes.
constexpr int64_t kBf16PanelValues = 1024 * 1024;

// Activations of this dtype take bf16 panels on quantized weights (quantized_gemm_path).
bool bf16_panels_for(at::ScalarType activations) { return activations == at::kBFloat16 && native_bf16_gemms(); }

bool native_bf16_panels(const at::Tensor& activations, const WeightMatrix& w) {
  return w.quantized() && bf16_panels_for(activations.scalar_type());
}

uint16_t* bf16_data(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.mutable_data_ptr()); }

// Panel width for `total` rows or columns of which at most `most` fit a panel: equal panels,
// each a multiple of `unit` (a last panel of a few rows ran oneDNN at a fraction of its rate).
int64_t even_panels(int64_t total, int64_t most, int64_t unit) {
  most = std::max(unit, most / unit * unit);
  const int64_t panels = (total + most - 1) / most;
  return std::min(total, ((total + panels - 1) / panels + unit - 1) / unit * unit);
}

// Panels dequantized into oneDNN's packed layout (packed_layout.h) hold 1 Mi values (2 MiB).
// On Zen 4, 256 Ki, 512 Ki and 1 Mi ran within noise of each other; on Zen 5 (1 MiB of L2),
// kt.moe's quantized LoRA step at T=1024 ran 4-8% faster on 1 Mi than on 512 Ki, 2 Mi between
// them (Qwen3-30B-A3B, 2 threads, two alternating runs).
constexpr int64_t kPackedPanelValues = 1024 * 1024;

// True when oneDNN's packed layout is known for the panels of [total, len] cut `width` at a
// time (the last one may be narrower).
bool packed_panels(int64_t total, int64_t width, int64_t len) {
  return packed_bf16_layout(width, len) != nullptr &&
         (total % width == 0 || packed_bf16_layout(total % width, len) != nullptr);
}

// The rows per packed panel of x·wᵀ on w [N, K], or 0 where packed panels are not taken.
int64_t packed_rows_for(int64_t N, int64_t K) {
  const int64_t nc = even_panels(N, kPackedPanelValues / std::max<int64_t>(K, 1), 64);
  return packed_panels(N, nc, K) ? nc : 0;
}

// The columns per packed panel of d·w on w [N, K] (N: all stacked weights' rows), widths a
// multiple of 128 (whole fp8 blocks and int4 groups), or 0 where packed panels are not taken.
int64_t packed_cols_for(int64_t N, int64_t K) {
  if (K % 32 != 0) return 0;
  const int64_t kc = even_panels(K, kPackedPanelValues / N, kFp8Block);
  return packed_panels(K, kc, N) ? kc : 0;
}

// [M, total]: `multiply(packed, p0, n)` for each packed panel of outputs [p0, p0 + n) (n =
// width but for the last), the panel [n, len] filled by `fill(p0, layout, values)` first.
template <typename Fill, typename Multiply>
at::Tensor over_packed_panels(int64_t M, int64_t total, int64_t width, int64_t len, const at::TensorOptions& options,
                              const Fill& fill, const Multiply& multiply) {
  at::Tensor out;
  for (int64_t p0 = 0; p0 < total; p0 += width) {
    const int64_t n = std::min(width, total - p0);
    const at::Tensor& p = thread_packed_weight(n, len);
    fill(p0, *packed_bf16_layout(n, len), packed_bf16_data(p));
    at::Tensor r = multiply(p, p0, n);
    if (n == total) return r;
    if (!out.defined()) out = at::empty({M, total}, options);
    out.narrow(1, p0, n).copy_(r);
  }
  return out;
}

// x·wᵀ over packed panels of w's rows.
at::Tensor packed_mm_nt(const at::Tensor& x_in, const WeightMatrix& w, int64_t nc) {
  const at::Tensor x = x_in.contiguous();
  return over_packed_panels(
      x.size(0), w.rows, nc, w.cols, x.options(),
      [&](int64_t n0, const PackedBf16Layout& l, uint16_t* v) { dequantize_packed_rows(w, n0, l, v, active_cpu_isa()); },
      [&](const at::Tensor& p, int64_t, int64_t) { return packed_linear(x, p); });
}

// addend + d·[w0; w1; ...] over packed panels of the weights' columns (the stacked wᵀ's rows):
// each weight's rows are the panel's next input columns.
at::Tensor packed_mm_nn(const at::Tensor& d_in, std::initializer_list<const WeightMatrix*> stacked,
                        const std::optional<at::Tensor>& addend, int64_t kc) {
  const at::Tensor d = d_in.contiguous();
  const int64_t K = (*stacked.begin())->cols;
  return over_packed_panels(
      d.size(0), K, kc, d.size(1), d.options(),
      [&](int64_t k0, const PackedBf16Layout& l, uint16_t* v) {
        int64_t in0 = 0;
        for (const WeightMatrix* w : stacked) {
          dequantize_packed_cols(*w, k0, l, v, active_cpu_isa(), in0);
          in0 += w->rows;
        }
      },
      [&](const at::Tensor& p, int64_t k0, int64_t cols) {
        return addend.has_value()
                   ? packed_linear_add(d, p, addend->narrow(1, k0, cols).to(d.scalar_type()).contiguous())
                   : packed_linear(d, p);
      });
}

// x·wᵀ over panels of w's rows (whole rows: each output column in one GEMM).
at::Tensor native_mm_nt(const at::Tensor& x, const WeightMatrix& w) {
  const int64_t M = x.size(0), N = w.rows, K = w.cols;
  if (amx_takes_mm_nt(x, w)) return amx_mm_nt(x, w);
  if (const int64_t packed_rows = packed_rows_for(N, K)) return packed_mm_nt(x, w, packed_rows);
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t nc = even_panels(N, kBf16PanelValues / std::max<int64_t>(K, 1), 16);
  at::Tensor panel = at::empty({nc, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += nc) {
    const int64_t rows = std::min(nc, N - n0);
    at::Tensor p = panel.narrow(0, 0, rows);
    dequantize_block(w, n0, rows, 0, K, bf16_data(p), K, active_cpu_isa());
    out.narrow(1, n0, rows).copy_(at::mm(x, p.t()));
  }
  return out;
}

// addend + d·w over panels of w's columns (all N rows: each output element's whole sum over N
// in one GEMM), widths a multiple of 128 (whole fp8 blocks and int4 groups).
at::Tensor native_mm_nn(const at::Tensor& d, const WeightMatrix& w, const std::optional<at::Tensor>& addend) {
  const int64_t M = d.size(0), N = w.rows, K = w.cols;
  if (amx_takes_mm_nn(d, {&w})) return amx_mm_nn(d, {&w}, addend);
  if (const int64_t packed_cols = packed_cols_for(N, K)) return packed_mm_nn(d, {&w}, addend, packed_cols);
  at::Tensor out = at::empty({M, K}, d.options());
  const int64_t kc = even_panels(K, kBf16PanelValues / N, kFp8Block);
  at::Tensor buffer = at::empty({N * kc}, d.options());
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t cols = std::min(kc, K - k0);
    at::Tensor p = buffer.narrow(0, 0, N * cols).view({N, cols});
    dequantize_block(w, 0, N, k0, cols, bf16_data(p), cols, active_cpu_isa());
    out.narrow(1, k0, cols).copy_(addend.has_value() ? at::addmm(addend->narrow(1, k0, cols).to(d.scalar_type()), d, p)
                                                     : at::mm(d, p));
  }
  return out;
}

// fn(n0, rows, panel) for each panel of w's rows [n0, n0 + rows), panel = those rows in the
// work dtype ([rows, K] contiguous, one buffer reused for every panel).
template <typename Fn>
void for_each_weight_panel(const WeightMatrix& w, const at::TensorOptions& options, at::ScalarType work, const Fn& fn) {
  const int64_t N = w.rows, K = w.cols;
  const int64_t nc = panel_rows(K, N);
  at::Tensor panel = at::empty({nc, K}, options.dtype(work));
  for (int64_t n0 = 0; n0 < N; n0 += nc) {
    const int64_t rows = std::min(nc, N - n0);
    at::Tensor p = panel.narrow(0, 0, rows);
    fill_panel(p, w, n0, rows);
    fn(n0, rows, p);
  }
}

WeightMatrix dense(const at::Tensor& w) {
  WeightMatrix m;
  m.data = w;
  m.rows = w.size(0);
  m.cols = w.size(1);
  return m;
}

bool converts(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 && !native_bf16_gemms(); }

void check_2d(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2, "base GEMM: ", what, " must be 2-d, got ", t.dim(), "-d");
}

}  // namespace


const char* base_gemm_path(at::ScalarType dtype) {
  if (dtype != at::kBFloat16) return "mkl";
  return native_bf16_gemms() ? "onednn_bf16" : "bf16_to_fp32_panels";
}

const char* quantized_gemm_path(at::ScalarType dtype) {
  if (dtype == at::kDouble) return "fp64_panels_mkl";
  if (!bf16_panels_for(dtype)) return "fp32_panels_mkl";
  return amx_bf16_available() ? "bf16_strips_amx" : "bf16_panels_onednn";  // AMX: shapes of 32-row strips
}

at::Tensor stacked_mm_nn(const at::Tensor& d, const WeightMatrix& a, const WeightMatrix& b) {
  const int64_t N = a.rows + b.rows, K = a.cols;
  if (d.size(0) == 0 || !native_bf16_panels(d, a) || !b.quantized() || b.cols != K || a.rows % 2 != 0 ||
      d.size(1) != N) {
    return {};
  }
  if (amx_takes_mm_nn(d, {&a, &b})) return amx_mm_nn(d, {&a, &b}, std::nullopt);
  const int64_t kc = packed_cols_for(N, K);
  return kc ? packed_mm_nn(d, {&a, &b}, std::nullopt, kc) : at::Tensor();
}

at::Tensor panel_mm_nt(const at::Tensor& x, const at::Tensor& w) {
  check_2d(w, "w");
  return panel_mm_nt(x, dense(w));
}

at::Tensor panel_mm_nt(const at::Tensor& x, const WeightMatrix& w) {
  check_2d(x, "x");
  TORCH_CHECK(x.size(1) == w.cols, "panel_mm_nt: x [M, K] and w [N, K] disagree on K");
  const int64_t M = x.size(0), N = w.rows;
  if (M > 0 && N > 0 && native_bf16_panels(x, w)) return native_mm_nt(x, w);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::ScalarType work = work_type(x);
  const at::Tensor x_w = to_work(x, work);
  for_each_weight_panel(w, x.options(), work, [&](int64_t n0, int64_t rows, const at::Tensor& p) {
    copy_rows(out.narrow(1, n0, rows), at::mm(x_w, p.t()));  // [M, rows], rounded once
  });
  return out;
}

at::Tensor panel_mm_nn(const at::Tensor& d, const at::Tensor& w, const std::optional<at::Tensor>& addend) {
  check_2d(w, "w");
  return panel_mm_nn(d, dense(w), addend);
}

at::Tensor panel_mm_nn(const at::Tensor& d, const WeightMatrix& w, const std::optional<at::Tensor>& addend) {
  check_2d(d, "d");
  TORCH_CHECK(d.size(1) == w.rows, "panel_mm_nn: d [M, N] and w [N, K] disagree on N");
  const int64_t M = d.size(0), N = d.size(1), K = w.cols;
  if (M > 0 && N > 0 && K > 0 && native_bf16_panels(d, w)) return native_mm_nn(d, w, addend);
  const at::ScalarType work = work_type(d);
  // The float accumulator of the whole result; each panel of w's rows adds its share.
  at::Tensor acc = at::empty({M, K}, d.options().dtype(work));
  if (addend.has_value()) {
    copy_rows(acc, *addend);
  } else {
    acc.zero_();
  }
  at::Tensor out = at::empty({M, K}, d.options());
  if (M == 0 || N == 0 || K == 0) {
    copy_rows(out, acc);
    return out;
  }
  const at::Tensor d_w = to_work(d, work);
  for_each_weight_panel(w, d.options(), work, [&](int64_t n0, int64_t rows, const at::Tensor& p) {
    acc.addmm_(d_w.narrow(1, n0, rows), p);
  });
  copy_rows(out, acc);
  return out;
}

void panel_mm_tn_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  check_2d(a, "a");
  check_2d(b, "b");
  TORCH_CHECK(a.size(0) == b.size(0) && out.dim() == 2 && out.size(0) == a.size(1) && out.size(1) == b.size(1),
              "panel_mm_tn_out: expected a [M, N], b [M, K], out [N, K]");
  const int64_t N = a.size(1), K = b.size(1);
  if (N == 0 || K == 0) return;
  const at::ScalarType work = work_type(a);
  // a and b are activations (a block's rows): converted whole. The result goes out in row
  // panels, each computed in float and rounded once.
  const at::Tensor a_w = to_work(a, work), b_w = to_work(b, work);
  const int64_t nr = panel_rows(K, N);
  at::Tensor tile = at::empty({nr, K}, a.options().dtype(work));
  for (int64_t n0 = 0; n0 < N; n0 += nr) {
    const int64_t rows = std::min(nr, N - n0);
    at::Tensor t = tile.narrow(0, 0, rows);
    at::mm_out(t, a_w.narrow(1, n0, rows).t(), b_w);
    copy_rows(out.narrow(0, n0, rows), t);
  }
}

at::Tensor base_mm_nt(const at::Tensor& x, const at::Tensor& w) {
  return converts(x) ? panel_mm_nt(x, w) : at::mm(x, w.t());
}

at::Tensor base_mm_nn(const at::Tensor& d, const at::Tensor& w) {
  return converts(d) ? panel_mm_nn(d, w, std::nullopt) : at::mm(d, w);
}

void base_addmm_nn_(at::Tensor& out, const at::Tensor& d, const at::Tensor& w) {
  if (converts(d)) {
    out.copy_(panel_mm_nn(d, w, out));
  } else {
    out.addmm_(d, w);
  }
}

at::Tensor base_mm_nt(const at::Tensor& x, const WeightMatrix& w) {
  return w.quantized() ? panel_mm_nt(x, w) : base_mm_nt(x, w.data);
}

// Decode-sized d (backward's input gradients of blocks of at most kThinNnMaxRows rows) on the
// avx2 path, on quantized or bf16 weights: thin_gemm_nn streams the weights once where the
// panels converted them into float32 for ATen's GEMM (one row, [768, 2048] int4 on Zen 3: 0.97
// ms a call against the forward GEMV's 0.13). The avx512 paths keep their panels (bf16 ones
// for oneDNN's GEMMs there): thin_gemm_nn's AVX2 kernel was not measured against them.
bool takes_thin_gemm_nn(const at::Tensor& d, const WeightMatrix& w) {
  return d.size(0) <= kThinNnMaxRows && active_cpu_isa() == CpuIsa::kAvx2 &&
         (d.scalar_type() == at::kFloat || d.scalar_type() == at::kBFloat16) &&
         (w.quantized() || (w.data.scalar_type() == at::kBFloat16 && d.scalar_type() == at::kBFloat16));
}

at::Tensor base_mm_nn(const at::Tensor& d, const WeightMatrix& w) {
  if (takes_thin_gemm_nn(d, w)) return thin_gemm_nn(d, w, std::nullopt, CpuIsa::kAvx2);
  return w.quantized() ? panel_mm_nn(d, w, std::nullopt) : base_mm_nn(d, w.data);
}

void base_addmm_nn_(at::Tensor& out, const at::Tensor& d, const WeightMatrix& w) {
  if (takes_thin_gemm_nn(d, w)) {
    out.copy_(thin_gemm_nn(d, w, out, CpuIsa::kAvx2));
    return;
  }
  if (!w.quantized()) return base_addmm_nn_(out, d, w.data);
  out.copy_(panel_mm_nn(d, w, out));
}

at::Tensor thin_gemm_nt(const at::Tensor& x, const WeightMatrix& w) {
  if (!w.quantized()) return thin_gemm_nt(x, w.data);
  if (x.scalar_type() == at::kDouble) return panel_mm_nt(x, w);
  return quant_gemv_nt(x, w, active_cpu_isa());
}

void base_mm_tn_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (converts(a)) return panel_mm_tn_out(out, a, b);
  // aᵀ made contiguous first: oneDNN ran this GEMM 1.15-1.4x faster than on the transposed
  // view (Qwen3-30B-A3B shapes, bf16).
  at::mm_out(out, a.t().contiguous(), b);
}

}  // namespace kt
