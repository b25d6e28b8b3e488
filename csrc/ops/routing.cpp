#include "ops/routing.h"

#include <algorithm>

namespace kt {

ExpertRouting route_to_experts(const at::Tensor& topk_ids, int64_t num_experts) {
  TORCH_INTERNAL_ASSERT(topk_ids.dim() == 2);
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  ExpertRouting r;
  r.num_tokens = ids.size(0);
  r.top_k = ids.size(1);
  r.num_experts = num_experts;
  const int64_t pairs = r.num_tokens * r.top_k;
  const int64_t* id = ids.const_data_ptr<int64_t>();

  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = id[p];
    if (e == -1) continue;  // empty slot
    TORCH_CHECK_INDEX(e >= 0 && e < num_experts, "kt.moe: topk_ids must lie in [0, ", num_experts,
                      ") (the number of experts) or be -1 (an empty slot), got ", e, " at token ",
                      p / std::max<int64_t>(r.top_k, 1), ", slot ", p % std::max<int64_t>(r.top_k, 1));
    ++counts[e];
  }
  r.offsets.assign(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) r.offsets[e + 1] = r.offsets[e] + counts[e];

  const int64_t n = r.num_routed();
  r.sorted_pairs = at::empty({n}, at::kLong);
  r.sorted_tokens = at::empty({n}, at::kLong);
  r.row_of_pair = at::empty({pairs}, at::kLong);
  int64_t* sorted = r.sorted_pairs.data_ptr<int64_t>();
  int64_t* tokens = r.sorted_tokens.data_ptr<int64_t>();
  int64_t* row_of = r.row_of_pair.data_ptr<int64_t>();
  std::vector<int64_t> cursor(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    if (id[p] == -1) {
      row_of[p] = -1;
      continue;
    }
    const int64_t row = cursor[id[p]]++;
    sorted[row] = p;
    tokens[row] = p / r.top_k;
    row_of[p] = row;
  }
  return r;
}

std::vector<ExpertBlock> expert_blocks(const ExpertRouting& routing, int64_t max_rows) {
  std::vector<ExpertBlock> blocks;
  for (int64_t e = 0; e < routing.num_experts; ++e) {
    const int64_t begin = routing.offsets[e], end = routing.offsets[e + 1];
    const int64_t step = max_rows > 0 ? max_rows : std::max<int64_t>(end - begin, 1);
    for (int64_t b = begin; b < end; b += step) blocks.push_back({e, b, std::min(end, b + step)});
  }
  // Largest first (longest-processing-time order); ties by expert, so the order is fixed.
  std::stable_sort(blocks.begin(), blocks.end(), [](const ExpertBlock& a, const ExpertBlock& b) {
    return (a.end - a.begin) > (b.end - b.begin);
  });
  return blocks;
}

}  // namespace kt
