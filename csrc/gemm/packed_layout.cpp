#include "gemm/packed_layout.h"

#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "platform/cpu_isa.h"
#include "gemm/packed_weights.h"

// ATen's accessors of an MKLDNN-layout tensor's buffer (ATen/native/mkldnn/MKLDNNCommon.h,
// exported for AOTInductor; the header is not installed with the wheel).
namespace at {
namespace native {
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace native
}  // namespace at

namespace kt {
namespace {

// The family's candidates, the layout seen on AVX512-BF16 (64 rows side by side, the whole
// input dimension inside a block) first.
constexpr int64_t kOutBlocks[] = {64, 32, 16};
constexpr int64_t kInBlocks[] = {0 /* all of in */, 32, 64, 128, 256, 512};

bool matches(const PackedBf16Layout& l, const uint16_t* by_row, const uint16_t* by_col, const uint16_t* row_code,
             const uint16_t* col_code) {
  for (int64_t o = 0; o < l.out; ++o) {
    for (int64_t i = 0; i < l.in; ++i) {
      const int64_t at = l.offset(o, i);
      if (by_row[at] != row_code[o] || by_col[at] != col_code[i]) return false;
    }
  }
  return true;
}

std::unique_ptr<PackedBf16Layout> probe(int64_t out, int64_t in) {
  if (out % 16 != 0 || in % 32 != 0) return nullptr;  // (packed_bf16_layout checked the path)
  const at::Tensor row_code = (at::arange(out) % 251 + 1).to(at::kBFloat16);
  const at::Tensor col_code = (at::arange(in) % 241 + 1).to(at::kBFloat16);
  const at::Tensor by_row = pack_linear_weight(row_code.view({out, 1}).expand({out, in}).contiguous());
  const at::Tensor by_col = pack_linear_weight(col_code.view({1, in}).expand({out, in}).contiguous());
  if (at::native::nbytes_from_mkldnn(by_row) != out * in * 2 || at::native::nbytes_from_mkldnn(by_col) != out * in * 2) {
    return nullptr;  // padded
  }
  const auto* r = static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(by_row));
  const auto* c = static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(by_col));
  const auto* rc = reinterpret_cast<const uint16_t*>(row_code.const_data_ptr());
  const auto* cc = reinterpret_cast<const uint16_t*>(col_code.const_data_ptr());
  for (const int64_t ob : kOutBlocks) {
    for (int64_t ib : kInBlocks) {
      ib = ib == 0 ? in : ib;
      if (out % ob != 0 || in % ib != 0 || ib % 32 != 0) continue;
      auto layout = std::make_unique<PackedBf16Layout>(PackedBf16Layout{out, in, ob, ib});
      if (matches(*layout, r, c, rc, cc)) return layout;
    }
  }
  return nullptr;
}

}  // namespace

const PackedBf16Layout* packed_bf16_layout(int64_t out, int64_t in) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, std::unique_ptr<PackedBf16Layout>> layouts;  // nullptr: none
  if (!native_bf16_gemms()) return nullptr;
#ifdef KT_OPS_EMULATE_AVX512
  return nullptr;  // oneDNN's bf16 reorder, which the probe runs, needs real AVX-512 (x86_intrinsics.h)
#endif
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(out, in);
  auto it = layouts.find(key);
  if (it == layouts.end()) it = layouts.emplace(key, probe(out, in)).first;
  return it->second.get();
}

const at::Tensor& thread_packed_weight(int64_t out, int64_t in) {
  thread_local std::map<std::pair<int64_t, int64_t>, at::Tensor> weights;
  at::Tensor& w = weights[std::make_pair(out, in)];
  if (!w.defined()) w = pack_linear_weight(at::zeros({out, in}, at::TensorOptions().dtype(at::kBFloat16)));
  return w;
}

uint16_t* packed_bf16_data(const at::Tensor& packed) {
  return static_cast<uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
}

}  // namespace kt
