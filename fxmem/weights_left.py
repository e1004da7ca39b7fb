"""Large weights that int8/nf4 quantization leaves in full precision, and why.

bitsandbytes holds the 2-D weights of linear layers, so `passes.precision.weights: int8` swaps `aten.linear`
sites only: a CNN's convolutions, an embedding table or a mixture of experts' 3-D expert weights keep their dtype.
`weights_left` names every such parameter of at least `min_params` elements with the ops that use it, largest
first, and `describe` says it in one line for the pass's intent (report and CLI summary), so a user who asked
for 4-bit weights sees which bytes stayed where they were.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

aten = torch.ops.aten
LINEAR_OPS = (aten.linear.default, aten.addmm.default)
SHOWN = 4


@dataclass(frozen=True)
class WeightLeft:
    """One parameter no quantized layer holds: its qualified name, size and the ops that use it."""
    name: str
    numel: int
    nbytes: int
    used_by: tuple[str, ...]


def _parameter(gm: fx.GraphModule, target: str):
    try:
        value = gm.get_parameter(target)
    except AttributeError:
        return None
    return value


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "_opname", None) or getattr(target, "__name__", str(target))


def _feeds_a_linear(node: fx.Node) -> bool:
    weight_arg = {aten.linear.default: 1, aten.addmm.default: 2}
    return any(u.op == "call_function" and u.target in LINEAR_OPS and len(u.args) > weight_arg[u.target]
               and u.args[weight_arg[u.target]] is node for u in node.users)


def weights_left(gm: fx.GraphModule, min_params: int) -> list[WeightLeft]:
    """Parameters of `gm` with at least `min_params` elements that no linear layer uses as its weight."""
    rows, seen = [], set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or _feeds_a_linear(node):
            continue
        param = _parameter(gm, node.target)
        if param is None or param.numel() < min_params or id(param) in seen:
            continue
        seen.add(id(param))
        used_by = tuple(sorted({_op_name(u) for u in node.users}))
        rows.append(WeightLeft(node.target, param.numel(), param.numel() * param.element_size(), used_by))
    return sorted(rows, key=lambda row: -row.nbytes)


def describe(rows: list[WeightLeft], gm: fx.GraphModule) -> str:
    """One line: how many large weights stay in full precision, their share of the parameter bytes, the largest
    ones with their ops, and why; "" when there are none."""
    if not rows:
        return ""
    total = sum(p.numel() * p.element_size() for p in gm.parameters()) or 1
    left = sum(row.nbytes for row in rows)
    shown = ", ".join(f"{row.name} ({'/'.join(row.used_by)})" for row in rows[:SHOWN])
    more = f" and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
    return (f"{len(rows)} other large weight(s) stay in full precision ({100 * left / total:.0f}% of the parameter "
            f"bytes): {shown}{more}; bitsandbytes quantizes linear layers' weights only")
