"""Models built on the meta device (`with torch.device("meta"): model = ...`): sized without allocating them.

Such a model has no values, so it is captured without the check against the model. The graph torch.export records
names the meta device in its factory and conversion calls (HF models make position ids on their embeddings'
device); those are retargeted to the device the model is sized for, and the cost model's fake tensors put its
parameters there too (`fxmem.fake.meta_as_device`), so the step runs that device's kernels (their layouts, SDPA's
backend) as the materialized model would.
"""
from __future__ import annotations

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .capture import capture, first_meta_tensor
from .fake import sizing_device
from .program import Program


def capture_meta(model: nn.Module, args, kwargs, mode: str) -> Program:
    """`model` (its parameters or buffers on the meta device) captured for estimates: unchecked, retargeted to the
    device its inputs are on (the CPU when they are on meta too), and saying so in its notes."""
    where = first_meta_tensor(model, (), None)
    device = sizing_device(pytree.tree_leaves((args, kwargs)))
    # captured on meta inputs (torch.export cannot mix the devices everywhere: BatchNorm, PyG's linears), then
    # retargeted and given back the user's inputs, on which the cost model sizes it
    originals: dict[int, torch.Tensor] = {}
    program = capture(model, *_on_meta((args, kwargs), originals), mode=mode, check=False)
    program.example_args, program.example_kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: originals.get(id(t), t), (program.example_args, program.example_kwargs))
    retargeted = sum(_retarget(graph_module.graph, device) for graph_module in program.module.modules()
                     if isinstance(graph_module, fx.GraphModule))
    if retargeted:
        program.module.recompile()
    program.notes.append(f"{where} is on the meta device: captured without running the model and sized on "
                         f"{device} (estimates only, not checked against the model)")
    return program


def _on_meta(tree, originals: dict):
    """`tree` with its tensors on the meta device, one meta tensor per distinct tensor (shared inputs stay shared);
    `originals` maps each meta tensor's id to the tensor it stands for."""
    moved: dict[int, torch.Tensor] = {}

    def move(tensor):
        if id(tensor) not in moved:
            moved[id(tensor)] = tensor.to("meta")
            originals[id(moved[id(tensor)])] = tensor
        return moved[id(tensor)]
    return pytree.tree_map_only(torch.Tensor, move, tree)


def _retarget(graph: fx.Graph, device: torch.device) -> int:
    """Replace the meta device in `graph`'s call arguments by `device`; how many calls changed."""
    changed = 0
    for node in graph.nodes:
        args, kwargs = pytree.tree_map_only(torch.device, lambda d: device if d.type == "meta" else d,
                                            (node.args, node.kwargs))
        if (args, kwargs) != (node.args, node.kwargs):
            node.args, node.kwargs = args, kwargs
            changed += 1
    return changed
