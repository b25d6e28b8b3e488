"""Fake kernels of kt.linear and its gradient ops (csrc/ops/linear.cpp): shapes and dtypes only."""
import torch


@torch.library.register_fake("kt::linear")
def _linear_fake(x, weight, bias=None):
    torch._check(x.shape[-1] == weight.shape[1], lambda: "kt.linear: x's last dim must equal weight's in features")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("kt::linear_input_grad")
def _linear_input_grad_fake(grad, weight):
    return grad.new_empty((*grad.shape[:-1], weight.shape[1]))


@torch.library.register_fake("kt::linear_weight_grad")
def _linear_weight_grad_fake(grad, x):
    return x.new_empty((grad.shape[-1], x.shape[-1]))
