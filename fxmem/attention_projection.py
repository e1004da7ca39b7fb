"""Where q or k of an attention site comes from: the heads of a linear layer (`trace_projection`)."""
from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from .attention_nodes import aten, is_op, norm_dim, shape


@dataclass
class Projection:
    """Where q or k comes from: heads of a linear layer `x @ W[rows]^T + b[rows]`, viewed as (B, H, T, dh)."""
    x: fx.Node
    weight: fx.Node  # get_attr
    bias: fx.Node | None
    offset: int  # first output row of this projection in W (fused qkv layers)
    heads: int
    head_dim: int


def trace_projection(n: fx.Node) -> Projection | None:
    """q/k = linear(x, W, b)[..., rows].view(B, T, H, dh).transpose(1, 2), with an optional split of a fused qkv."""
    if not is_op(n, {aten.transpose.int}) or {norm_dim(n.args[1], 4), norm_dim(n.args[2], 4)} != {1, 2}:
        return None
    v = n.args[0]
    if not is_op(v, {aten.view.default, aten.reshape.default, aten._unsafe_view.default}):
        return None
    s4 = shape(v)
    if s4 is None or len(s4) != 4:
        return None
    src, offset = v.args[0], 0
    if src.op == "call_function" and src.target is operator.getitem and is_op(src.args[0], {aten.split.Tensor}):
        sp, i = src.args[0], src.args[1]
        dim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
        size = sp.args[1]
        if not isinstance(size, int) or norm_dim(dim, 3) != 2:
            return None
        offset, src = i * size, sp.args[0]
    if not is_op(src, {aten.linear.default}):
        return None
    x, w = src.args[0], src.args[1]
    b = src.args[2] if len(src.args) > 2 else None
    if not (isinstance(w, fx.Node) and w.op == "get_attr") or (b is not None and not (
            isinstance(b, fx.Node) and b.op == "get_attr")):
        return None
    return Projection(x=x, weight=w, bias=b, offset=offset, heads=s4[2], head_dim=s4[3])
