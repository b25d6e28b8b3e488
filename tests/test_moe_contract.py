"""kt.moe's contract is its schema: the ops that share its arguments (kt.moe, kt.moe_forward,
kt.moe_backward and their CPU kernels) spell them alike, and the Python entry point
kt_ops.moe takes exactly kt.moe's arguments in its order. The kernels, the composite and the
autograd formula read arguments by these names (csrc/ops/moe_args.h, kt_ops/_autograd.py), so
a drift here would be a wrong argument read, not a compile error."""
import inspect

import torch

import kt_ops

OWN = {"moe_forward": {"save_activations"}, "moe_backward": {"grad_output", "activations", "output_mask"}}


def arguments(op):
    return [(a.name, str(a.type), a.default_value if a.has_default_value() else "<none>")
            for a in getattr(torch.ops.kt, op).default._schema.arguments]


def test_the_ops_share_kt_moe_arguments_by_name_type_and_default():
    public = arguments("moe")
    for op, kernel in (("moe_forward", "_moe_forward_cpu"), ("moe_backward", "_moe_backward_cpu")):
        assert arguments(kernel) == arguments(op), kernel
        shared = [a for a in arguments(op) if a[0] not in OWN[op]]
        names = {a[0] for a in shared}
        assert names == {a[0] for a in public}, op
        mine = {a[0]: a for a in shared}
        for name, type_, default in public:
            assert mine[name][1] == type_, (op, name)
            if op == "moe_forward":  # moe_backward takes every argument explicitly (no defaults before output_mask)
                assert mine[name][2] == default, (op, name)


def test_kt_ops_moe_takes_the_schema_arguments_in_order():
    params = list(inspect.signature(kt_ops.moe).parameters)
    assert params == [a[0] for a in arguments("moe")]


def test_autograd_reads_every_shared_argument_by_name():
    from kt_ops import _autograd
    assert _autograd._FORWARD == [a[0] for a in arguments("moe_forward")]
    assert set(_autograd._GRADS) <= set(_autograd._FORWARD)
