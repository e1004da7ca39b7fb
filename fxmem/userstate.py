"""The user's model comes back as it was handed over.

fxmem runs the user's model, and programs that share its parameters and buffers, for real: capture's checks, the
pipeline's verification (a seeded training step per pass), measurement. Those runs move forward-updated buffers
(batch-norm statistics, step counters, EMAs), draw from the global RNG, fill `.grad` and switch train/eval.
`keeps_model_state` is the rule at every public entry point (capture, estimate, measure, plan_batch, transform):
what `model_state_kept` records on entry is put back on exit, so the model, and a result that shares its tensors,
start from the state the user handed over. `mode_set` switches a model's mode for one run the way a user does.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .program import Program, buffers_kept


@contextlib.contextmanager
def model_state_kept(module: nn.Module | None, *, parameter_values: bool = False):
    """Put back, on exit, what running `module` (train mode, backward, optimizer steps) changes: buffer values,
    every submodule's training flag, each parameter's `.grad` (detached while inside, so nothing accumulates into
    the user's gradients) and requires_grad flag, and the global RNG states (torch CPU, initialised CUDA devices,
    seeds queued for an uninitialised CUDA).

    parameter_values: also copy the values of trainable parameters (to host memory, so a device holds no second
    copy) and put back those that changed (for callers that take optimizer steps). Otherwise parameter values are
    not copied (that would double the weights' memory): a parameter written in place while inside is named in a
    RuntimeWarning."""
    if module is None:
        with rng_kept():
            yield
        return
    with rng_kept(), buffers_kept(module), _flags_kept(module), _parameters_kept(module, parameter_values):
        yield


def keeps_model_state(entry_point=None, *, parameter_values: bool = False):
    """Decorator for an entry point whose first argument is the user's model (an nn.Module, or a Program whose
    module is kept): the call runs inside `model_state_kept` of it."""
    if entry_point is None:
        return functools.partial(keeps_model_state, parameter_values=parameter_values)

    @functools.wraps(entry_point)
    def kept(model, *args, **kwargs):
        module = model.module if isinstance(model, Program) else model
        with model_state_kept(module if isinstance(module, nn.Module) else None, parameter_values=parameter_values):
            return entry_point(model, *args, **kwargs)
    return kept


@contextlib.contextmanager
def mode_set(model: nn.Module, training: bool):
    """`model` in train (or eval) mode for a run, as the user would have it: a model already in that mode keeps
    its submodules' own flags (a batch norm or dropout the user left in eval inside a training model), otherwise
    `model.train(training)` switches every submodule. Every flag is put back afterwards."""
    with _flags_kept(model):
        if model.training != training:
            model.train(training)
        yield


@contextlib.contextmanager
def rng_kept():
    """The global RNG states (CPU generator, the CUDA generators of an initialised CUDA, and the seeds
    `torch.manual_seed` queues for a CUDA not initialised yet) are put back afterwards."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    queued = dict(vars(tracker)) if tracker is not None else None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        if queued is not None and not torch.cuda.is_initialized():
            vars(tracker).update(queued)


@contextlib.contextmanager
def _flags_kept(module: nn.Module):
    flags = [(m, m.training) for m in module.modules()]
    try:
        yield
    finally:
        for submodule, flag in flags:
            submodule.training = flag


@dataclass
class _Kept:
    name: str
    param: nn.Parameter
    grad: torch.Tensor | None
    requires_grad: bool
    version: int
    value: torch.Tensor | None  # a copy, when values are kept


@contextlib.contextmanager
def _parameters_kept(module: nn.Module, copy_values: bool):
    kept = [_Kept(name, p, p.grad, p.requires_grad, p._version,
                  p.detach().to('cpu', copy=True) if copy_values and p.requires_grad else None)
            for name, p in module.named_parameters()]
    for entry in kept:
        entry.param.grad = None
    try:
        yield
    finally:
        changed = []
        with torch.no_grad():
            for entry in kept:
                entry.param.requires_grad_(entry.requires_grad)
                entry.param.grad = entry.grad
                if entry.param._version == entry.version:
                    continue
                if entry.value is not None:
                    entry.param.copy_(entry.value)
                else:
                    changed.append(entry.name)
        if changed:
            warnings.warn(f"fxmem: running {type(module).__name__} wrote its parameter{'s' if len(changed) > 1 else ''}"
                          f" {', '.join(repr(n) for n in changed[:3])}{' and more' if len(changed) > 3 else ''} in "
                          "place (its forward writes them): their values are not those handed over (fxmem keeps no "
                          "copy of the weights)", RuntimeWarning, stacklevel=2)
