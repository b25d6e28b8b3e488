#include "gemm/packed_weights.h"

#include "platform/cpu_isa.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include <unistd.h>

namespace kt {
namespace {

// What identifies one weight tensor's contents: its storage (held weakly, so that the cache
// never keeps freed weights alive, and a new tensor reusing the address is not mistaken for
// the old one), where it starts, its shape, and its version counter.
struct WeightKey {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  const void* data = nullptr;
  std::vector<int64_t> sizes, strides;
  uint32_t version = 0;

  static std::optional<WeightKey> of(const at::Tensor& t) {
    if (t.is_inference()) return std::nullopt;  // no version counter: cannot tell changes
    WeightKey k;
    k.storage = c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl());
    k.data = t.const_data_ptr();
    k.sizes = t.sizes().vec();
    k.strides = t.strides().vec();
    k.version = t.unsafeGetTensorImpl()->version_counter().current_version();
    return k;
  }

  bool alive() const { return !storage.expired(); }

  bool same_as(const WeightKey& o) const {
    if (!alive() || !o.alive()) return false;
    return storage.lock().get() == o.storage.lock().get() && data == o.data && sizes == o.sizes &&
           strides == o.strides && version == o.version;
  }
};

struct Entry {
  std::array<WeightKey, 3> keys;  // gate, up, down
  int calls = 0;                  // consecutive calls that saw these exact weights
  std::shared_ptr<const PackedExperts> packed;
};

std::mutex cache_mutex;
std::vector<Entry> cache;  // a handful of layers' weights: linear search is fine

bool initial_packing_enabled() {
#ifdef KT_OPS_EMULATE_AVX512
  return false;  // oneDNN's bf16 reorder needs real AVX-512 (x86_intrinsics.h)
#endif
  const char* env = std::getenv("KT_OPS_PACK_WEIGHTS");
  return !(env && std::string(env) == "0");
}

std::atomic<bool>& packing_flag() {
  static std::atomic<bool> flag{initial_packing_enabled()};
  return flag;
}

const c10::OperatorHandle& reorder_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  return op;
}

const c10::OperatorHandle& linear_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

const c10::OperatorHandle& linear_add_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary");
  return op;
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& w) {
  torch::jit::Stack stack{w, c10::IValue(int64_t(64))};  // batch-size hint: typical rows per block
  reorder_op().callBoxed(&stack);
  return stack[0].toTensor();
}

namespace {

// Two packed copies (forward and backward layouts) of all three weights.
int64_t packed_bytes(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
  return 2 * (gate.numel() + up.numel() + down.numel()) * gate.element_size();
}

std::shared_ptr<const PackedExperts> pack(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
  const int64_t E = gate.size(0);
  auto packed = std::make_shared<PackedExperts>();
  packed->gate_up.resize(E);
  packed->down.resize(E);
  packed->gate_up_t.resize(E);
  packed->down_t.resize(E);
  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const at::Tensor gate_up = at::cat({gate[e], up[e]}, 0);
      packed->gate_up[e] = pack_linear_weight(gate_up);
      packed->down[e] = pack_linear_weight(down[e]);
      packed->gate_up_t[e] = pack_linear_weight(gate_up.t().contiguous());
      packed->down_t[e] = pack_linear_weight(down[e].t().contiguous());
    }
  });
  packed->bytes = packed_bytes(gate, up, down);
  return packed;
}

int64_t packing_budget_bytes() {
  static const int64_t budget = []() -> int64_t {
    if (const char* env = std::getenv("KT_OPS_PACK_WEIGHTS_BUDGET_MB")) return int64_t(std::atoll(env)) << 20;
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? int64_t(pages) * page / 4 : int64_t(0);
  }();
  return budget;
}

// Drops the entries (and packed copies) of weights that were freed; callers hold cache_mutex.
// Runs on every kt.moe call and every packed_weights_info().
void forget_freed_weights() {
  cache.erase(std::remove_if(cache.begin(), cache.end(),
                             [](const Entry& e) { return !(e.keys[0].alive() && e.keys[1].alive() && e.keys[2].alive()); }),
              cache.end());
}

int64_t cached_bytes() {  // callers hold cache_mutex
  int64_t bytes = 0;
  for (const Entry& e : cache) bytes += e.packed ? e.packed->bytes : 0;
  return bytes;
}

bool packable(const at::Tensor& gate) {
  // Only where bf16 GEMMs are oneDNN's own (base_gemm.h): elsewhere oneDNN's bf16 reorder is
  // either refused (CPUs without AVX-512) or no faster than the float32 panel path.
  return weight_packing_enabled() && native_bf16_gemms() && gate.scalar_type() == at::kBFloat16 && gate.device().is_cpu() &&
         gate.size(0) > 0 && gate.numel() > 0 && at::globalContext().userEnabledMkldnn();
}

}  // namespace

std::shared_ptr<const PackedExperts> packed_experts(const at::Tensor& gate, const at::Tensor& up,
                                                    const at::Tensor& down, const at::Tensor& gate_contiguous,
                                                    const at::Tensor& up_contiguous,
                                                    const at::Tensor& down_contiguous, bool forward_call) {
  // Dense bf16 weights only: quantized ones are dequantized panel by panel (base_gemm.h).
  if (!packable(gate) || up.scalar_type() != gate.scalar_type() || down.scalar_type() != gate.scalar_type()) {
    return nullptr;
  }
  auto kg = WeightKey::of(gate), ku = WeightKey::of(up), kd = WeightKey::of(down);
  if (!kg || !ku || !kd) return nullptr;
  std::lock_guard<std::mutex> lock(cache_mutex);
  forget_freed_weights();
  for (Entry& entry : cache) {
    if (entry.keys[0].storage.lock().get() != kg->storage.lock().get() || entry.keys[0].data != kg->data) continue;
    if (entry.keys[0].same_as(*kg) && entry.keys[1].same_as(*ku) && entry.keys[2].same_as(*kd)) {
      if (forward_call && !entry.packed && ++entry.calls >= kPackAfterCalls &&
          cached_bytes() + packed_bytes(gate, up, down) <= packing_budget_bytes()) {
        entry.packed = pack(gate_contiguous, up_contiguous, down_contiguous);
      }
      return entry.packed;
    }
    entry = Entry{{*kg, *ku, *kd}, forward_call ? 1 : 0, nullptr};  // changed weights: drop the stale copy
    return nullptr;
  }
  cache.push_back(Entry{{*kg, *ku, *kd}, forward_call ? 1 : 0, nullptr});
  return nullptr;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_w) {
  torch::jit::Stack stack{x, packed_w, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          c10::IValue()};
  linear_op().callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor packed_linear_add(const at::Tensor& x, const at::Tensor& packed_w, const at::Tensor& addend) {
  torch::jit::Stack stack{x, addend, packed_w, c10::IValue(), std::string("add")};
  linear_add_op().callBoxed(&stack);
  return stack[0].toTensor();
}

void set_weight_packing(bool enabled) {
  packing_flag().store(enabled);
  if (!enabled) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    cache.clear();
  }
}

bool weight_packing_enabled() { return packing_flag().load(); }

void release_packed_weights() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  cache.clear();
}

std::vector<int64_t> packed_weights_info() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  forget_freed_weights();
  int64_t sets = 0, bytes = 0;
  for (const Entry& e : cache) {
    if (e.packed && e.keys[0].alive()) {
      ++sets;
      bytes += e.packed->bytes;
    }
  }
  return {sets, bytes};
}

}  // namespace kt
