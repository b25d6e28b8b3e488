"""Python entry point of the ``kt.moe`` op."""
from typing import Optional

import torch
from torch import Tensor


def moe(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    gate_lora_a: Optional[Tensor] = None,
    gate_lora_b: Optional[Tensor] = None,
    up_lora_a: Optional[Tensor] = None,
    up_lora_b: Optional[Tensor] = None,
    down_lora_a: Optional[Tensor] = None,
    down_lora_b: Optional[Tensor] = None,
    lora_scale: float = 1.0,
    gate_scale: Optional[Tensor] = None,
    up_scale: Optional[Tensor] = None,
    down_scale: Optional[Tensor] = None,
    swiglu_limit: Optional[float] = None,
    activation: str = "silu",
    swiglu_alpha: Optional[float] = None,
    gate_bias: Optional[Tensor] = None,
    up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    gate_global_scale: Optional[Tensor] = None,
    up_global_scale: Optional[Tensor] = None,
    down_global_scale: Optional[Tensor] = None,
) -> Tensor:
    """Routed SwiGLU experts with optional LoRA; same call as ``torch.ops.kt.moe``.

    For each token ``t`` and slot ``j`` with expert ``e = topk_ids[t, j]``::

        g = x·gate_proj[e]ᵀ + s·(x·gate_lora_a[e]ᵀ)·gate_lora_b[e]ᵀ (+ gate_bias[e])
        u = x·up_proj[e]ᵀ   + s·(x·up_lora_a[e]ᵀ)·up_lora_b[e]ᵀ     (+ up_bias[e])
        h = silu(g) * u            (g <- min(g, L), u <- clamp(u, -L, L) first, given swiglu_limit=L)
                                   (g·σ(α·g)·(u + 1) with activation="swigluoai", swiglu_alpha=α)
        o = h·down_proj[e]ᵀ + s·(h·down_lora_a[e]ᵀ)·down_lora_b[e]ᵀ  (+ down_bias[e])
        y[t] = Σ_j topk_weights[t, j] · o

    with ``s = lora_scale`` (PEFT's ``alpha / r``).

    Args:
        hidden_states: ``[..., H]``, float32, bfloat16 or float64 (bf16 accumulates in fp32).
        topk_ids: ``[..., K]`` int32 or int64, each in ``[0, E)`` or ``-1``: an empty slot,
            which adds nothing to ``y`` and gets a routing-weight gradient of 0 (a sharded
            layer sends an owner the slots of other owners' experts as -1); same leading dims.
        topk_weights: ``[..., K]`` float32, bfloat16 or float64 routing weights.
        gate_proj, up_proj: ``[E, I, H]``; down_proj: ``[E, H, I]``: in the dtype of
            hidden_states, or quantized (frozen, weight-only; see :mod:`kt_ops.quantization`):
            ``float8_e4m3fn`` (fp8, 128x128 blocks), ``int8`` (per output channel) or ``uint8``
            (two values per byte: ``[E, out, in/2]``: int4, or E2M1 codes for mxfp4 / nvfp4,
            which their scales' dtype tells apart), each with its scale.
        *_lora_a: ``[E, r, in]``; *_lora_b: ``[E, out, r]`` (PEFT layout, stacked over
            experts). Give A and B together; one rank r for all adapters.
        lora_scale: the LoRA scale ``alpha / r``.
        gate_scale, up_scale, down_scale: scales of quantized base weights (float32 or
            bfloat16): fp8 ``[E, ceil(out/128), ceil(in/128)]``, int8 ``[E, out]``, int4
            ``[E, out, in/group_size]`` (group_size 32, 64 or 128); mxfp4 float8_e8m0fnu
            ``[E, out, in/32]``, nvfp4 float8_e4m3fn ``[E, out, in/16]``. None for dense weights.
        swiglu_limit: None, or ``L > 0``: gate and up are clamped first, as transformers'
            clamped SwiGLU (``swiglu_limit`` of DeepSeek-V4, GLM-5, HY-V4) computes them;
            their gradients are zero where the clamp cut (torch.clamp's).
        activation: the gate's activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU with
            GELU's tanh approximation, transformers' ``gelu_pytorch_tanh``: Gemma 4), in place
            of silu in ``h`` above, or ``"swigluoai"`` (gpt-oss's SwiGLU, vLLM's name; also
            MiniMax-M3): ``h = g·σ(α·g)·(u + 1)``, after the clamp when there is one.
        swiglu_alpha: swigluoai's ``α`` (a finite number > 0; gpt-oss: 1.702); None with
            the other activations.
        gate_bias, up_bias: ``[E, I]``; down_bias: ``[E, H]``: per-expert biases (gpt-oss's
            experts have them), in the dtype of hidden_states; each optional.
        gate_global_scale, up_global_scale, down_global_scale: nvfp4's float32 ``[E]``
            global scales (a weight is ``e2m1 · scale · global``); None for other formats.

    Returns:
        ``[..., H]`` in the dtype of ``hidden_states``.

    Differentiable in every tensor argument but ``topk_ids``; only the gradients that are
    needed are computed (frozen base + LoRA, full, hybrid, or none: then nothing is saved).
    Quantized base weights are frozen: they (and their scales) must not require grad.
    """
    return torch.ops.kt.moe(
        hidden_states, topk_ids, topk_weights, gate_proj, up_proj, down_proj,
        gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b,
        float(lora_scale), gate_scale, up_scale, down_scale,
        None if swiglu_limit is None else float(swiglu_limit), activation,
        None if swiglu_alpha is None else float(swiglu_alpha), gate_bias, up_bias, down_bias,
        gate_global_scale, up_global_scale, down_global_scale,
    )
