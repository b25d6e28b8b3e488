"""Autograd formula of ``kt.moe_forward`` (and through it of ``kt.moe``).

Forward saves its inputs and the gate/up pre-activations it returned; backward is the op
``kt.moe_backward``, so compiled backward graphs contain the real backward kernel.
"""
import torch

from kt_ops import quantization

# Order of the differentiable inputs in moe_forward's schema, and the position of each in
# kt.moe_backward's output_mask / result list.
_GRAD_INPUTS = {
    0: 0,  # hidden_states
    2: 1,  # topk_weights
    3: 2,  # gate_proj
    4: 3,  # up_proj
    5: 4,  # down_proj
    6: 5,  # gate_lora_a
    7: 6,  # gate_lora_b
    8: 7,  # up_lora_a
    9: 8,  # up_lora_b
    10: 9,  # down_lora_a
    11: 10,  # down_lora_b
}
_NUM_INPUTS = 19  # moe_forward's 12 tensors, lora_scale, save_activations, 3 scales, swiglu_limit, activation
_SCALES = slice(14, 17)  # gate_scale, up_scale, down_scale (quantized base weights only)
_BASE_NAMES = ("gate_proj", "up_proj", "down_proj")


def _setup_context(ctx, inputs, output):
    _, activations = output
    ctx.mark_non_differentiable(activations)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the activations output
    ctx.lora_scale = inputs[12]
    ctx.saved_activations = inputs[13]
    ctx.swiglu_limit, ctx.activation = inputs[17], inputs[18]
    tensors = list(inputs[:12])
    scales = list(inputs[_SCALES])
    for name, weight, scale in zip(_BASE_NAMES, tensors[3:6], scales):
        # Raised here, at forward time, rather than at a backward far from the cause.
        if quantization.format_of(weight) is not None and (weight.requires_grad or (scale is not None and scale.requires_grad)):
            raise ValueError(f"kt.moe: {name} is quantized ({weight.dtype}), so it and its scale are frozen "
                             "and cannot require grad: train LoRA adapters on it instead")
    ctx.lora_present = [t is not None for t in tensors[6:12]]
    ctx.scales_present = [t is not None for t in scales]
    ctx.save_for_backward(*[t for t in tensors + scales if t is not None], activations)


def _backward(ctx, grad_output, _grad_activations):
    if not ctx.saved_activations:
        raise RuntimeError(
            "kt.moe_forward was called with save_activations=False, so it cannot be "
            "differentiated; call kt.moe (or save_activations=True) when gradients are needed"
        )
    *saved, activations = ctx.saved_tensors
    hidden, ids, weights, gate, up, down, *optional = saved
    present = iter(optional)
    lora_tensors = [next(present) if p else None for p in ctx.lora_present]
    scales = [next(present) if p else None for p in ctx.scales_present]
    output_mask = [False] * 11
    for input_index, slot in _GRAD_INPUTS.items():
        output_mask[slot] = bool(ctx.needs_input_grad[input_index])
    if grad_output is None or not any(output_mask):
        return (None,) * _NUM_INPUTS
    grads = torch.ops.kt.moe_backward(
        grad_output.contiguous(), hidden, ids, weights, activations, gate, up, down,
        *lora_tensors, ctx.lora_scale, output_mask, *scales, ctx.swiglu_limit, ctx.activation,
    )
    result = [None] * _NUM_INPUTS
    for input_index, slot in _GRAD_INPUTS.items():
        if output_mask[slot]:
            result[input_index] = grads[slot]
    return tuple(result)


torch.library.register_autograd("kt::moe_forward", _backward, setup_context=_setup_context)
