"""A torch.compile backend that records the forward and backward FX graphs AOTAutograd
produces (then runs them eagerly, like aot_eager)."""
from __future__ import annotations

from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


class GraphCapture:
    def __init__(self):
        self.forward_graphs = []
        self.backward_graphs = []

        def fw(gm, example_inputs):
            self.forward_graphs.append(gm)
            return make_boxed_func(gm.forward)

        def bw(gm, example_inputs):
            self.backward_graphs.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    @staticmethod
    def kt_calls(graphs) -> str:
        """The kt ops called in `graphs`, one per line, in graph order."""
        return "\n".join(str(node.target) for gm in graphs for node in gm.graph.nodes
                         if node.op == "call_function" and str(node.target).startswith("kt."))
