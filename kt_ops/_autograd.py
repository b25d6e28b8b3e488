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
    20: 11,  # gate_bias
    21: 12,  # up_bias
    22: 13,  # down_bias
}
_NUM_GRADS = 11  # kt.moe_backward's output_mask without the biases' entries (14 with them)
_NUM_INPUTS = 23  # moe_forward's 12 tensors, lora_scale, save_activations, 3 scales, the gating, 3 biases
_GATING = slice(17, 20)  # swiglu_limit, activation, swiglu_alpha
_BIASES = slice(20, 23)  # gate_bias, up_bias, down_bias
_SCALES = slice(14, 17)  # gate_scale, up_scale, down_scale (quantized base weights only)
_BASE_NAMES = ("gate_proj", "up_proj", "down_proj")


def _setup_context(ctx, inputs, output):
    _, activations = output
    ctx.mark_non_differentiable(activations)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the activations output
    ctx.lora_scale = inputs[12]
    ctx.saved_activations = inputs[13]
    ctx.gating = inputs[_GATING]
    tensors = list(inputs[:12])
    scales = list(inputs[_SCALES])
    for name, weight, scale in zip(_BASE_NAMES, tensors[3:6], scales):
        # Raised here, at forward time, rather than at a backward far from the cause.
        if quantization.format_of(weight) is not None and (weight.requires_grad or (scale is not None and scale.requires_grad)):
            raise ValueError(f"kt.moe: {name} is quantized ({weight.dtype}), so it and its scale are frozen "
                             "and cannot require grad: train LoRA adapters on it instead")
    biases = list(inputs[_BIASES])
    ctx.lora_present = [t is not None for t in tensors[6:12]]
    ctx.scales_present = [t is not None for t in scales]
    ctx.biases_present = [t is not None for t in biases]
    ctx.save_for_backward(*[t for t in tensors + scales + biases if t is not None], activations)


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
    biases = [next(present) if p else None for p in ctx.biases_present]
    output_mask = [False] * len(_GRAD_INPUTS)
    for input_index, slot in _GRAD_INPUTS.items():
        # needs_input_grad leaves out trailing None inputs (torch.library flattens the inputs as a pytree)
        output_mask[slot] = input_index < len(ctx.needs_input_grad) and bool(ctx.needs_input_grad[input_index])
    if not any(ctx.biases_present):
        output_mask = output_mask[:_NUM_GRADS]  # without biases: the 11-entry mask
    if grad_output is None or not any(output_mask):
        return (None,) * _NUM_INPUTS
    grads = torch.ops.kt.moe_backward(
        grad_output.contiguous(), hidden, ids, weights, activations, gate, up, down,
        *lora_tensors, ctx.lora_scale, output_mask, *scales, *ctx.gating, *biases,
    )
    result = [None] * _NUM_INPUTS
    for input_index, slot in _GRAD_INPUTS.items():
        if slot < len(output_mask) and output_mask[slot]:
            result[input_index] = grads[slot]
    return tuple(result)


torch.library.register_autograd("kt::moe_forward", _backward, setup_context=_setup_context)
