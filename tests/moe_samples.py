"""Fresh random inputs for kt.moe, and the named sample matrix the tests run over.

``make_moe_inputs`` builds the keyword arguments of one ``kt_ops.moe`` call, with
``requires_grad`` set as a training mode would set it; ``sample_matrix`` lists the named
cases (dtypes, modes, edge shapes, layouts) that numerics and opcheck tests parametrize over.
Every call builds new tensors, so tests never share (or mutate) each other's inputs.
"""
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

MODES = ("lora", "full", "hybrid", "inference")

# Positional order of kt.moe's tensor arguments (after them comes lora_scale).
ARG_NAMES = (
    "hidden_states", "topk_ids", "topk_weights", "gate_proj", "up_proj", "down_proj",
    "gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b",
)
BASE_NAMES = ("gate_proj", "up_proj", "down_proj")
LORA_NAMES = ARG_NAMES[6:]
# Order of kt.moe_backward's output_mask / results.
GRAD_NAMES = ("hidden_states", "topk_weights") + BASE_NAMES + LORA_NAMES


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding the values of ``t`` (t itself if no dim has size > 1)."""
    for dim in reversed(range(t.dim())):
        if t.shape[dim] > 1:
            shape = list(t.shape)
            shape[dim] *= 2
            base = torch.full(shape, 7, dtype=t.dtype, device=t.device)  # junk in the gaps
            index = [slice(None)] * t.dim()
            index[dim] = slice(None, None, 2)
            view = base[tuple(index)]
            view.copy_(t)
            assert not view.is_contiguous()
            return view
    return t


def make_moe_inputs(
    T_shape: Sequence[int] = (6,),
    H: int = 16,
    I: int = 12,
    E: int = 5,
    K: int = 2,
    r: int = 0,
    dtype: torch.dtype = torch.float32,
    weights_dtype: Optional[torch.dtype] = None,
    ids_dtype: torch.dtype = torch.int64,
    mode: str = "inference",
    noncontiguous: bool = False,
    empty_experts: bool = False,
    empty_slots: bool = False,
    seed: int = 0,
    lora_scale: float = 1.5,
    device: str = "cpu",
) -> Dict[str, object]:
    """Keyword arguments of one kt_ops.moe call.

    T_shape: leading dims of hidden_states ((T,) or (B, S)); r = 0 means no LoRA.
    mode: "lora" (LoRA + hidden + topk_weights require grad), "full" (base weights + hidden +
    topk_weights; no LoRA), "hybrid" (all of them), "inference" (nothing requires grad).
    Each token gets K distinct experts; with empty_experts only a subset of the experts is
    used, so at least one expert receives no token. empty_slots sets about a third of the ids,
    and every id of token 0, to -1 (empty slots, as a sharded layer's owner receives them).
    noncontiguous makes every tensor a
    strided view with the same values.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode in ("lora", "hybrid") and r == 0:
        raise ValueError(f"mode {mode!r} needs LoRA (r > 0)")
    if mode == "full" and r != 0:
        raise ValueError("mode 'full' has no LoRA (r must be 0)")
    if K > E:
        raise ValueError("K distinct experts need K <= E")
    weights_dtype = weights_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    T = math.prod(T_shape)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    # Expert ids: K distinct experts per token, drawn from `allowed`.
    if empty_experts:
        if K >= E:
            raise ValueError("empty_experts needs K < E")
        n_allowed = max(K, E // 2)
        allowed = torch.randperm(E, generator=gen)[:n_allowed]
    else:
        allowed = torch.arange(E)
    order = torch.rand(T, len(allowed), generator=gen).argsort(dim=1)[:, :K]
    ids = allowed[order]
    if empty_slots:
        empty = torch.rand(T, K, generator=gen) < 1 / 3
        empty[:1] = True
        ids = ids.masked_fill(empty, -1)
    ids = ids.reshape(*T_shape, K).to(ids_dtype)
    weights = torch.softmax(torch.randn(T, K, generator=gen, dtype=torch.float64), dim=-1)
    weights = (weights + 0.1).reshape(*T_shape, K).to(weights_dtype)

    kwargs: Dict[str, object] = {
        "hidden_states": randn(*T_shape, H),
        "topk_ids": ids,
        "topk_weights": weights,
        "gate_proj": randn(E, I, H, scale=H ** -0.5),
        "up_proj": randn(E, I, H, scale=H ** -0.5),
        "down_proj": randn(E, H, I, scale=I ** -0.5),
    }
    if r > 0:
        for proj, out_f, in_f in (("gate", I, H), ("up", I, H), ("down", H, I)):
            kwargs[f"{proj}_lora_a"] = randn(E, r, in_f, scale=in_f ** -0.5)
            kwargs[f"{proj}_lora_b"] = randn(E, out_f, r, scale=r ** -0.5)  # nonzero: LoRA is live
        kwargs["lora_scale"] = lora_scale

    if noncontiguous:
        for name in ARG_NAMES:
            if name in kwargs:
                kwargs[name] = _noncontiguous(kwargs[name])

    trained = {
        "lora": ("hidden_states", "topk_weights") + LORA_NAMES,
        "full": ("hidden_states", "topk_weights") + BASE_NAMES,
        "hybrid": ("hidden_states", "topk_weights") + BASE_NAMES + LORA_NAMES,
        "inference": (),
    }[mode]
    for name in trained:
        if name in kwargs:
            kwargs[name].requires_grad_(True)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) and device != "cpu" else v
              for k, v in kwargs.items()}
    return kwargs


