#include "ops/moe_common.h"

#include "gemm/base_gemm.h"

#include "kernels/small_gemm.h"
#include "kernels/thin_gemm.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>

namespace kt {
namespace {

at::Tensor plain(const at::Tensor& t) { return t.detach().contiguous(); }

std::optional<at::Tensor> plain(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(plain(*t)) : std::nullopt;
}

}  // namespace

MoeInputs flatten_moe_inputs(const MoeArgs& args) {
  const at::Tensor &hidden_states = args.hidden_states, &topk_ids = args.topk_ids, &topk_weights = args.topk_weights;
  const LoraTensors& lora = args.lora;
  const BaseScales& scales = args.scales;
  const ExpertBiases& biases = args.biases;
  const int64_t H = hidden_states.size(-1);
  const int64_t K = topk_ids.size(-1);
  // T from the leading dims, not reshape(-1, ...): -1 is ambiguous when K (or H) is 0.
  const int64_t T = c10::multiply_integers(hidden_states.sizes().begin(), hidden_states.sizes().end() - 1);
  MoeInputs in;
  in.x = plain(hidden_states).reshape({T, H});
  in.ids = plain(topk_ids).reshape({T, K});
  in.weights = plain(topk_weights).reshape({T, K}).to(accumulate_type(hidden_states.scalar_type()));
  in.gate = expert_weights(args.gate_proj, scales.gate, scales.gate_global);
  in.up = expert_weights(args.up_proj, scales.up, scales.up_global);
  in.down = expert_weights(args.down_proj, scales.down, scales.down_global);
  in.lora = {plain(lora.gate_a), plain(lora.gate_b), plain(lora.up_a),
             plain(lora.up_b),   plain(lora.down_a), plain(lora.down_b)};
  in.scale = args.lora_scale;
  in.biases = {plain(biases.gate), plain(biases.up), plain(biases.down)};
  return in;
}

BlockRows::BlockRows(int64_t num_rows, at::ScalarType dtype)
    : dtype_(dtype), kept_(num_rows), row_(num_rows, nullptr) {}

void BlockRows::keep(int64_t begin, int64_t n, const at::Tensor& rows) {
  TORCH_INTERNAL_ASSERT(rows.scalar_type() == dtype_ && rows.dim() == 2 && rows.size(0) >= n &&
                        (rows.size(1) <= 1 || rows.stride(1) == 1));
  if (n == 0) return;
  kept_[begin] = rows;
  const char* base = static_cast<const char*>(rows.const_data_ptr());
  const int64_t row_bytes = rows.stride(0) * rows.element_size();
  for (int64_t i = 0; i < n; ++i) row_[begin + i] = base + i * row_bytes;
}

void combine_rows(const BlockRows& rows, const at::Tensor& row_of_pair,
                  const std::optional<at::Tensor>& scale, at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(out.scalar_type() == rows.dtype() && out.is_contiguous());
  const int64_t T = out.size(0), H = out.size(1);
  const int64_t K = T == 0 ? 0 : row_of_pair.numel() / T;
  const int64_t* row_of = row_of_pair.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "kt_combine_rows", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* w = scale.has_value() ? scale->const_data_ptr<acc_t>() : nullptr;
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<acc_t> acc(H);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t j = 0; j < K; ++j) {
          if (row_of[t * K + j] < 0) continue;  // an empty slot adds nothing
          const scalar_t* r = static_cast<const scalar_t*>(rows.row(row_of[t * K + j]));
          const acc_t s = w ? w[t * K + j] : acc_t(1);
          for (int64_t h = 0; h < H; ++h) acc[h] += s * static_cast<acc_t>(r[h]);
        }
        for (int64_t h = 0; h < H; ++h) dst[t * H + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
}

int64_t padded_rows(int64_t n, at::ScalarType dtype) {
  if (dtype != at::kBFloat16 || !native_bf16_gemms()) return n;
  if (n <= 16) {
    int64_t p = 1;
    while (p < n) p *= 2;
    return p;
  }
  return (n + 15) / 16 * 16;
}

at::Tensor gather_rows_padded(const at::Tensor& src, const at::Tensor& index, int64_t padded) {
  const int64_t n = index.numel();
  at::Tensor out = at::empty({padded, src.size(1)}, src.options());
  at::Tensor head = out.narrow(0, 0, n);
  at::index_select_out(head, src, 0, index);
  out.narrow(0, n, padded - n).zero_();
  return out;
}

void add_lora(at::Tensor& out, const at::Tensor& in, const std::optional<at::Tensor>& a,
              const std::optional<at::Tensor>& b_t, double scale) {
  if (a.has_value()) small_gemm(out, out, thin_gemm_nt(in, *a), *b_t, scale);
}

std::optional<at::Tensor> transposed_lora_b(const std::optional<at::Tensor>& b) {
  return b.has_value() ? std::optional<at::Tensor>(b->transpose(1, 2).contiguous()) : std::nullopt;
}

}  // namespace kt
