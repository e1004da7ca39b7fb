"""Searches for what fits a budget: the largest batch (`plan_batch`), the shortest prefix of candidates."""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from ..errors import InputShapeError, first_line
from ..program import Program
from ..userstate import keeps_model_state
from .estimator import estimate


# (thirteen parameters: the public plan_batch's keyword options, passed through unchanged)
@keeps_model_state
def plan_batch(program: Program, args=(), kwargs=None, *, budget: int, mode: str | None = None,
               optimizer: str = "adamw", loss_fn=None, batch_dim: int = 0, device: str = "cpu",
               context_bytes: int | None = None, fragmentation: float | None = None, max_batch: int = 1 << 16,
               method: str = "static") -> dict:
    """The largest batch size whose estimated peak fits `budget` bytes (`fxmem.plan_batch` captures a model first).

    Reserve: on CUDA 500 MB for the context and 10% for fragmentation by default; on CPU none.
    Inputs are scaled along `batch_dim` (every tensor input whose size there equals the example's batch).
    Returns {"batch": n, "peak": bytes, "usable": bytes, "per_sample": bytes}.
    """
    if context_bytes is None:
        context_bytes = 500 * 10 ** 6 if str(device).startswith("cuda") else 0
    if fragmentation is None:
        fragmentation = 0.10 if str(device).startswith("cuda") else 0.0
    usable = int((budget - context_bytes) * (1.0 - fragmentation))
    args, kwargs = (args or program.example_args), (kwargs or program.example_kwargs)
    example_batch = batch_size(args, kwargs, batch_dim)

    @functools.cache
    def peak_at(batch: int) -> int:
        scaled_args, scaled_kwargs = scaled_inputs(args, kwargs, batch_dim, batch)
        try:
            return estimate(program, scaled_args, scaled_kwargs, mode=mode, optimizer=optimizer, method=method,
                            loss_fn=loss_fn).peak
        except (RuntimeError, IndexError) as error:
            if batch == example_batch or not _runs_at(program, args, kwargs, mode, loss_fn):
                raise  # not the scaling: the example inputs fail too
            raise InputShapeError(
                f"plan_batch: the model rejects its inputs scaled to batch {batch} along dim {batch_dim} (the inputs "
                f"of size {example_batch} there, rows repeated): {type(error).__name__}: {first_line(str(error))}; "
                "inputs whose rows are not independent samples (a graph's node features beside its edge_index) "
                "cannot be scaled so: estimate at the sizes you plan instead") from error

    peak_one = peak_at(1)
    if peak_one > usable:
        return {"batch": 0, "peak": peak_one, "usable": usable, "per_sample": None}
    per_sample = max(1, peak_at(2) - peak_one)
    guess = max(1, min(max_batch, 1 + (usable - peak_one) // per_sample))  # linear in the batch from the first two
    batch = largest_fitting(lambda n: peak_at(n) <= usable, guess, max_batch)
    return {"batch": batch, "peak": peak_at(batch), "usable": usable, "per_sample": per_sample}


def batch_size(args, kwargs, batch_dim: int = 0) -> int:
    """The batch size of example inputs: the size along `batch_dim` of their first tensor that has that dim."""
    flat = pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    size = next((t.shape[batch_dim] for t in flat if isinstance(t, torch.Tensor) and t.dim() > batch_dim), None)
    if size is None:
        raise ValueError("no tensor input has a batch dim to scale")
    return size


def scaled_inputs(args, kwargs, batch_dim: int, batch: int) -> tuple[tuple, dict]:
    """(args, kwargs) with every tensor whose size along `batch_dim` is the example batch grown (or cut) to `batch`
    rows, the example's rows repeated in order."""
    example_batch = batch_size(args, kwargs, batch_dim)
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    scaled = []
    for tensor in flat:
        if isinstance(tensor, torch.Tensor) and tensor.dim() > batch_dim and tensor.shape[batch_dim] == example_batch:
            rows = torch.arange(batch, device=tensor.device) % example_batch
            tensor = tensor.index_select(batch_dim, rows)
        scaled.append(tensor)
    return pytree.tree_unflatten(scaled, spec)


def _runs_at(program: Program, args, kwargs, mode, loss_fn) -> bool:
    """Whether the cost model runs the program at these (the example) inputs."""
    try:
        estimate(program, args, kwargs, mode=mode, loss_fn=loss_fn)
    except (RuntimeError, IndexError):
        return False
    return True


def largest_fitting(fits: Callable[[int], bool], guess: int, limit: int) -> int:
    """The largest n in [1, limit] with fits(n), for a `fits` true up to some n and false after (fits(1) true).

    Brackets the answer from `guess` in steps that start at a tenth of it and double (down while it does not
    fit, up while it does), then bisects: a guess off by a factor costs a few evaluations more, not a smaller
    answer."""
    candidate, step = min(max(1, guess), limit), max(1, guess // 10)
    if fits(candidate):
        fitting, failing = candidate, limit + 1
        while fitting < limit:
            candidate = min(limit, fitting + step)
            if not fits(candidate):
                failing = candidate
                break
            fitting, step = candidate, 2 * step
    else:
        fitting, failing = 1, candidate
        while failing - step > 1:
            candidate = failing - step
            if fits(candidate):
                fitting = candidate
                break
            failing, step = candidate, 2 * step
    while failing - fitting > 1:
        mid = (fitting + failing) // 2
        if fits(mid):
            fitting = mid
        else:
            failing = mid
    return fitting


def smallest_fitting_prefix(count: int, peak_of, budget: int) -> int:
    """The smallest k in 1..count with peak_of(k) <= budget, by bisection (a pass applies its candidates in order,
    so the peak falls as k grows); count when even all do not fit. Passes call this with their own peak_of."""
    if peak_of(count) > budget:
        return count
    low, high = 1, count
    while low < high:
        mid = (low + high) // 2
        if peak_of(mid) <= budget:
            high = mid
        else:
            low = mid + 1
    return low
