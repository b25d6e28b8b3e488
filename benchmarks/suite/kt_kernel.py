"""The optional kt-kernel adapter: KTransformers' CPU SFT MoE (``kt-kernel==0.7.2``, never a
dependency) driven as one more implementation, and the status line of its install."""
import tempfile

import torch

from benchmarks.common import BASE, LORA, Impl, Unavailable
from benchmarks.suite.cases import DTYPE

KT_KERNEL_VERSION = "0.7.2"
INSTALL_NOTE = ("kt-kernel: not installed (optional; pip install --no-deps "
                f"kt-kernel=={KT_KERNEL_VERSION} numpy safetensors pyyaml packaging gguf)")


def kt_kernel_status() -> str:
    """'ok <version> (cpu variant <v>)', 'not installed' or 'import failed: ...'. The variant
    is the extension kt-kernel loaded for this CPU (``amx`` on AMX machines, else an AVX512 or
    AVX2 build; ``KT_KERNEL_CPU_VARIANT`` overrides it)."""
    try:
        import kt_kernel  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "kt_kernel":
            return "not installed"
        return f"import failed: {e}"
    except Exception as e:  # a broken install must not stop the suite
        return f"import failed: {type(e).__name__}: {e}"
    variant = getattr(kt_kernel, "__cpu_variant__", None)
    return (f"ok {getattr(kt_kernel, '__version__', '(version unknown)')}"
            + (f" (cpu variant {variant})" if variant else ""))


def _kt_kernel_wrapper_class():
    import kt_kernel
    cls = getattr(kt_kernel, "KTMoEWrapper", None)
    if cls is None:
        from kt_kernel.experts import KTMoEWrapper as cls  # noqa: N813
    return cls


# kt-kernel's SFT method per base-weight format (the frozen quantized ones train LoRA only).
METHODS = {"bf16": "AMXBF16_SFT", "fp8": "AMXFP8_SFT", "int8": "AMXINT8_SFT", "int4": "RAWINT4_SFT"}


