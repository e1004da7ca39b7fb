"""Running a graph node by node as its generated code runs it, for the traces that watch memory."""
from __future__ import annotations

from torch import fx


class CodegenInterpreter(fx.Interpreter):
    """An fx.Interpreter that lets go of values when a GraphModule's generated code does: after their last use, and
    a value nothing reads (an RNN's final states when only its outputs are used) as soon as it is made, where
    fx.Interpreter would hold it until the whole graph has run."""

    def __init__(self, module, graph: fx.Graph | None = None):
        super().__init__(module, garbage_collect_values=True, graph=graph)
        for node in self.graph.nodes:
            if not node.users and node.op not in ("placeholder", "output"):
                self.user_to_last_uses.setdefault(node, []).append(node)
