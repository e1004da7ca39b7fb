"""Sizing a model or a program without running it: `fxmem.estimate` and `fxmem.plan_batch`, which capture a model
first (a model built on the meta device for estimates only, `fxmem.meta_models`)."""
from __future__ import annotations

from torch import nn

from . import costmodel
from .capture import capture, first_meta_tensor
from .meta_models import capture_meta
from .program import Program
from .userstate import keeps_model_state


def as_program(model_or_program, args=(), kwargs=None, mode: str | None = None) -> Program:
    """A Program as it is, or a model captured at (args, kwargs) in `mode` (default train); a model built on the
    meta device is captured for estimates (`fxmem.meta_models`)."""
    if isinstance(model_or_program, Program):
        return model_or_program
    if isinstance(model_or_program, nn.Module) and first_meta_tensor(model_or_program, (), None):
        return capture_meta(model_or_program, args, kwargs, mode or "train")
    return capture(model_or_program, args, kwargs, mode=mode or "train")


# (ten parameters: keyword options of the cost model's estimate, passed through)
@keeps_model_state
def estimate(model_or_program, args=(), kwargs=None, *, mode: str | None = None, optimizer: str = "adamw",
             method: str = "static", world_size: int = 1, zero_stage: int = 0, loss_fn=None,
             device: str | None = None) -> costmodel.MemoryEstimate:
    """Estimate the memory of a training step (or an inference forward) without allocating real tensors: a model
    is captured at (args, kwargs) first, a Program is estimated as it is (see `fxmem.costmodel.estimate`)."""
    costmodel.check_estimate_options(method, optimizer, world_size, zero_stage)
    program = as_program(model_or_program, args, kwargs, mode)
    return costmodel.estimate(program, args, kwargs, mode=mode, optimizer=optimizer, method=method,
                              world_size=world_size, zero_stage=zero_stage, loss_fn=loss_fn, device=device)


# (thirteen parameters: keyword options of the cost model's plan_batch, passed through)
@keeps_model_state
def plan_batch(model_or_program, args=(), kwargs=None, *, budget: int, mode: str | None = None,
               optimizer: str = "adamw", loss_fn=None, batch_dim: int = 0, device: str = "cpu",
               context_bytes: int | None = None, fragmentation: float | None = None, max_batch: int = 1 << 16,
               method: str = "static") -> dict:
    """The largest batch size whose estimated peak fits `budget` bytes: a model is captured at (args, kwargs)
    first (see `fxmem.costmodel.plan_batch`)."""
    program = as_program(model_or_program, args, kwargs, mode)
    return costmodel.plan_batch(program, args, kwargs, budget=budget, mode=mode, optimizer=optimizer,
                                loss_fn=loss_fn, batch_dim=batch_dim, device=device, context_bytes=context_bytes,
                                fragmentation=fragmentation, max_batch=max_batch, method=method)