def build_kt_kernel(mode: str, prob, cfg, fmt: str = "bf16", quantized=None) -> Impl:
    """KTransformers' SFT MoE through the kt-kernel 0.7.2 API (docs/benchmarks.md), on the problem's
    bf16 base weights (``fmt="bf16"``) or on frozen quantized ones (lora mode only: kt-kernel
    has no quantized forward without LoRA or full mode):

    * ``fmt="fp8"``, ``quantized`` = {projection: (float8_e4m3fn data [E, out, in], float32
      scales [E, out/128, in/128])} (kt_ops.quantization's layout, which is DeepSeek-V3's):
      ``method="AMXFP8_SFT"`` on those very weights through ``load_block_fp8_weights``, with
      ``share_backward_bb`` set (its FP8 backward requires it);
    * ``fmt="int4"``, ``quantized`` = kt_ops int4 in groups of 32 with bf16 scales ({projection:
      (uint8 [E, out, in/2], bf16 [E, out, in/32])}): ``method="RAWINT4_SFT"`` through
      ``load_rawint4_weights`` on those very bytes. Its layout is compressed-tensors' (``q + 8``,
      byte j = columns 2j (low nibble) and 2j + 1), which is kt_ops'; it requires LoRA rank 8;
    * ``fmt="int8"``: ``method="AMXINT8_SFT"``, which loads only kt-kernel's own pre-quantized
      ``.kt`` files. They are written by kt-kernel's online quantizer (its inference
      ``AMXInt8_MOE`` with ``save``, as its ``convert_cpu_weights.py`` does) from the problem's
      bf16 weights into a temporary directory, removed again at close, and ``share_backward_bb``
      is set (without it the INT8 backward's input gradients were wrong). So its weights are
      kt-kernel's quantization of the same bf16 weights, not kt_ops' int8: compare both with
      ``--reference kt.moe-fp32``, where each error includes its own weight quantization.

    ``KTMoEWrapper(..., mode="sft", method="AMXBF16_SFT")`` returns a
    ``kt_kernel.sft.amx.AMXSFTMoEWrapper``. Its conventions were checked against this project's
    (and against fp32 autograd) at kt-kernel 0.7.2 and match, so no tensor is transformed:

    * base weights ``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]`` (nn.Linear layout),
      bf16, given by ``load_weights_from_tensors(gate, up, down, physical_to_logical_map)``;
      the C++ side copies/packs them at load time (a later change of the tensors is not seen
      until ``update_base_weights()`` reloads them);
    * LoRA ``a`` ``[E, r, in]``, ``b`` ``[E, out, r]``, delta = (alpha / r)·B·A, bf16 and
      contiguous, given with six same-shaped bf16 gradient buffers to ``init_lora_weights``
      (the kernel keeps raw pointers and overwrites the gradient buffers in every backward;
      experts without tokens get zeros);
    * ``forward(x [T, H] bf16, ids [T, K] int64, weights [T, K] fp32, save_for_backward)``:
      y = sum_k weights[t, k] · expert(x[t]) with SwiGLU, the same routing semantics as here;
      ``backward(dy) -> (grad_input [T, H] bf16, grad_routing_weights [T, K] fp32)``;
    * full mode: ``lora_rank=0, full_weight_grad=True`` and ``init_full_weight_grad_buffers``
      makes nn.Parameters over the given base tensors plus ``grad_{gate,up,down}_proj_buf``
      in the weights' layout. For AMXBF16_SFT these are "authoritative" optimizer gradients:
      a backward *accumulates* into them while the optimizer window is open (after the first
      backward), so ``reset`` closes it with ``release_authoritative_optimizer_grads()``;
      the next backward then overwrites. fwd mode uses the same constructor (``lora_rank=0``
      requires ``full_weight_grad=True``) without the gradient buffers.

    The CPU thread pool (``cpuinfer_threads``) is a process-wide singleton: the first wrapper
    of the process fixes its thread count (here torch's thread count, i.e. ``--threads``).
    Any setup failure becomes Unavailable with the reason."""
    status = kt_kernel_status()
    if not status.startswith("ok"):
        raise Unavailable(status)
    T, H, I, E, K, r = (cfg.tokens, cfg.hidden, cfg.intermediate, cfg.experts, cfg.topk,
                        cfg.rank)
    train = mode != "fwd"
    use_lora = mode == "lora"
    if fmt != "bf16" and not use_lora:
        raise Unavailable(f"kt-kernel's {fmt.upper()} SFT trains LoRA on frozen experts only (lora mode)")
    if use_lora and abs(cfg.lora_alpha / r - cfg.lora_scale) > 1e-12 * abs(cfg.lora_scale):
        raise Unavailable(f"kt-kernel scales LoRA by lora_alpha / r = {cfg.lora_alpha / r:g}, "
                          f"not by the suite's lora_scale {cfg.lora_scale:g}")
    kt_files = None  # int8: the directory of kt-kernel's .kt files
    try:
        expert_map = torch.arange(E, dtype=torch.int64)
        if fmt == "int8":
            kt_files = _write_int8_kt_files(prob, cfg)
        wrapper_cls = _kt_kernel_wrapper_class()
        wrapper = wrapper_cls(
            layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H,
            moe_intermediate_size=I, gpu_experts_mask=None,
            cpuinfer_threads=torch.get_num_threads(), threadpool_count=1,
            weight_path=kt_files.name if kt_files else "",
            chunked_prefill_size=max(T, 1), method=METHODS[fmt], mode="sft",
            num_gpu_experts=0, lora_rank=r if use_lora else 0, lora_alpha=cfg.lora_alpha,
            full_weight_grad=not use_lora)
        if fmt == "fp8":
            from kt_kernel.sft.weights import BlockFP8ExpertWeights
            wrapper.share_backward_bb = True  # read at load; FP8 construction fails without it
            lists = {}
            for n in BASE:
                data, scale = quantized[n]
                lists[n] = [data[e].contiguous() for e in range(E)]
                lists[n.replace("proj", "scale")] = [scale[e].float().contiguous() for e in range(E)]
            wrapper.load_block_fp8_weights(BlockFP8ExpertWeights(**lists), expert_map)
        elif fmt == "int4":
            from kt_kernel.sft.weights import RAWINT4ExpertWeights
            parts = {}
            for n in BASE:
                data, scale = quantized[n]
                parts[n] = data.contiguous()
                parts[n.replace("proj", "scale")] = scale.to(torch.bfloat16).contiguous()
            wrapper.load_rawint4_weights(RAWINT4ExpertWeights(**parts, group_size=32), expert_map)
        elif fmt == "int8":
            # Read at load, as for FP8: without it its INT8 backward's input gradients came out
            # wrong (relative error 0.98-1.0 on dx and the gate/up LoRA gradients), silently.
            wrapper.share_backward_bb = True
            wrapper.load_weights(expert_map)  # reads the .kt files under weight_path
        else:
            gate, up, down = (prob[n].to(DTYPE).contiguous() for n in BASE)
            wrapper.load_weights_from_tensors(gate, up, down, expert_map)
        lora_grads = {}
        if use_lora:
            lora_grads = {n: torch.zeros_like(prob[n], dtype=DTYPE,
                                              memory_format=torch.contiguous_format)
                          for n in LORA}
            wrapper.init_lora_weights(*(prob[n].to(DTYPE).contiguous() for n in LORA),
                                      *(lora_grads[n] for n in LORA))
        elif mode == "full":
            wrapper.init_full_weight_grad_buffers(gate, up, down)
    except Exception as e:
        if kt_files is not None:
            kt_files.cleanup()
        raise Unavailable(f"kt-kernel setup failed: {type(e).__name__}: {e}") from e

    x = prob["hidden"].to(DTYPE).contiguous()
    ids = prob["topk_ids"].to(torch.int64).contiguous()
    w = prob["topk_weights"].to(torch.float32).contiguous()
    dy = prob["dy"].to(DTYPE).contiguous()
    state = {}

    def step():
        if not train:
            return wrapper.forward(x, ids, w, save_for_backward=False)
        y = wrapper.forward(x, ids, w, save_for_backward=True)
        state["grad_input"], _ = wrapper.backward(dy)  # (grad_input, grad of routing weights)
        return y

    def reset():
        state.pop("grad_input", None)
        if wrapper is not None:
            # full mode: close the authoritative-gradient window, else the next backward
            # accumulates into grad_*_proj_buf (a no-op for fwd/lora, whose LoRA gradient
            # buffers are plain tensors that every backward overwrites)
            wrapper.release_authoritative_optimizer_grads()

    def grads():
        out = {"hidden": state.get("grad_input")}
        if use_lora:
            out.update(lora_grads)
        elif mode == "full":
            out.update(gate_proj=wrapper.grad_gate_proj_buf, up_proj=wrapper.grad_up_proj_buf,
                       down_proj=wrapper.grad_down_proj_buf)
        return out

    def close():
        nonlocal wrapper
        wrapper = None
        lora_grads.clear()
        state.clear()
        wrapper_cls.clear_sft_buffer_cache()  # the shared grow-only I/O buffers
        if kt_files is not None:
            kt_files.cleanup()

    impl = Impl("kt-kernel" if fmt == "bf16" else f"kt-kernel-{fmt}", step, reset, grads)
    impl.close = close
    return impl


