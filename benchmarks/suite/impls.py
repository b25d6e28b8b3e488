"""The timed implementations: kt.moe in bf16 and in float32, kt.moe on quantized experts (fp8,
int8, int4 with bf16 activations), the eager baselines (sorted-mm, grouped-mm, hf-loop) and
kt-kernel. Each is a ``common.Impl`` (step, reset, grads) with a
``.close()`` that frees what it holds."""
from typing import Callable, Dict

import torch

import kt_ops
from benchmarks.baselines import GroupedMMMoE, HFLoopMoE, SortedMoE
from benchmarks.common import BASE, LORA, Impl, Unavailable, make_step, mark_updated_in_place
from kt_ops import quantization
from benchmarks.suite.kt_kernel import build_kt_kernel

IMPLS = ("kt.moe", "kt.moe-fp32", "kt.moe-fp8", "kt.moe-int8", "kt.moe-int4", "kt.moe-mxfp4", "kt.moe-nvfp4",
         "kt.moe-fp8-fp32", "kt.moe-int4-fp32", "sorted-mm", "grouped-mm", "hf-loop", "kt-kernel", "kt-kernel-fp8", "kt-kernel-int8",
         "kt-kernel-int4")
REFERENCE = "sorted-mm"  # the correctness reference of every other implementation
KT_MOE_DTYPES = {"kt.moe": torch.bfloat16, "kt.moe-fp32": torch.float32}
# kt.moe on the problem's weights quantized (kt_ops.quantization; int4 in groups of 32), with
# bf16 activations, or float32 ones for kt.moe-fp8-fp32 / kt.moe-int4-fp32: the references for
# fp8 / int4 kernels (--reference kt.moe-fp8-fp32), whose errors then exclude the weights'
# quantization.
KT_MOE_FORMATS = {"kt.moe-fp8": ("fp8", None, torch.bfloat16), "kt.moe-int8": ("int8", None, torch.bfloat16),
                  "kt.moe-int4": ("int4", 32, torch.bfloat16), "kt.moe-fp8-fp32": ("fp8", None, torch.float32),
                  "kt.moe-int4-fp32": ("int4", 32, torch.float32), "kt.moe-mxfp4": ("mxfp4", None, torch.bfloat16),
                  "kt.moe-nvfp4": ("nvfp4", None, torch.bfloat16)}


def _trained(mode: str) -> tuple:
    """The problem tensors that require grad in ``mode`` (besides the hidden states)."""
    return LORA if mode == "lora" else BASE if mode == "full" else ()


def build_impl(name: str, mode: str, prob: Dict[str, torch.Tensor], cfg) -> Impl:
    """Implementation ``name`` (one of IMPLS) for ``mode`` on the bf16 problem ``prob`` of
    ``cases.case_problem``; ``cfg`` is its ``cases.problem_config``. kt-kernel raises
    ``common.Unavailable`` where it cannot run."""
    if name in KT_MOE_DTYPES:
        return _build_kt_moe(name, mode, prob, cfg)
    if name in KT_MOE_FORMATS:
        return _build_kt_quantized(name, mode, prob, cfg)
    if name in ("sorted-mm", "grouped-mm"):
        return _build_sorted(name, mode, prob, cfg)
    if name == "hf-loop":
        return _build_hf_loop(mode, prob, cfg)
    if name == "kt-kernel":
        return build_kt_kernel(mode, prob, cfg)
    if name == "kt-kernel-fp8":  # the very fp8 weights kt.moe-fp8 runs on
        return build_kt_kernel(mode, prob, cfg, "fp8", _quantized(prob, "fp8", None))
    if name == "kt-kernel-int4":  # the very int4 weights (groups of 32, bf16 scales) of kt.moe-int4
        return build_kt_kernel(mode, prob, cfg, "int4", _quantized(prob, "int4", 32))
    if name == "kt-kernel-int8":  # kt-kernel's own int8 quantization of the bf16 weights
        return build_kt_kernel(mode, prob, cfg, "int8")
    raise ValueError(f"unknown implementation {name!r}; choose from {IMPLS}")


def _build_kt_moe(name: str, mode: str, prob, cfg) -> Impl:
    """kt.moe on the problem converted to ``KT_MOE_DTYPES[name]``: for float32, copies of the
    same routing weights, hidden states, weights, LoRA tensors and dy; for bf16, the problem's
    own tensors (``to`` returns them)."""
    dtype = KT_MOE_DTYPES[name]
    train, trained, use_lora = mode != "fwd", _trained(mode), mode == "lora"
    x = prob["hidden"].to(dtype).detach().requires_grad_(train)
    wt = {n: prob[n].to(dtype).detach().requires_grad_(n in trained)
          for n in BASE + (LORA if use_lora else ())}
    lora = [wt[n] for n in LORA] if use_lora else [None] * 6
    ids, w = prob["topk_ids"], prob["topk_weights"].to(dtype)

    def forward():
        return kt_ops.moe(x, ids, w, wt["gate_proj"], wt["up_proj"], wt["down_proj"],
                          *lora, cfg.lora_scale)

    def reset():
        x.grad = None
        for t in wt.values():
            t.grad = None
        if mode == "full":  # an optimizer step would change them: no pre-packed copies
            mark_updated_in_place(wt[n] for n in BASE)

    def grads():
        return {"hidden": x.grad, **{n: wt[n].grad for n in trained}}

    impl = Impl(name, make_step(forward, train, prob["dy"].to(dtype)), reset, grads)
    # The packed copies must not outlive the impl. Only bf16 weights are packed, and releasing
    # from the fp32 impl would also drop the bf16 impl's copies in the middle of its timing.
    impl.close = kt_ops.release_packed_weights if dtype == torch.bfloat16 else (lambda: None)
    return impl


