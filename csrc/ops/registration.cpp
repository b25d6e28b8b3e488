// Schemas of every op in the `kt` namespace, in one place.
//
// Kernels live elsewhere: CPU in csrc/ops/*.cpp, Meta (shape-only, SymInt-aware) in
// meta_kernels/*.cpp, autograd in kt_ops/_autograd.py (torch.library.register_autograd).
#include <Python.h>
#include <torch/library.h>

// An empty Python module, so that `import kt_ops._C` loads this library and runs the
// static registrations below (the pattern of pytorch/extension-cpp).
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "kt_ops native ops (registered with torch.library)", -1, nullptr};
  return PyModule_Create(&module_def);
}
}

#define KT_MOE_ARGS                                                                       \
  "Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, "                          \
  "Tensor gate_proj, Tensor up_proj, Tensor down_proj, "                                   \
  "Tensor? gate_lora_a=None, Tensor? gate_lora_b=None, "                                   \
  "Tensor? up_lora_a=None, Tensor? up_lora_b=None, "                                       \
  "Tensor? down_lora_a=None, Tensor? down_lora_b=None, float lora_scale=1.0"

// Scales of quantized base weights (csrc/kernels/expert_weights.h: a float8_e4m3fn, int8 or
// uint8 (int4) gate_proj / up_proj / down_proj comes with its scale), last in every schema so
// that calls on dense weights are unchanged.
#define KT_SCALE_ARGS "Tensor? gate_scale=None, Tensor? up_scale=None, Tensor? down_scale=None"

// The gating (csrc/kernels/swiglu.h): the clamp of SwiGLU variants with a swiglu_limit, the
// gate's activation ('silu', 'gelu_tanh' or 'swigluoai') and swigluoai's alpha; after the
// scales for the same reason.
#define KT_GATING_ARGS "float? swiglu_limit=None, str activation=\"silu\", float? swiglu_alpha=None"

// Per-expert biases (gpt-oss's experts; csrc/ops/moe_checks.h): gate [E, I], up [E, I], down
// [E, H], in the dtype of hidden_states; last, for the same reason.
#define KT_BIAS_ARGS "Tensor? gate_bias=None, Tensor? up_bias=None, Tensor? down_bias=None"

// nvfp4's global scales (csrc/kernels/expert_weights.h): float32 [E], a weight being
// e2m1 * scale * global; last, for the same reason.
#define KT_GLOBAL_SCALE_ARGS \
  "Tensor? gate_global_scale=None, Tensor? up_global_scale=None, Tensor? down_global_scale=None"