def _write_int8_kt_files(prob, cfg):
    """kt-kernel's INT8 quantization of the problem's bf16 base weights, as the ``.kt`` files
    (``_layer_0/_numa_0/INT8_{proj}_{expert}_*.kt``) that its AMXINT8_SFT loads, written by
    its inference ``AMXInt8_MOE`` with ``save`` set (what kt-kernel's convert_cpu_weights.py
    does; its Python wrapper for this needs pinned CUDA memory, so the C++ module is driven
    directly). Returns the TemporaryDirectory holding them."""
    import kt_kernel_ext.moe as moe_ext
    from kt_kernel.experts_base import BaseMoEWrapper

    out = tempfile.TemporaryDirectory(prefix="kt-kernel-int8-")
    try:
        gate, up, down = (prob[n].to(DTYPE).contiguous() for n in BASE)
        cpu_infer = BaseMoEWrapper._get_cpu_infer(torch.get_num_threads(), 1)
        on_gpu = torch.zeros(cfg.experts, dtype=torch.bool)  # every expert on the CPU
        config = moe_ext.MOEConfig(cfg.experts, cfg.topk, cfg.hidden, cfg.intermediate, on_gpu.data_ptr())
        # max_len: the rows of its (unused) activation buffers, a multiple of its AMX tile rows
        config.layer_idx, config.pool, config.max_len = 0, cpu_infer.backend_, 256
        config.save, config.load, config.path = True, False, out.name
        config.gate_proj, config.up_proj, config.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        quantizer = moe_ext.AMXInt8_MOE(config)
        expert_map = torch.arange(cfg.experts, dtype=torch.int64)
        cpu_infer.submit(quantizer.load_weights_task(expert_map.data_ptr()))
        cpu_infer.sync()
        del quantizer
    except Exception:
        out.cleanup()
        raise
    return out
