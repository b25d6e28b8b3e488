// Grouping of the (token, slot) pairs of a kt.moe call by expert.
//
// A pair p = t*K + j sends token t to expert topk_ids[t, j], or nowhere when that id is -1 (an
// empty slot: a sharded layer's slots whose expert another owner holds). The experts' kernels work on
// dense blocks of rows, so the pairs are put in expert order (a stable counting sort: the
// order is the same on every call with the same ids, which keeps results deterministic and
// lets backward rebuild exactly the order forward saved its activations in).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace kt {

struct ExpertRouting {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  int64_t num_experts = 0;
  std::vector<int64_t> offsets;  // [E+1]: rows of expert e are [offsets[e], offsets[e+1])
  at::Tensor sorted_pairs;       // int64 [N]: the pair at each sorted row
  at::Tensor sorted_tokens;      // int64 [N]: its token (sorted_pairs / K)
  at::Tensor row_of_pair;        // int64 [T*K]: the sorted row of each pair, -1 for an empty slot

  int64_t rows(int64_t e) const { return offsets[e + 1] - offsets[e]; }
  // N: the pairs routed to an expert (T*K less the empty slots).
  int64_t num_routed() const { return offsets.back(); }
  bool has_empty_slots() const { return num_routed() != num_tokens * top_k; }
};

// topk_ids: [T, K] int32 or int64 on the CPU, each in [0, num_experts) or -1 (empty slot).
// Raises IndexError naming topk_ids for any other id.
ExpertRouting route_to_experts(const at::Tensor& topk_ids, int64_t num_experts);

// A block of rows [begin, end) of one expert: the unit of work handed to a thread.
struct ExpertBlock {
  int64_t expert;
  int64_t begin;
  int64_t end;
};

// The experts' rows cut into blocks of at most max_rows rows (max_rows <= 0: one block per
// expert), largest first, so that dynamic scheduling over threads balances the load.
std::vector<ExpertBlock> expert_blocks(const ExpertRouting& routing, int64_t max_rows);

// Runs fn(block) for every block on torch's intra-op threads; a thread takes the next block
// as soon as it is free. Exceptions propagate to the caller.
template <typename Fn>
void for_each_block(const std::vector<ExpertBlock>& blocks, const Fn& fn);

}  // namespace kt

#include "ops/routing-inl.h"
