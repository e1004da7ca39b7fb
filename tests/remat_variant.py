"""A captured program as the checkpoint pass prepares it before looking for remat sites: dropout masks compacted,
with `scores` the copies matrix products make of strided operands written as nodes; then traced."""
from __future__ import annotations

from fxmem.pipeline import PassContext, pass_module
from fxmem import matmul_operands

ck = pass_module("checkpoint")


def pass_context(loss_fn) -> PassContext:
    """The context the checkpoint pass traces with (train mode, AdamW)."""
    return PassContext(policy=None, options=ck.CheckpointOptions(), mode="train", optimizer="adamw", budget=1,
                       baseline=None, enabled=("checkpoint",), loss_fn=loss_fn)


def prepared(program, loss_fn, scores: bool):
    """(a prepared copy of `program`, its pass context, its trace)."""
    ctx = pass_context(loss_fn)
    prog = program.snapshot()
    ck.compact_dropout(prog)
    if scores:
        matmul_operands.materialize_matmul_operands(prog.graph)
    prog.graph.lint()
    prog.module.recompile()
    return prog, ctx, ck.CheckpointPass._trace(prog, ctx)
