"""Compact dropout masks: CPU `aten.dropout` draws its mask into a float tensor that autograd saves.

`compact_dropout` replaces it by `fxmem.nn.dropout.bool_mask_dropout`: the same random numbers drawn into a bool
mask and kept packed, a bit per element (bit-identical outputs and gradients, a 32nd of a float32 mask's bytes).
Recompute regions then keep those packed draws (`fxmem.nn.checkpoint.DRAW_OPS`) instead of drawing again. CUDA
runs the fused native_dropout, whose mask is bool already, so CUDA graphs are left alone.
"""
from __future__ import annotations

import torch
from torch import fx

from fxmem.nn.bitmask import packed_size
from fxmem.nn.dropout import bool_mask_dropout
from fxmem.node_value import node_value
from fxmem.pass_api import Change
from fxmem.program import Program

from .candidates import module_paths


def compact_dropout(program: Program) -> list[Change]:
    """Replace train-capable `aten.dropout` of CPU floating tensors by `fxmem.nn.dropout.bool_mask_dropout`, in
    place on `program`'s graph (the caller lints and recompiles).

    The replacement is exact (see fxmem/nn/dropout.py; the pipeline's exactness check would roll the pass back on
    a build where it is not). `train` stays the graph's (the module's .train()/.eval())."""
    graph = program.graph
    changes: list[Change] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.dropout.default:
            change = _compact(graph, node)
            if change is not None:
                changes.append(change)
    return changes


def _compact(graph: fx.Graph, node: fx.Node) -> Change | None:
    """Replace one dropout node, if it is a CPU floating one that may train; its Change, else None."""
    source = node.args[0] if node.args else node.kwargs.get("input")
    probability = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    value = node_value(source)
    if train is False or train is None or isinstance(probability, bool) \
            or not isinstance(probability, (int, float)) or not 0 < probability < 1 \
            or not isinstance(value, torch.Tensor) or value.device.type != "cpu" or not value.dtype.is_floating_point:
        return None
    scale = float(torch.ones((), dtype=value.dtype).div_(1 - probability))  # what the float mask held where it kept
    with graph.inserting_before(node):
        new = graph.create_node("call_function", bool_mask_dropout, (source, float(probability), train, scale,
                                                                   value.dtype),
                                {}, name=node.name + "_bool")
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    elements = static_numel(value)
    return Change(
        kind="checkpoint_compact_dropout", module=(module_paths(new) or ["<root>"])[-1], nodes_before=[node.name],
        nodes_after=[new.name],
        reason=f"dropout p={probability:g} on CPU: the mask autograd saves is drawn as bool and kept packed (a bit "
               f"per element instead of {value.element_size()} bytes): the same random numbers, bit-identical "
               "outputs and gradients",
        bytes_saved=elements * value.element_size() - packed_size(elements),
        details={"p": float(probability), "elements": elements or "data-dependent"})


def static_numel(value: torch.Tensor) -> int:
    """Elements of a traced value; 0 where the size depends on the data (an unbacked symbol)."""
    try:
        return int(value.numel())
    except Exception:  # noqa: BLE001 - GuardOnDataDependentSymNode and friends
        return 0
