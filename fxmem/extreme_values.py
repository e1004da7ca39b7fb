"""Graph values that may hold finite numbers beyond a narrower float dtype's range.

Hugging Face builds additive attention masks from `torch.finfo(float32).min` (a `where(keep, 0, min)` node after
capture). Cast to bfloat16 or float16, that number overflows to -inf, and a query row masked in every column (a
left-padded batch's padding rows) turns from eager's uniform softmax into NaN. `beyond_range(gm, dtype)` finds
the nodes that may carry such numbers: a node with a float literal outside the dtype's finite range among its
arguments, a tensor constant holding one, and every float-valued node computed from those (conservatively: only
ops whose output is bounded stop the flow). A cast of one of them to the narrower dtype saturates
(`saturating_cast`), so the mask keeps its meaning: the narrower dtype's lowest value still masks a score out.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from .depgroups import attr_of
from .node_value import EXPORT, node_value

aten = torch.ops.aten

# ops whose output is bounded whatever their input: the flow of out-of-range values stops there
BOUNDED = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default, aten.sigmoid.default,
                     aten.tanh.default, aten.sin.default, aten.cos.default})


def _literal_beyond(arg, limit: float) -> bool:
    if isinstance(arg, (list, tuple)):
        return any(_literal_beyond(a, limit) for a in arg)
    return isinstance(arg, float) and math.isfinite(arg) and abs(arg) > limit


def _constant_beyond(graph_module: fx.GraphModule, node: fx.Node, limit: float) -> bool:
    try:
        tensor = attr_of(graph_module, str(node.target))
    except AttributeError:
        return False
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, torch.nn.Parameter) \
            or not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    finite = tensor.detach()[torch.isfinite(tensor.detach())]
    return finite.numel() > 0 and float(finite.abs().max()) > limit


def _float_valued(node: fx.Node) -> bool:
    value = node_value(node, source=EXPORT)
    return not isinstance(value, torch.Tensor) or value.is_floating_point()


def beyond_range(graph_module: fx.GraphModule, dtype: torch.dtype) -> set[fx.Node]:
    """The nodes of `graph_module` whose values may include finite numbers outside `dtype`'s finite range."""
    limit = torch.finfo(dtype).max
    found: set[fx.Node] = set()
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            if _constant_beyond(graph_module, node, limit):
                found.add(node)
            continue
        if node.op != "call_function" or node.target in BOUNDED or not _float_valued(node):
            continue
        inputs = node.all_input_nodes
        if any(n in found for n in inputs) or _literal_beyond(list(node.args) + list(node.kwargs.values()),
                                                               limit):
            found.add(node)
    return found


def saturating_cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    """`node` cast to `dtype`, its values first clamped to `dtype`'s finite range (at the insertion point)."""
    info = torch.finfo(dtype)
    clamped = graph.call_function(aten.clamp.default, (node, info.min, info.max))
    return graph.call_function(aten._to_copy.default, (clamped,), {"dtype": dtype})
