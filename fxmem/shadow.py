"""The float32 shadow of a program that computes in bf16 or fp16: how verification tells a rewrite's rounding from a
change of what it computes.

Two correct low-precision programs (eager attention and SDPA, say) differ by their rounding, which grows with the
model's depth and width; no fixed tolerance on their difference separates that from a bug. The shadow is a deep copy
of the program in which every bf16/fp16 parameter, buffer, graph constant, example input and dtype argument of the
graph (casts, factory ops, metadata asserts) is float32, and the dtype's finite extremes, wherever the graph or its
constants hold them, are float32's: `finfo(dtype).min` masks a score out (added to any score it stays the lowest
value) and must keep doing so (fp16's -65504 would not absorb a score in float32). Verification (`fxmem.compare`)
then asks two questions: do the shadows of the two programs agree at the policy's float32 tolerances (the rewrite
computes the same function), and is the rewrite's low-precision result no further from the float32 values than the
original's (it rounds no worse)? Costs one more run per verification run and a float32 copy of the weights, for
low-precision programs only.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .compare import LOW_PRECISION, least_precise
from .program import Program, deep_copy


def program_precision(program: Program, *trees) -> torch.dtype | None:
    """The least precise of bf16 / fp16 among the program's parameters, buffers, example inputs and `trees` (its
    outputs, gradients); None when it has neither: it computes in float32 or wider."""
    module = program.module
    tensors = list(module.parameters()) + list(module.buffers())
    return least_precise(tensors, program.example_args, program.example_kwargs, *trees)


def float32_shadow(program: Program) -> Program:
    """A deep copy of `program` computing in float32 wherever it computed in bf16 or fp16 (weights shared with
    nothing: the copy's gradients are its own)."""
    module = deep_copy(program.module)
    graphs = [sub for sub in module.modules() if isinstance(sub, fx.GraphModule)]
    extremes = _extremes(module, graphs)
    _upcast_module_tensors(module, extremes)
    for sub in graphs:
        for node in sub.graph.nodes:
            node.args, node.kwargs = _to_float32(node.args, extremes), _to_float32(node.kwargs, extremes)
        sub.recompile()
    return dataclasses.replace(program, module=module, example_args=_upcast(program.example_args),
                               example_kwargs=_upcast(program.example_kwargs))


def _upcast(tree):
    """`tree` with its bf16/fp16 tensors in float32 (each a new leaf, requires_grad kept)."""
    def up(value):
        if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
            return value.detach().float().requires_grad_(value.requires_grad)
        return value
    return pytree.tree_map(up, tree)


def _extremes(module: nn.Module, graphs: list) -> dict[float, float]:
    """The finite extremes of the bf16/fp16 dtypes the program computes in, each with float32's."""
    dtypes = {t.dtype for t in list(module.parameters()) + list(module.buffers())}
    dtypes |= {a for g in graphs for n in g.graph.nodes for a in pytree.tree_leaves((n.args, n.kwargs))
               if isinstance(a, torch.dtype)}
    wide = torch.finfo(torch.float32)
    return {value: wide_value for d in LOW_PRECISION if d in dtypes
            for value, wide_value in ((torch.finfo(d).min, wide.min), (torch.finfo(d).max, wide.max))}


def _upcast_module_tensors(module: nn.Module, extremes: dict[float, float]) -> None:
    """Every bf16/fp16 parameter, buffer and plain tensor attribute under `module`, in float32 (a constant's
    low-precision extremes as float32's); a tensor shared by several modules (tied weights) stays shared."""
    done: dict[int, torch.Tensor] = {}

    def up(tensor):
        if id(tensor) not in done:
            new = tensor.detach().float()
            if isinstance(tensor, nn.Parameter):
                done[id(tensor)] = nn.Parameter(new, requires_grad=tensor.requires_grad)
            else:
                for value, wide_value in extremes.items():
                    new = new.masked_fill(new == value, wide_value)
                done[id(tensor)] = new
        return done[id(tensor)]
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, held in table.items():
                if held is not None and held.dtype in LOW_PRECISION:
                    table[name] = up(held)
        for name, held in list(vars(sub).items()):
            if isinstance(held, torch.Tensor) and not isinstance(held, nn.Parameter) and held.dtype in LOW_PRECISION:
                setattr(sub, name, up(held))


def _to_float32(value, extremes: dict[float, float]):
    """`value` (a node's args or kwargs) with every bf16/fp16 dtype in it float32, and the low-precision extremes
    among its float literals float32's."""
    if isinstance(value, torch.dtype):
        return torch.float32 if value in LOW_PRECISION else value
    if isinstance(value, float):
        return extremes.get(value, value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(v, extremes) for v in value)
    if isinstance(value, dict):
        return {k: _to_float32(v, extremes) for k, v in value.items()}
    return value
