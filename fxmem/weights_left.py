"""Large weights that int8/nf4 quantization leaves in full precision, and why.

`passes.precision.weights: int8 | nf4 | fp4` stores linear layers' weights (bitsandbytes layers), convolution
weights, embedding tables and 3-D expert weights (`fxmem.nn.quantized_weights`) quantized. What stays a parameter
(read by other ops, tied to a linear, a vector, skipped by the policy, or backed off by the accuracy guard) is
named by `weights_left`: every such parameter of at least `min_params` elements with the ops that use it and the
reason the pass gives, largest first; `describe` says it in one line for the pass's intent (report and CLI
summary), so a user who asked for 4-bit weights sees which bytes stayed where they were.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .ops import op_name

aten = torch.ops.aten
LINEAR_OPS = (aten.linear.default, aten.addmm.default)
SHOWN = 4
NOT_A_SITE = "no quantized site holds it"


@dataclass(frozen=True)
class WeightLeft:
    """One parameter no quantized layer holds: its qualified name, size, the ops that use it and why it is left."""
    name: str
    numel: int
    nbytes: int
    used_by: tuple[str, ...]
    why: str = NOT_A_SITE


def _parameter(graph_module: fx.GraphModule, target: str):
    try:
        value = graph_module.get_parameter(target)
    except AttributeError:
        return None
    return value


def feeds_a_linear(node: fx.Node) -> bool:
    """Whether `node` (a get_attr) is the weight of a linear layer (`aten.linear`, HF Conv1D's `aten.addmm`)."""
    weight_arg = {aten.linear.default: 1, aten.addmm.default: 2}
    return any(u.op == "call_function" and u.target in LINEAR_OPS and len(u.args) > weight_arg[u.target]
               and u.args[weight_arg[u.target]] is node for u in node.users)


def weights_left(graph_module: fx.GraphModule, min_params: int, why: dict[str, str] | None = None) -> list[WeightLeft]:
    """Parameters of `graph_module` with at least `min_params` elements that no linear layer uses as its weight,
    each with its reason from `why` (parameter name -> reason, NOT_A_SITE where absent)."""
    rows, seen = [], set()
    why = why or {}
    for node in graph_module.graph.nodes:
        if node.op != "get_attr" or feeds_a_linear(node):
            continue
        param = _parameter(graph_module, node.target)
        if param is None or param.numel() < min_params or id(param) in seen:
            continue
        seen.add(id(param))
        used_by = tuple(sorted({op_name(u) for u in node.users}))
        rows.append(WeightLeft(node.target, param.numel(), param.numel() * param.element_size(), used_by,
                               why.get(node.target, NOT_A_SITE)))
    return sorted(rows, key=lambda row: -row.nbytes)


def describe(rows: list[WeightLeft], graph_module: fx.GraphModule) -> str:
    """One line: how many large weights stay in full precision, their share of the parameter bytes of
    `graph_module` (the model before quantization), the largest ones with their ops and why; "" when there are
    none."""
    if not rows:
        return ""
    total = sum(p.numel() * p.element_size() for p in graph_module.parameters()) or 1
    left = sum(row.nbytes for row in rows)
    shown = "; ".join(f"{row.name} ({'/'.join(row.used_by)}): {row.why}" for row in rows[:SHOWN])
    more = f"; and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
    return (f"{len(rows)} other large weight(s) stay in full precision ({100 * left / total:.0f}% of the parameter "
            f"bytes): {shown}{more}")
