"""The cost model's entry point: the memory of a program's training step (or inference forward), static or traced."""
from __future__ import annotations

import hashlib

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..fake import static_sizes_if_needed, with_data_dependent_fallback
from ..program import Program
from ..step import OPTIMIZERS
from ..userstate import keeps_model_state
from .memory import MemoryEstimate, apply_sharding
from .static import static_estimate
from .trace import ForwardTrace, trace_forward
from .traced import traced_estimate
from .workspaces import workspace_notes

DATA_DEPENDENT_NOTE = "data-dependent sizes (e.g. boolean indexing) were taken from the example inputs' values"


def check_estimate_options(method: str, optimizer: str, world_size: int, zero_stage: int) -> None:
    """ValueError naming the option when one is out of range."""
    if method not in ("static", "traced"):
        raise ValueError(f"method must be 'static' or 'traced', got {method!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


# (ten parameters: the public estimate's keyword options, passed through unchanged)
@keeps_model_state
def estimate(program: Program, args=(), kwargs=None, *, mode: str | None = None, optimizer: str = "adamw",
             method: str = "static", world_size: int = 1, zero_stage: int = 0, loss_fn=None,
             device: str | None = None) -> MemoryEstimate:
    """Estimate the memory of a training step (or an inference forward) of `program` without allocating real
    tensors, at its example inputs or at (args, kwargs). `fxmem.estimate` captures a model first."""
    check_estimate_options(method, optimizer, world_size, zero_stage)
    if not isinstance(program, Program):
        raise TypeError(f"fxmem.costmodel.estimate takes a Program (fxmem.capture(model, args)), got "
                        f"{type(program).__name__}; fxmem.estimate(model, args) captures the model first")
    mode = mode or program.mode
    if not args and not kwargs:
        args, kwargs = program.example_args, program.example_kwargs
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = dict(kwargs or {})
    if mode == "inference":
        optimizer = "none"

    def run() -> MemoryEstimate:
        if method == "static":
            return static_estimate(program, trace_forward(program, args, kwargs, mode, loss_fn), mode, optimizer)
        return static_sizes_if_needed(
            lambda static: traced_estimate(program, args, kwargs, mode, optimizer, loss_fn, static))
    est = with_data_dependent_fallback(run, on_retry=lambda retried: retried.notes.append(DATA_DEPENDENT_NOTE))
    est.device = str(device or device_of(program.module))
    est.notes.extend(workspace_notes(program, est.device))
    if _same_objects((args, kwargs), (program.example_args, program.example_kwargs)):
        est.program_key = program_key(program)
    apply_sharding(est, world_size, zero_stage)
    return est


def estimate_from_trace(program: Program, traced: ForwardTrace, *, mode: str, optimizer: str = "adamw",
                        loss_fn=None) -> MemoryEstimate:
    """The static estimate of `program` from `traced`, what `trace_forward` returned for the same program at its
    example inputs (same mode and loss: `loss_fn` is the one it was traced with, for the record): a pass that
    traced the program already saves a second trace."""
    del loss_fn  # (the trace ran it)
    if mode == "inference":
        optimizer = "none"
    est = static_estimate(program, traced, mode, optimizer)
    est.device = str(device_of(program.module))
    est.notes.extend(workspace_notes(program, est.device))
    est.program_key = program_key(program)
    return est


def _same_objects(tree, other) -> bool:
    """Whether two input trees hold the very same objects (tensors compared by identity, not by value)."""
    leaves, spec = pytree.tree_flatten(tree)
    other_leaves, other_spec = pytree.tree_flatten(other)
    return spec == other_spec and all(a is b for a, b in zip(leaves, other_leaves))


def device_of(module) -> torch.device:
    """The device of the module's first parameter (CPU without parameters)."""
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def program_key(program: Program) -> str:
    """A fingerprint of the program's code (the root graph and every graph module under it): equal keys, same
    computation at the same example inputs, so an estimate made for one holds for the other."""
    digest = hashlib.sha1()
    for name, module in program.module.named_modules():
        if isinstance(module, fx.GraphModule):
            digest.update(name.encode())
            digest.update(module.code.encode())
    return digest.hexdigest()
