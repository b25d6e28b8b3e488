"""Autograd formula of ``kt.moe_forward`` (and through it of ``kt.moe``).

Forward saves its inputs and the gate/up pre-activations it returned; backward is the op
``kt.moe_backward``, so compiled backward graphs contain the real backward kernel. Arguments
are addressed by the schemas' names (csrc/ops/registration.cpp), never by position: an
argument added to both schemas travels from forward to backward without a change here.
"""
import torch

from kt_ops import quantization

_FORWARD = [a.name for a in torch.ops.kt.moe_forward.default._schema.arguments]
_BACKWARD = [a.name for a in torch.ops.kt.moe_backward.default._schema.arguments]
# kt.moe_backward's own arguments; every other one is moe_forward's argument of the same name.
_BACKWARD_OWN = ("grad_output", "activations", "output_mask")

# The differentiable inputs, in the order of kt.moe_backward's output_mask and result (the
# Grad enum of csrc/ops/moe_backward.cpp); the biases' three entries only when a bias is given.
_GRADS = ("hidden_states", "topk_weights", "gate_proj", "up_proj", "down_proj", "gate_lora_a", "gate_lora_b",
          "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b", "gate_bias", "up_bias", "down_bias")
_NUM_GRADS_WITHOUT_BIASES = 11
_BIASES = ("gate_bias", "up_bias", "down_bias")
_BASES = (("gate_proj", "gate_scale"), ("up_proj", "up_scale"), ("down_proj", "down_scale"))
assert set(_GRADS) <= set(_FORWARD) and set(_BACKWARD) - set(_BACKWARD_OWN) <= set(_FORWARD)


def _setup_context(ctx, inputs, output):
    _, activations = output
    ctx.mark_non_differentiable(activations)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the activations output
    args = dict(zip(_FORWARD, inputs))
    for weight_name, scale_name in _BASES:
        weight, scale = args[weight_name], args[scale_name]
        # Raised here, at forward time, rather than at a backward far from the cause.
        if quantization.format_of(weight, scale) is not None and (weight.requires_grad or (scale is not None and scale.requires_grad)):
            raise ValueError(f"kt.moe: {weight_name} is quantized ({weight.dtype}), so it and its scale are frozen "
                             "and cannot require grad: train LoRA adapters on it instead")
    ctx.saved_activations = args["save_activations"]
    tensors = {n: v for n, v in args.items() if isinstance(v, torch.Tensor)}
    ctx.tensor_names = list(tensors)
    ctx.others = {n: v for n, v in args.items() if n not in tensors}  # numbers, strings, absent tensors
    ctx.save_for_backward(*tensors.values(), activations)


def _backward(ctx, grad_output, _grad_activations):
    if not ctx.saved_activations:
        raise RuntimeError(
            "kt.moe_forward was called with save_activations=False, so it cannot be "
            "differentiated; call kt.moe (or save_activations=True) when gradients are needed"
        )
    *saved, activations = ctx.saved_tensors
    args = {**ctx.others, **dict(zip(ctx.tensor_names, saved))}
    # needs_input_grad leaves out trailing None inputs (torch.library flattens the inputs as a pytree)
    needs = dict(zip(_FORWARD, ctx.needs_input_grad))
    has_biases = any(args[n] is not None for n in _BIASES)
    wanted = _GRADS if has_biases else _GRADS[:_NUM_GRADS_WITHOUT_BIASES]
    output_mask = [bool(needs.get(n, False)) for n in wanted]
    if grad_output is None or not any(output_mask):
        return (None,) * len(_FORWARD)
    own = {"grad_output": grad_output.contiguous(), "activations": activations, "output_mask": output_mask}
    grads = torch.ops.kt.moe_backward(*[own[n] if n in own else args[n] for n in _BACKWARD])
    by_name = {n: g for n, g, asked in zip(wanted, grads, output_mask) if asked}
    return tuple(by_name.get(n) for n in _FORWARD)


torch.library.register_autograd("kt::moe_forward", _backward, setup_context=_setup_context)
