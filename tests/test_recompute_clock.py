"""benchmarks/recompute_clock.py: the recomputations a transformed module's backward runs, clocked where they run
(issue 33's recompute times, apart from the step noise), and nothing else."""
from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.recompute_clock import RecomputeClock, clocked_seconds
from fxmem.nn import recast
from fxmem.nn.checkpoint import CheckpointRegion

from .conftest import gpt_at_activation_budget, train_and_clear


def test_clock_counts_backward_recomputation_and_leaves_the_module_as_it_was():
    ref, res, args, kwargs, loss_fn, _ = gpt_at_activation_budget("12%")
    module = res.module
    assert any(isinstance(m, CheckpointRegion) for m in module.modules())  # regions and remat sites both
    original = recast._recompute
    clock = RecomputeClock.on(module)
    try:
        with torch.no_grad():
            module.eval()
            module(*args, **kwargs)  # no backward: nothing recomputed
        assert clock.reset() == 0.0
        train_and_clear(module, args, kwargs, loss_fn)
        runs = clock.runs
        assert runs and clock.reset() == pytest.approx(sum(runs)) and clock.runs == []
    finally:
        clock.off()
    assert recast._recompute is original
    assert all(not m.body._forward_hooks and not m.body._forward_pre_hooks
               for m in module.modules() if isinstance(m, CheckpointRegion))
    # the captured model recomputes nothing
    plain = copy.deepcopy(ref)
    clock = RecomputeClock.on(plain)
    try:
        train_and_clear(plain, args, kwargs, loss_fn)
        assert clock.reset() == 0.0
    finally:
        clock.off()


def test_clocked_seconds_sums_each_recomputations_least():
    _, res, args, kwargs, loss_fn, _ = gpt_at_activation_budget("12%")
    module = res.module
    each_least, median = clocked_seconds(module, lambda: train_and_clear(module, args, kwargs, loss_fn), 3)
    assert 0.0 < each_least <= median
    assert recast._recompute.__name__ == "_recompute"  # instruments off again
