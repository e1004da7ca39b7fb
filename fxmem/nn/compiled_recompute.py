"""Remat sites under torch.compile: checkpoints the partitioner recomputes as one region.

Under torch.compile, `remat` and `remat_call` run their op again inside a non-reentrant checkpoint, which tags it
for recomputation. Each checkpoint call gets its own activation-checkpoint graph id, and the partitioner saves any
tagged value that a later-numbered checkpoint reads (`cleanup_recompute_tags`: the boundary between two
checkpointed blocks is stashed). Eager recipes nest instead (a max pooling's recipe holds the ReLU recipe it reads,
which holds the batch norm's input), so with one id per site the compiled program kept every such boundary (a
U-Net's pooled and concatenated chains). Here every remat site's checkpoint carries one shared id, numbered after
any other region: chained sites recompute through each other as their eager recipes do, and a site that reads a
checkpoint region's output has that output saved, as in eager. A region reading a remat site's value recomputes
it (eager keeps it): fewer bytes, the site's cheap op run again. Because a context is passed, torch logs once per
process that a selective checkpoint must not hold in-place ops; this policy is the plain checkpoint's (recompute
every op), under which a chain's relu_ is safe (tests/test_checkpoint.py compiles one).

The shared id needs a torch whose checkpoint operator gives the graph id to the forward context (2.13 does:
`SHARES_REGION_ID`). Earlier ones (2.11 on the CUDA image this was checked on) number each checkpoint's nodes
themselves and never read the context's id: there every remat site is its own region, the result stays correct,
and the compiled step keeps each nested site's input as well (test_remat_compiled: 1.30 MB against 0.88 MB on a
small U-Net; the compiled-budget fit then reports the plan it cannot fit rather than missing the budget silently).
"""
from __future__ import annotations

import inspect

from torch.utils import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# after every id torch hands out (a counter from 1, one per checkpoint traced in the process)
REMAT_REGION_ID = 1 << 62

_PINNED: dict[type, type] = {}


def _context_carries_the_graph_id() -> bool:
    """Whether this torch's checkpoint operator tags a region's nodes with the forward context's graph id (the
    context's dispatch mode takes one), so that pinning the id joins the remat sites into one region."""
    mode = getattr(_torch_checkpoint, "_CachingTorchDispatchMode", None)
    return mode is not None and "ac_graph_id" in inspect.signature(mode.__init__).parameters


SHARES_REGION_ID = _context_carries_the_graph_id()


def recompute_compiled(function, *args, **kwargs):
    """`function(*args, **kwargs)` inside a non-reentrant checkpoint whose ops carry the remat region's graph id
    (call only while torch.compile traces: eager remat keeps recipes instead)."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=remat_region_contexts, **kwargs)


def remat_region_contexts():
    """The checkpoint's forward and recompute contexts: recompute every op (as a plain checkpoint does), with the
    forward context's graph id pinned to REMAT_REGION_ID (torch's checkpoint operator sets the id it numbered
    after this returns; the pinned class ignores that)."""
    forward_context, recompute_context = create_selective_checkpoint_contexts(_recompute_every_op)
    try:
        forward_context.__class__ = _pinned(type(forward_context))
    except TypeError:  # a torch whose context class cannot be subclassed so: its own id, correct, more bytes kept
        pass
    return forward_context, recompute_context


def _recompute_every_op(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _pinned(context_class: type) -> type:
    """A subclass of `context_class` whose `ac_graph_id` is REMAT_REGION_ID whatever is assigned to it."""
    pinned = _PINNED.get(context_class)
    if pinned is None:
        pinned = _PINNED[context_class] = type(f"RematRegion{context_class.__name__}", (context_class,), {
            "ac_graph_id": property(lambda self: REMAT_REGION_ID, lambda self, value: None)})
    return pinned
