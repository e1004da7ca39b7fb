"""Which leaf tensors `loss.backward()` gives a gradient, read from the loss's autograd graph without running it.

A training step makes a gradient (and the optimizer its state) only for the parameters whose accumulation node
(`AccumulateGrad`) the loss's graph reaches: not for one that is registered but never called, used only under
`torch.no_grad()` or through `.detach()`, or feeding an output the loss ignores. The graph is autograd's own, so
custom autograd Functions, tied parameters and keyword arguments are followed as backward will follow them.
"""
from __future__ import annotations

import torch


def reached_leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that a backward from `tensor` accumulates a gradient into."""
    if tensor.grad_fn is None:
        return [tensor] if tensor.requires_grad else []
    seen: dict[int, object] = {}  # (holds the nodes met, so that no id is reused while the walk runs)
    todo = [tensor.grad_fn]
    leaves = []
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        todo.extend(following for following, _ in node.next_functions if following is not None)
    return leaves
