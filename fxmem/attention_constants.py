"""Constants in an attention graph: python numbers, 0-dim constant tensors, small constant subgraphs folded, and
shape-derived python scalars; the attention scale as factors of those (its example value, and the SDPA `scale`
argument emitted from it)."""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from .attention_nodes import aten, attr_value, is_op
from .node_value import SYMBOLIC, node_value


def float_const(x) -> float | None:
    """A python number, or the value of a 0-dim constant tensor (get_attr / lifted constant)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node):
        if x.op == "get_attr":
            t = attr_value(x)
            if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.requires_grad:
                return float(t.reshape(()).item())
        if is_op(x, {aten.lift_fresh_copy.default, aten.clone.default, aten.detach.default}):
            return float_const(x.args[0])
        if is_op(x, {aten.scalar_tensor.default}):
            return float_const(x.args[0])
        if is_op(x, {aten.full.default}) and not x.args[0]:
            return float_const(x.args[1])
        t = _const_tensor(x)
        if t is not None and t.numel() == 1:
            return float(t.reshape(()).item())
    return None


_RANDOM_WORDS = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "empty")


def _const_tensor(x, depth: int = 6):
    """Fold a small constant subgraph (e.g. `torch.tensor(64.).sqrt()`): every input a constant, no random ops."""
    if not isinstance(x, fx.Node):
        return x
    if x.op == "get_attr":
        t = attr_value(x)
        ok = isinstance(t, torch.Tensor) and t.numel() <= 16 and not t.requires_grad  # a learned scale is no constant
        return t.detach() if ok else None
    if depth == 0 or x.op != "call_function" or not isinstance(x.target, torch._ops.OpOverload):
        return None
    if x.target in (aten.detach_.default, aten.detach.default, aten.alias.default, aten.clone.default,
                    aten.lift_fresh_copy.default):
        return _const_tensor(x.args[0], depth - 1)
    if any(w in str(x.target) for w in _RANDOM_WORDS) or x.target._schema.is_mutable:
        return None
    args = []
    for a in x.args:
        if isinstance(a, fx.Node):
            v = _const_tensor(a, depth - 1)
            if v is None:
                return None
            args.append(v)
        elif isinstance(a, (list, tuple)) and any(isinstance(e, fx.Node) for e in a):
            return None
        else:
            args.append(a)
    if any(isinstance(v, fx.Node) for v in x.kwargs.values()):
        return None
    try:
        with torch.no_grad():
            out = x.target(*args, **x.kwargs)
    except Exception:  # noqa: BLE001 - not foldable
        return None
    return out if isinstance(out, torch.Tensor) and out.numel() <= 16 else None


def _is_scalar_node(x) -> bool:
    """A python scalar computed in the graph from shapes (SymInt/SymFloat arithmetic, sym_size)."""
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    v = node_value(x, source=SYMBOLIC)
    return isinstance(v, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(v, bool)


def _scalar_example(x) -> float | None:
    v = node_value(x)
    try:
        return float(v)
    except (TypeError, ValueError):
        try:
            return float(v.node.hint)
        except Exception:  # noqa: BLE001
            return None


def _scale_factor(x) -> float | fx.Node | None:
    """A scale operand: python number / constant 0-dim tensor -> float; shape-derived scalar -> its node."""
    c = float_const(x)
    if c is not None:
        return c
    if _is_scalar_node(x):
        return x
    return None


def is_neg_inf(x) -> bool:
    c = float_const(x)
    return c is not None and c == float("-inf")


def scale_operands(a, b, op):
    """(scale factor, scaled tensor) of a mul or div of `a` and `b`; (None, None) when neither is a scale factor."""
    if op == "mul":
        fb, fa = _scale_factor(b), _scale_factor(a)
        if fb is not None and isinstance(a, fx.Node) and not _is_scalar_node(a):
            return fb, a
        if fa is not None and isinstance(b, fx.Node) and not _is_scalar_node(b):
            return fa, b
        return None, None
    fb = _scale_factor(b)
    if fb is not None and isinstance(a, fx.Node):
        return fb, a
    return None, None


def scale_value(factors) -> float | None:
    """The product of the scale factors at the example inputs; None when one has no example value."""
    v = 1.0
    for op, f in factors:
        x = f if isinstance(f, float) else _scalar_example(f)
        if x is None:
            return None
        v = v * x if op == "mul" else v / x
    return v


def emit_scale(graph: fx.Graph, factors) -> float | fx.Node:
    """The SDPA `scale` argument: a float, or a python-scalar node computed from shape-derived factors."""
    const = 1.0
    dyn = []
    for op, f in factors:
        if isinstance(f, float):
            const = const * f if op == "mul" else const / f
        else:
            dyn.append((op, f))
    if not dyn:
        return float(const)
    cur: Any = float(const)
    for op, f in dyn:
        cur = graph.call_function(operator.mul if op == "mul" else operator.truediv, (cur, f))
    return graph.call_function(float, (cur,))
