"""CheckpointRegion: the module the checkpoint pass puts around a region of the graph.

    region = CheckpointRegion(body, keep_ops={"mm", "addmm"})   # body: the region's GraphModule
    y = region(x, w, b)  # train + grad: torch.utils.checkpoint(body, ..., use_reentrant=False)

In training with autograd on, only the region's inputs are kept and the body runs again in backward (RNG state
restored, or dropout masks kept by a `DrawTape`); `keep_ops` saves those ops' outputs (selective checkpointing).
With `recipes=True` (the checkpoint pass's choice where the body allows it) a training forward inside the module's
recipe scope keeps the same bytes but backward recomputes only what the region's saves read, under no_grad
(`fxmem.nn.region_recipe`).
Buffers the body updates in place are restored after the recomputation (`restore_args`). In eval mode or under
no_grad the body is simply called. `fxmem_region = RegionInfo(kind="recompute", ...)` tells the cost model.
Design: docs/design/checkpoint.md, "The runtime modules".
"""
from __future__ import annotations

import functools

import torch
from torch import fx, nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..ops import packet
from . import recast
from .dropout import DRAW_OPS, DrawTape, kept_draws
from .region_recipe import run_as_recipes
from .regions import RegionInfo


# dispatch-level ops worth keeping under selective checkpointing: matmuls, convolutions, attention kernels
MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "mkldnn_convolution",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
})


def _policy(keep: frozenset, ctx, func, *args, **kwargs):
    """Selective checkpoint policy: save the outputs of `keep` ops, recompute everything else."""
    name = packet(func)
    if name in keep or str(func) in keep:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointRegion(nn.Module):
    """Runs `body` under non-reentrant activation checkpointing in training (see the module docstring)."""

    def __init__(self, body: fx.GraphModule, keep_ops=(), label: str = "", restore_args=(), recipes: bool = False):
        super().__init__()
        self.body = body
        self.keep_ops = kept_draws(keep_ops)
        self.label = label  # the module path the region came from, for reports
        self.restore_args = tuple(restore_args)  # inputs (buffers) the body mutates: restored after recompute
        # the draw tape (forward below) holds the masks until the checkpoint lets go of the body: the end of the
        # region's backward
        self.fxmem_region = RegionInfo(kind="recompute", body=self.body, keep_ops=self.keep_ops,
                                       held_ops=self.keep_ops & DRAW_OPS,
                                       as_recipes=recipes and isinstance(body, fx.GraphModule))

    def _context_fn(self):
        # a partial of module-level functions (not a bound method): torch.compile traces it as context_fn
        return functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, self.sac_ops))

    @property
    def sac_ops(self) -> frozenset:
        """The kept ops the selective-checkpoint policy caches (kept draws replay from a DrawTape instead)."""
        return self.keep_ops - DRAW_OPS

    def forward(self, *args):
        if not (self.training and torch.is_grad_enabled()):
            return self.body(*args)
        compiling = torch.compiler.is_compiling()
        scope = None if compiling else recast.active_scope()
        if scope is not None:
            # the module's saved-tensor scope is active: recompute only what backward reads, under no_grad
            outputs = run_as_recipes(self, scope, args)
            if outputs is not None:
                return outputs
        body = self.body
        if self.restore_args and not compiling:
            body = _RestoringBody(self.body, self.restore_args)
        if self.keep_ops & DRAW_OPS and not compiling:
            body = DrawTape(body)  # the recomputation replays the forward's dropout masks instead of drawing them
        if compiling:
            return self._checkpoint(body, args)
        if recast.observed():
            return self._observed_checkpoint(body, args)
        with recast.aside():  # no recipes inside: the region decides what it keeps
            return self._checkpoint(body, args)

    def _checkpoint(self, body, args, context_fn=None):
        if not self.sac_ops:  # full recompute: the default context (passing it explicitly trips torch.compile)
            return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True)
        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=context_fn or self._context_fn())

    def _observed_checkpoint(self, body, args):
        """`_checkpoint` for `fxmem.measure.saved_tensors`: also reports what the region keeps outside saved-tensor
        hooks (the selective policy's cached outputs, the draw tape's masks)."""
        made = []

        def context_fn():
            made.append(self._context_fn()())
            return made[-1]
        with recast.aside():
            out = self._checkpoint(body, args, context_fn)
        for fwd_ctx, _ in made:  # the caching mode's store: op -> (call index ->) outputs (checkpoint's internals)
            for outs in getattr(fwd_ctx, "storage", {}).values():
                for output in (outs.values() if isinstance(outs, dict) else outs):
                    recast.observe_held(getattr(v, "val", v) for v in torch.utils._pytree.tree_leaves(output))
        if isinstance(body, DrawTape):
            recast.observe_held(body.masks)
        return out

    def extra_repr(self) -> str:
        keep = ", ".join(sorted(self.keep_ops)) if self.keep_ops else "nothing (full recompute)"
        return f"label={self.label!r}, keeps={keep}"


class _RestoringBody:
    """Calls `body`; from the second call on (the recomputation) restores the mutated inputs afterwards."""

    def __init__(self, body, restore_args):
        self.body, self.restore_args, self.calls = body, restore_args, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            return self.body(*args)
        # outside the selective-checkpoint dispatch mode, which replays exactly the forward's ops
        with _disable_current_modes(), torch.no_grad():
            saved = [(args[i], args[i].detach().clone()) for i in self.restore_args
                     if isinstance(args[i], torch.Tensor)]
        try:
            return self.body(*args)
        finally:
            with _disable_current_modes(), torch.no_grad():
                for mutated, original in saved:
                    mutated.copy_(original)
