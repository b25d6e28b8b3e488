#pragma once

#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <atomic>

namespace kt {

template <typename Fn>
void for_each_block(const std::vector<ExpertBlock>& blocks, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(blocks.size());
  if (n == 0) return;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // The intra-op threads do not inherit the caller's thread-local dispatch state: keep
    // the ATen calls made in fn below autograd, as the calling kernel is.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(blocks[i]);
  });
}

}  // namespace kt
