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


def float_const(value) -> float | None:
    """A python number, or the value of a 0-dim constant tensor (get_attr / lifted constant)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, fx.Node):
        if value.op == "get_attr":
            tensor = attr_value(value)
            if isinstance(tensor, torch.Tensor) and tensor.numel() == 1 and not tensor.requires_grad:
                return float(tensor.reshape(()).item())
        if is_op(value, {aten.lift_fresh_copy.default, aten.clone.default, aten.detach.default}):
            return float_const(value.args[0])
        if is_op(value, {aten.scalar_tensor.default}):
            return float_const(value.args[0])
        if is_op(value, {aten.full.default}) and not value.args[0]:
            return float_const(value.args[1])
        tensor = _const_tensor(value)
        if tensor is not None and tensor.numel() == 1:
            return float(tensor.reshape(()).item())
    return None


_RANDOM_WORDS = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "empty")


def _const_tensor(value, depth: int = 6):
    """Fold a small constant subgraph (e.g. `torch.tensor(64.).sqrt()`): every input a constant, no random ops."""
    if not isinstance(value, fx.Node):
        return value
    if value.op == "get_attr":
        tensor = attr_value(value)
        # a learned scale is no constant
        ok = isinstance(tensor, torch.Tensor) and tensor.numel() <= 16 and not tensor.requires_grad
        return tensor.detach() if ok else None
    if depth == 0 or value.op != "call_function" or not isinstance(value.target, torch._ops.OpOverload):
        return None
    if value.target in (aten.detach_.default, aten.detach.default, aten.alias.default, aten.clone.default,
                        aten.lift_fresh_copy.default):
        return _const_tensor(value.args[0], depth - 1)
    if any(w in str(value.target) for w in _RANDOM_WORDS) or value.target._schema.is_mutable:
        return None
    args = []
    for arg in value.args:
        if isinstance(arg, fx.Node):
            folded = _const_tensor(arg, depth - 1)
            if folded is None:
                return None
            args.append(folded)
        elif isinstance(arg, (list, tuple)) and any(isinstance(e, fx.Node) for e in arg):
            return None
        else:
            args.append(arg)
    if any(isinstance(kwarg, fx.Node) for kwarg in value.kwargs.values()):
        return None
    try:
        with torch.no_grad():
            out = value.target(*args, **value.kwargs)
    except Exception:  # noqa: BLE001 - not foldable
        return None
    return out if isinstance(out, torch.Tensor) and out.numel() <= 16 else None


def _is_scalar_node(value) -> bool:
    """A python scalar computed in the graph from shapes (SymInt/SymFloat arithmetic, sym_size)."""
    if not isinstance(value, fx.Node) or value.op != "call_function":
        return False
    example = node_value(value, source=SYMBOLIC)
    return isinstance(example, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(example, bool)


def _scalar_example(node) -> float | None:
    example = node_value(node)
    try:
        return float(example)
    except (TypeError, ValueError):
        try:
            return float(example.node.hint)
        except Exception:  # noqa: BLE001
            return None


def _scale_factor(operand) -> float | fx.Node | None:
    """A scale operand: python number / constant 0-dim tensor -> float; shape-derived scalar -> its node."""
    constant = float_const(operand)
    if constant is not None:
        return constant
    if _is_scalar_node(operand):
        return operand
    return None


def is_neg_inf(value) -> bool:
    constant = float_const(value)
    return constant is not None and constant == float("-inf")


def scale_operands(left, right, op):
    """(scale factor, scaled tensor) of a mul or div of `left` and `right`; (None, None) when neither is a scale
    factor."""
    if op == "mul":
        right_factor, left_factor = _scale_factor(right), _scale_factor(left)
        if right_factor is not None and isinstance(left, fx.Node) and not _is_scalar_node(left):
            return right_factor, left
        if left_factor is not None and isinstance(right, fx.Node) and not _is_scalar_node(right):
            return left_factor, right
        return None, None
    right_factor = _scale_factor(right)
    if right_factor is not None and isinstance(left, fx.Node):
        return right_factor, left
    return None, None


def scale_value(factors) -> float | None:
    """The product of the scale factors at the example inputs; None when one has no example value."""
    product = 1.0
    for op, factor in factors:
        factor_value = factor if isinstance(factor, float) else _scalar_example(factor)
        if factor_value is None:
            return None
        product = product * factor_value if op == "mul" else product / factor_value
    return product


def emit_scale(graph: fx.Graph, factors) -> float | fx.Node:
    """The SDPA `scale` argument: a float, or a python-scalar node computed from shape-derived factors."""
    const = 1.0
    dyn = []
    for op, factor in factors:
        if isinstance(factor, float):
            const = const * factor if op == "mul" else const / factor
        else:
            dyn.append((op, factor))
    if not dyn:
        return float(const)
    cur: Any = float(const)
    for op, factor in dyn:
        cur = graph.call_function(operator.mul if op == "mul" else operator.truediv, (cur, factor))
    return graph.call_function(float, (cur,))
