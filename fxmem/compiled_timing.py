"""Measured step times of compiled candidates: how `passes.checkpoint.compiler_budgets` chooses.

Plans whose compiled steps all fit a byte budget differ in time by what the compiler does with them (inductor fuses
recomputed pointwise ops into backward kernels, and its own recomputation below a budget of 1 can make a step
faster), which fxmem's cost model, priced for eager execution, does not know. So the candidates are timed: each is
compiled (a copy, at its partitioner budget, no compile cache), run once (the cold compile), then timed one training
step (forward, loss, backward) each per round, the order rotated every round, on the example inputs and the device
they are on, for ROUNDS rounds and more until every candidate has run SECONDS (short steps are noisy). The
median of the rounds is a candidate's time. The modules given are left as they were: the copies
run (their buffers, batch norm's statistics, move as a step moves them), under the RNG state kept.
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from .compiled_budget import options_at
from .step import compute_loss
from .step_timing import interleaved_times
from .userstate import rng_kept

ROUNDS = 7  # timed steps per candidate at least, after its cold compile
SECONDS = 1.0  # and more rounds (up to MAX_ROUNDS) until each candidate has run this long
MAX_ROUNDS = 50


@dataclass
class Candidate:
    """A module to time and the partitioner budget it compiles at (None: the compiler's setting)."""
    module: torch.nn.Module
    compiler_budget: float | None


def compiled_step_times(candidates: dict[Hashable, Candidate], args: tuple, kwargs: dict,
                        loss_fn=None) -> dict[Hashable, float]:
    """Per candidate, the median seconds of a compiled training step (forward, loss, backward)."""
    with rng_kept(), torch.enable_grad():
        steps = {key: _compiled_step(candidate, args, kwargs, loss_fn) for key, candidate in candidates.items()}
        times = interleaved_times(steps, ROUNDS, _synchronizer(args, kwargs), until_seconds=SECONDS,
                                  max_rounds=MAX_ROUNDS)
    return {key: statistics.median(seconds) for key, seconds in times.items()}


def _compiled_step(candidate: Candidate, args: tuple, kwargs: dict, loss_fn) -> Callable[[], None]:
    """A copy of the candidate compiled at its budget, its cold compile run: one training step per call."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    module = copy.deepcopy(candidate.module)
    compiled = torch.compile(module, options=options_at(candidate.compiler_budget))

    def step():
        loss = compute_loss(loss_fn, compiled(*args, **kwargs), args, kwargs)
        loss.backward()
        for parameter in module.parameters():
            parameter.grad = None
    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
        step()  # the cold compile
    return step


def _synchronizer(args: tuple, kwargs: dict) -> Callable[[], None]:
    """CUDA: synchronize before and after each timed step (kernels run asynchronously); elsewhere nothing."""
    from torch.utils import _pytree as pytree
    cuda = any(isinstance(leaf, torch.Tensor) and leaf.is_cuda for leaf in pytree.tree_leaves((args, kwargs)))
    return torch.cuda.synchronize if cuda else (lambda: None)
