"""Offload runtime: saved activations, frozen weights, gradients and optimizer state moved to a slower tier.

`OffloadRegion` (here) + `OffloadRuntime` (runtime): activations a region saves go to "disk" (a scratch file) or
"cpu" (pinned host memory) while it runs and come back one region ahead in backward (store, scratch).
`WeightStreamer` (weights): frozen weights streamed in block by block. `OffloadedOptimizer` (optimizer):
gradients and the optimizer step on the host. `probe_bandwidth` (bandwidth): how fast a tier is.
Design: docs/design/offload.md.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import recast
from ..regions import RegionInfo
from .bandwidth import probe_bandwidth
from .optimizer import OffloadedOptimizer
from .runtime import OffloadRuntime, RegionScope
from .scratch import SCRATCH_PREFIX, TIERS
from .store import live_scratch_dirs
from .weights import WeightStreamer

__all__ = ["OffloadRuntime", "OffloadRegion", "WeightStreamer", "OffloadedOptimizer", "probe_bandwidth",
           "SCRATCH_PREFIX", "TIERS", "live_scratch_dirs"]


def _is_fake(args) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return any(isinstance(a, FakeTensor) or (isinstance(a, torch.Tensor) and a.device.type == "meta")
               for a in pytree.tree_leaves(args))  # (an argument can be a tuple: a multi-output region's result)


class OffloadRegion(nn.Module):
    """Runs `body` with saved tensors offloaded to the runtime's tier (docs/design/offload.md).

    index: position of this region among the model's offload regions (0 starts a new step's store).
    last: the last region of the forward (drops the runtime's reference to the step's store).
    param_args: positions of arguments that are parameters/buffers (never offloaded).
    inputs_too: also offload saved tensors that are region inputs (used around checkpoint regions, whose
    inputs are the only thing they save); otherwise only tensors created inside the region are offloaded.
    checkpoint_region: around a checkpoint region, its RegionInfo: the cost model runs that region's body and
    keeps its keep_ops (None: a plain offload region, modelled by its own body).
    """

    def __init__(self, body: nn.Module, runtime: OffloadRuntime, index: int = 0, last: bool = True,
                 param_args: Iterable[int] = (), inputs_too: bool = False, label: str = "",
                 checkpoint_region: RegionInfo | None = None):
        super().__init__()
        self.body = body
        self.runtime = runtime
        self.index, self.last = int(index), bool(last)
        self.param_args = tuple(param_args)
        self.inputs_too = bool(inputs_too)
        self.label = label
        # what the cost model runs: the body, or (around a checkpoint region) the checkpoint's own body
        wraps = checkpoint_region is not None
        self.fxmem_region = RegionInfo(kind="recompute" if wraps else "offload",
                                       body=checkpoint_region.body if wraps else self.body,
                                       keep_ops=frozenset(checkpoint_region.keep_ops) if wraps else frozenset(),
                                       tier=runtime.tier, offload_inputs=wraps)

    def forward(self, *args):
        if not (self.training and torch.is_grad_enabled()) or torch.compiler.is_compiling() or _is_fake(args):
            return self.body(*args)
        runtime = self.runtime
        store = runtime.begin(self.index == 0)
        scope = RegionScope(store, store.new_slot(), self._kept_storages(args), runtime.min_bytes)
        try:
            with torch.autograd.graph.saved_tensors_hooks(scope.pack, scope.unpack), recast.aside():
                out = self.body(*args)
            scope.flush()
        except BaseException:
            runtime.abort()  # the step is abandoned: remove its scratch file now
            raise
        if self.last:
            runtime.end()
        return out

    def _kept_storages(self, args) -> set:
        """Storages this call keeps on the device (their data pointers): the arguments (all of them, or with
        `inputs_too` the parameter ones) and the body's own parameters and buffers, whose views (a Linear's
        transposed weight) autograd saves too."""
        kept = self.param_args if self.inputs_too else range(len(args))
        tensors = [a for i in kept for a in pytree.tree_leaves(args[i])]
        tensors += [*self.body.parameters(), *self.body.buffers()]
        ptrs = set()
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                try:
                    ptrs.add(tensor.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    pass
        return ptrs

    def extra_repr(self) -> str:
        return (f"label={self.label!r}, tier={self.runtime.tier!r}, index={self.index}, "
                f"prefetch={self.runtime.prefetch}, inputs_too={self.inputs_too}")
