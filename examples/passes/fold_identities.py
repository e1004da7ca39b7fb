"""Fold identities: `x * 1`, `x / 1`, `x - 0`, integer `x + 0`, dropout with p = 0 and casts to the dtype a tensor
already has are replaced by their input. The graph computes the same values with fewer nodes and temporaries.

    import examples.passes.fold_identities  # registers the pass
    fxmem.transform(model, args, policy={"version": 1, "passes": {"fold_identities": {"enabled": True}}})
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from fxmem.node_value import node_value
from fxmem.ops import written_positions
from fxmem.pass_api import Change, Pass, PassContext, PassResult, register
from fxmem.program import Program, module_path

aten = torch.ops.aten
IDENTITY = {aten.mul.Tensor: ("*", 1), aten.div.Tensor: ("/", 1), aten.sub.Tensor: ("-", 0), aten.add.Tensor: ("+", 0)}
CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device)


@dataclass
class FoldOptions:
    casts: bool = True  # also fold casts to the dtype and device a tensor already has


def why_identity(node: fx.Node, options: FoldOptions) -> str | None:
    """Why `node` computes its first argument ("x * 1"), or None."""
    # the values at the example inputs (fake tensors); None for non-tensors and non-nodes
    x = node_value(node.args[0] if node.args else None, tensor_only=True)
    out = node_value(node, tensor_only=True)
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) \
            or (x.dtype, x.shape, x.device) != (out.dtype, out.shape, out.device):
        return None  # (`int_tensor * 1.0` is a float tensor: not an identity)
    if node.target in IDENTITY:
        symbol, neutral = IDENTITY[node.target]
        other = node.args[1] if len(node.args) > 1 else None
        if type(other) in (int, float) and other == neutral and (symbol != "+" or not x.is_floating_point()):
            return f"x {symbol} {other}"  # (float `x + 0` stays: -0.0 + 0 is +0.0)
    if node.target is aten.dropout.default and node.args[1] == 0:
        return "dropout with p=0"
    if options.casts and node.target in CASTS:
        kwargs = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        if not kwargs.get("copy") and kwargs.get("memory_format") is None:
            return f"cast to its own dtype {x.dtype}"
    return None


@register
class FoldIdentities(Pass):
    name = "fold_identities"
    exact = True  # the manager checks outputs, gradients and buffers against the program before the pass
    Options = FoldOptions
    extra = True  # not one of fxmem's canonical passes: it runs after them

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        changes = []
        for node in list(program.graph.nodes):
            why = why_identity(node, ctx.options) if node.op == "call_function" else None
            x = node.args[0] if why else None
            users = [*node.users, *(x.users if why else ())]
            if why is None or any(u.op == "output" or written_positions(u.target) for u in users):
                continue  # (an output keeps a tensor of its own; in-place writes would now reach x)
            node.replace_all_uses_with(x)
            program.graph.erase_node(node)
            changes.append(Change("fold", module_path(node), [node.name], [x.name], f"{why}: replaced by its input",
                                  details={"op": str(node.target)}))
        return PassResult(program, bool(changes), changes)  # the manager lints, recompiles and verifies
