"""Where q or k of an attention site comes from: the heads of a linear layer (`trace_projection`)."""
from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from .attention_nodes import aten, is_op, norm_dim, shape


@dataclass
class Projection:
    """Where q or k comes from: heads of a linear layer `input_node @ W[rows]^T + b[rows]`, viewed as (B, H, T,
    dh)."""
    input_node: fx.Node
    weight: fx.Node  # get_attr
    bias: fx.Node | None
    offset: int  # first output row of this projection in W (fused qkv layers)
    heads: int
    head_dim: int


def trace_projection(node: fx.Node) -> Projection | None:
    """q/k = linear(x, W, b)[..., rows].view(B, T, H, dh).transpose(1, 2), with an optional split of a fused qkv."""
    if not is_op(node, {aten.transpose.int}) or {norm_dim(node.args[1], 4), norm_dim(node.args[2], 4)} != {1, 2}:
        return None
    view = node.args[0]
    if not is_op(view, {aten.view.default, aten.reshape.default, aten._unsafe_view.default}):
        return None
    view_shape = shape(view)
    if view_shape is None or len(view_shape) != 4:
        return None
    src, offset = view.args[0], 0
    if src.op == "call_function" and src.target is operator.getitem and is_op(src.args[0], {aten.split.Tensor}):
        split, chunk_index = src.args[0], src.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        size = split.args[1]
        if not isinstance(size, int) or norm_dim(dim, 3) != 2:
            return None
        offset, src = chunk_index * size, split.args[0]
    if not is_op(src, {aten.linear.default}):
        return None
    input_node, weight = src.args[0], src.args[1]
    bias = src.args[2] if len(src.args) > 2 else None
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr") or (bias is not None and not (
            isinstance(bias, fx.Node) and bias.op == "get_attr")):
        return None
    return Projection(input_node=input_node, weight=weight, bias=bias, offset=offset, heads=view_shape[2],
                      head_dim=view_shape[3])