def _build_kt_quantized(name: str, mode: str, prob, cfg) -> Impl:
    """kt.moe with bf16 activations and LoRA on the problem's base weights quantized (once per
    problem, kept in ``prob``); its errors against the bf16 reference include the weights'
    quantization error. Frozen: no full mode."""
    if mode == "full":
        raise Unavailable("quantized experts are frozen (no base-weight gradients): fwd and lora only")
    fmt, group, dtype = KT_MOE_FORMATS[name]
    weights = _quantized(prob, fmt, group)
    use_lora = mode == "lora"
    x = prob["hidden"].to(dtype).detach().requires_grad_(use_lora)
    lora = [prob[n].to(dtype).detach().requires_grad_(True) for n in LORA] if use_lora else [None] * 6
    ids, w = prob["topk_ids"], prob["topk_weights"].to(dtype)

    # nvfp4's global scales (quantize's third result), by name
    global_scales = {f"{n.replace('_proj', '')}_global_scale": weights[n][2] for n in BASE if len(weights[n]) == 3}

    def forward():
        return kt_ops.moe(x, ids, w, *(weights[n][0] for n in BASE), *lora, cfg.lora_scale,
                          *(weights[n][1] for n in BASE), **global_scales)

    def reset():
        x.grad = None
        for t in lora:
            if t is not None:
                t.grad = None

    def grads():
        return {"hidden": x.grad, **{n: t.grad for n, t in zip(LORA, lora) if use_lora}}

    impl = Impl(name, make_step(forward, use_lora, prob["dy"].to(dtype)), reset, grads)
    impl.close = lambda: None  # the quantized weights stay in prob for the other modes
    return impl


def _quantized(prob, fmt: str, group) -> Dict[str, tuple]:
    """The problem's base weights quantized to ``fmt`` ({projection: (data, scale)}), made once
    per problem and kept in ``prob`` for every impl and mode that uses them."""
    key = f"quantized-{fmt}"
    if key not in prob:
        prob[key] = {n: quantization.quantize(prob[n], fmt, group, name=n) for n in BASE}
    return prob[key]


def _build_sorted(name: str, mode: str, prob, cfg) -> Impl:
    """sorted-mm (``SortedMoE``) or grouped-mm (``GroupedMMMoE``) on the fused ``w13``."""
    trained = _trained(mode)
    cls = SortedMoE if name == "sorted-mm" else GroupedMMMoE
    model = cls(*(prob[n] for n in BASE),
                *((prob[n] for n in LORA) if mode == "lora" else ()),
                lora_scale=cfg.lora_scale, w13=prob["w13"])
    model.set_trainable(trained)
    x = prob["hidden"].detach().requires_grad_(mode != "fwd")
    return _module_impl(name, mode, model, x, prob, lambda m: m.stacked_grads(trained))


def _build_hf_loop(mode: str, prob, cfg) -> Impl:
    """The HF / PEFT-style per-expert loop (``HFLoopMoE``), on its own copies of the weights."""
    train, trained, use_lora = mode != "fwd", _trained(mode), mode == "lora"
    model = HFLoopMoE(*(prob[n] for n in BASE),
                      *((prob[n] for n in LORA) if use_lora else [None] * 6),
                      lora_scale=cfg.lora_scale)
    for pname, p in model.named_parameters():
        leaf = pname.rsplit(".", 1)[0]  # e.g. experts.3.gate_proj.lora_A
        is_lora = leaf.endswith("lora_A") or leaf.endswith("lora_B")
        p.requires_grad_(train and (is_lora if use_lora else not is_lora))
    x = prob["hidden"].detach().clone().requires_grad_(train)
    return _module_impl("hf-loop", mode, model, x, prob,
                        lambda m: m.stacked_grads(trained, prob))


def _module_impl(name: str, mode: str, model: torch.nn.Module, x: torch.Tensor, prob,
                 stacked_grads: Callable[[torch.nn.Module], Dict[str, torch.Tensor]]) -> Impl:
    """A baseline module called as ``model(x, ids, w)``; ``close`` drops the module so that its
    weights are freed."""
    held = {"model": model}
    ids, w = prob["topk_ids"], prob["topk_weights"]

    def forward():
        return held["model"](x, ids, w)

    def reset():
        x.grad = None
        held["model"].zero_grad(set_to_none=True)

    def grads():
        return {"hidden": x.grad, **stacked_grads(held["model"])}

    impl = Impl(name, make_step(forward, mode != "fwd", prob["dy"]), reset, grads)
    impl.close = held.clear
    return impl


def close_quietly(impl: Impl) -> None:
    """Reset and close ``impl``, ignoring errors: one that just raised may be half broken."""
    try:
        impl.reset()
        impl.close()
    except Exception:
        pass
