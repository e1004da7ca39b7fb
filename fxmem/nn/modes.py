"""Train/eval switching for captured graphs.

`torch.export` bakes `training=True/False` into dropout and batch-norm calls. fxmem makes those arguments read
the GraphModule's own `training` flag through a `ModeFlag` submodule, so `.train()` / `.eval()` behave as they
do on the user's module.
"""
from __future__ import annotations

import torch
from torch import nn


class ModeFlag(nn.Module):
    """Returns the module's `training` flag; `.train()`/`.eval()` on the parent propagate to it."""

    def forward(self) -> bool:
        return self.training


def count_batch(num_batches_tracked: torch.Tensor, training: bool) -> torch.Tensor:
    """Batch-norm's `num_batches_tracked += 1`, which only happens in training mode.

    Not under FakeTensorMode: shape propagation and the traced cost model run the graph on fake inputs with the
    module's real buffers, and must not count a batch the user never ran. Under torch.compile the compiled graph
    counts (the dispatch-mode query is not traceable: checking it would break the graph)."""
    if training and (torch.compiler.is_compiling()
                     or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None):
        num_batches_tracked.add_(1)
    return num_batches_tracked


torch.fx.wrap("count_batch")