TORCH_LIBRARY(kt, m) {
  // The public, differentiable op. CompositeImplicitAutograd: it calls moe_forward and
  // returns only the output; autograd lives on moe_forward.
  m.def("moe(" KT_MOE_ARGS ", " KT_SCALE_ARGS ", " KT_GATING_ARGS ", " KT_BIAS_ARGS ", " KT_GLOBAL_SCALE_ARGS ") -> Tensor",
        {at::Tag::pt2_compliant_tag});

  // Forward that also returns what backward needs: the gate and up pre-activations
  // [2, T*K, I] in expert-sorted order (or [2, 0, I] when save_activations is false).
  m.def("moe_forward(" KT_MOE_ARGS ", bool save_activations=False, " KT_SCALE_ARGS ", " KT_GATING_ARGS
        ", " KT_BIAS_ARGS ", " KT_GLOBAL_SCALE_ARGS ") -> (Tensor output, Tensor activations)",
        {at::Tag::pt2_compliant_tag});

  // Gradients of moe_forward. output_mask has 11 entries, in the order
  // hidden_states, topk_weights, gate_proj, up_proj, down_proj, gate_lora_a, gate_lora_b,
  // up_lora_a, up_lora_b, down_lora_a, down_lora_b, or 14 with gate_bias, up_bias, down_bias
  // after them; an unrequested gradient is not computed and comes back as an empty tensor of
  // shape [0]; quantized base weights have none. Returns one gradient per entry of
  // output_mask, in its order.
  m.def(
      "moe_backward(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, "
      "Tensor activations, Tensor gate_proj, Tensor up_proj, Tensor down_proj, "
      "Tensor? gate_lora_a, Tensor? gate_lora_b, Tensor? up_lora_a, Tensor? up_lora_b, "
      "Tensor? down_lora_a, Tensor? down_lora_b, float lora_scale, bool[] output_mask, " KT_SCALE_ARGS
      ", " KT_GATING_ARGS ", " KT_BIAS_ARGS ", " KT_GLOBAL_SCALE_ARGS ") -> Tensor[]",
      {at::Tag::pt2_compliant_tag});

  // The C++ CPU kernels of moe_forward / moe_backward. The CPU kernels registered for the
  // two ops above are thin Python wrappers (kt_ops/_kernels.py) that call these and, on
  // failure, tell the other ranks of a distributed job before raising (kt_ops/faults.py).
  m.def("_moe_forward_cpu(" KT_MOE_ARGS ", bool save_activations=False, " KT_SCALE_ARGS ", " KT_GATING_ARGS
        ", " KT_BIAS_ARGS ", " KT_GLOBAL_SCALE_ARGS ") -> (Tensor output, Tensor activations)");
  m.def(
      "_moe_backward_cpu(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, "
      "Tensor activations, Tensor gate_proj, Tensor up_proj, Tensor down_proj, "
      "Tensor? gate_lora_a, Tensor? gate_lora_b, Tensor? up_lora_a, Tensor? up_lora_b, "
      "Tensor? down_lora_a, Tensor? down_lora_b, float lora_scale, bool[] output_mask, " KT_SCALE_ARGS
      ", " KT_GATING_ARGS ", " KT_BIAS_ARGS ", " KT_GLOBAL_SCALE_ARGS ") -> Tensor[]");

  // Collectives over a torch.distributed process group (kernels and autograd:
  // kt_ops/collectives.py; fakes: meta_kernels/collectives.py). rank and world_size are
  // this process's place in the group, so that shapes are a function of the arguments.
  m.def(
      "gather_to_owner(Tensor[] tensors, int rank, int world_size, int owner_rank, int tag, "
      "str group_name) -> (Tensor[] gathered, Tensor lengths)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "scatter_from_owner(Tensor[] tensors, Tensor lengths, SymInt local_rows, int rank, int world_size, "
      "int owner_rank, int tag, str group_name) -> Tensor[]",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "gather_to_owner_sized(Tensor[] tensors, Tensor lengths, SymInt total_rows, int rank, int world_size, "
      "int owner_rank, int tag, str group_name) -> Tensor[]",
      {at::Tag::pt2_compliant_tag});

  // The sharded layer's all-to-all (kernels and autograd: kt_ops/shard_collectives.py; fakes:
  // meta_kernels/shard_collectives.py). Shard s, on group rank s, holds the experts
  // [expert_starts[s], expert_starts[s+1]).
  m.def(
      "dispatch_to_shards(Tensor[] rows, Tensor[] slots, Tensor topk_ids, int[] expert_starts, int rank, "
      "int world_size, int tag, str group_name) -> (Tensor[] rows_out, Tensor[] slots_out, Tensor local_ids, "
      "Tensor recv_counts)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "dispatch_to_shards_sized(Tensor[] rows, Tensor[] slots, Tensor topk_ids, Tensor recv_counts, "
      "SymInt total_rows, int[] expert_starts, int rank, int world_size, int tag, str group_name) "
      "-> (Tensor[] rows_out, Tensor[] slots_out)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "combine_from_shards(Tensor[] rows, Tensor[] slots, Tensor topk_ids, Tensor recv_counts, "
      "int[] expert_starts, int rank, int world_size, int tag, str group_name) "
      "-> (Tensor[] rows_out, Tensor[] slots_out)",
      {at::Tag::pt2_compliant_tag});

  // nn.Linear on kt's base-GEMM paths (csrc/ops/linear.cpp: bf16 storage at float32 speed on CPUs
  // without AVX512-BF16) and its two gradients; autograd in kt_ops/linear.py.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("linear_input_grad(Tensor grad, Tensor weight) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("linear_weight_grad(Tensor grad, Tensor x) -> Tensor", {at::Tag::pt2_compliant_tag});

  // Identity whose gradient is multiplied by `scale` (kt_ops/layer.py uses it to give the
  // owner's expert gradients DDP's average-over-ranks meaning).
  m.def("scale_grad(Tensor self, float scale) -> Tensor", {at::Tag::pt2_compliant_tag});

  // Instruction set of the hand-written CPU kernels (csrc/platform/cpu_isa.h): the active one,
  // the best this CPU supports, and a setter (portable | avx2 | avx512 | avx512_bf16 | auto).
  m.def("_cpu_isa() -> str");
  m.def("_best_cpu_isa() -> str");
  m.def("_set_cpu_isa(str isa) -> ()");
  // How kt.moe's base-weight GEMMs of a dtype run on the active path (csrc/gemm/base_gemm.h).
  m.def("_base_gemm_path(ScalarType dtype) -> str");
  // Pre-packed expert weights (csrc/gemm/packed_weights.h): switch, and {sets, bytes} cached.
  m.def("_set_weight_packing(bool enabled) -> ()");
  m.def("_set_amx(bool enabled) -> ()");
  m.def("_amx_available() -> bool");
  m.def("_amx_supported() -> bool");
  m.def("_weight_packing_enabled() -> bool");
  m.def("_packed_weights_info() -> int[]");
  m.def("_release_packed_weights() -> ()");
  // Large per-call buffers kept for reuse (csrc/platform/large_alloc.h): {buffers, bytes} idle, release.
  m.def("_cached_buffers_info() -> int[]");
  m.def("_release_cached_buffers() -> ()");
  // The test-only kernels (_small_gemm, _dequantize, _quant_gemv_nt, ...): their own fragment of
  // this library, beside their kernels in csrc/ops/kernel_test_ops.cpp.
}