def positional(kwargs: Dict[str, object]) -> tuple:
    """kwargs of kt_ops.moe as the positional args of torch.ops.kt.moe (13 of them)."""
    return tuple(kwargs.get(n) for n in ARG_NAMES) + (float(kwargs.get("lora_scale", 1.0)),)


def grad_inputs(kwargs: Dict[str, object]) -> List[str]:
    """Names of the tensor arguments that require grad: ARG_NAMES' in their order, then any
    other (the biases) in kwargs' order."""
    names = ARG_NAMES + tuple(k for k in kwargs if k not in ARG_NAMES)
    return [n for n in names if isinstance(kwargs.get(n), torch.Tensor) and kwargs[n].requires_grad]


@dataclass(frozen=True)
class MoeSample:
    """A named case of the sample matrix; ``make()`` builds fresh inputs for it."""

    name: str
    params: Dict[str, object] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.params.get("dtype", torch.float32)

    def make(self, **overrides) -> Dict[str, object]:
        return make_moe_inputs(**{**self.params, **overrides})


def sample_matrix() -> List[MoeSample]:
    """The named cases: dtypes x modes, then edge shapes and layouts."""
    f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
    dtype_names = {f32: "fp32", bf16: "bf16", f64: "fp64"}
    samples = []
    for dtype in (f32, bf16, f64):
        for mode in MODES:
            r = 0 if mode == "full" else 3
            samples.append(MoeSample(f"{dtype_names[dtype]}-{mode}", dict(dtype=dtype, mode=mode, r=r)))
    samples += [
        MoeSample("T0-hybrid", dict(T_shape=(0,), mode="hybrid", r=3)),
        MoeSample("T0-full-bf16", dict(T_shape=(0,), mode="full", dtype=bf16)),
        MoeSample("T1-hybrid", dict(T_shape=(1,), mode="hybrid", r=3)),
        MoeSample("K1-hybrid", dict(K=1, mode="hybrid", r=3)),
        MoeSample("K=E-hybrid", dict(K=5, E=5, mode="hybrid", r=3)),
        MoeSample("empty-experts-hybrid", dict(T_shape=(3,), E=8, mode="hybrid", r=3, empty_experts=True)),
        MoeSample("empty-experts-lora-bf16", dict(T_shape=(3,), E=8, mode="lora", r=2, dtype=bf16,
                                                  empty_experts=True)),
        MoeSample("int32-ids-hybrid", dict(ids_dtype=torch.int32, mode="hybrid", r=3)),
        MoeSample("int32-ids-full-bf16", dict(ids_dtype=torch.int32, mode="full", dtype=bf16)),
        MoeSample("noncontiguous-hybrid", dict(noncontiguous=True, mode="hybrid", r=3)),
        MoeSample("noncontiguous-full-bf16", dict(noncontiguous=True, mode="full", dtype=bf16)),
        MoeSample("BSH-hybrid", dict(T_shape=(2, 3), mode="hybrid", r=3)),
        MoeSample("BSH-lora-bf16", dict(T_shape=(2, 3), mode="lora", r=2, dtype=bf16)),
        MoeSample("bf16-hidden-fp32-weights-hybrid", dict(dtype=bf16, weights_dtype=f32, mode="hybrid", r=3)),
        MoeSample("fp32-hidden-bf16-weights-full", dict(weights_dtype=bf16, mode="full")),
        MoeSample("fp32-hidden-fp64-weights-lora", dict(weights_dtype=f64, mode="lora", r=3)),
        # > 256 rows per expert: forward splits an expert's rows over several blocks.
        MoeSample("many-tokens-hybrid", dict(T_shape=(400,), E=3, K=2, mode="hybrid", r=2)),
        # Empty slots (id -1): some slots of some tokens, every slot of token 0.
        MoeSample("empty-slots-hybrid", dict(T_shape=(7,), E=4, K=3, mode="hybrid", r=3, empty_slots=True)),
        MoeSample("empty-slots-lora-bf16", dict(T_shape=(7,), E=4, K=3, mode="lora", r=2, dtype=bf16,
                                                empty_slots=True)),
        MoeSample("empty-slots-int32-full", dict(T_shape=(300,), E=3, K=2, mode="full", ids_dtype=torch.int32,
                                                 empty_slots=True)),
        # K = 0: tokens routed to no expert at all (output and hidden gradient are zero).
        MoeSample("K0-hybrid", dict(K=0, mode="hybrid", r=3)),
    ]
    return samples


SAMPLES = sample_matrix()
SAMPLE_IDS = [s.name for s in SAMPLES]
