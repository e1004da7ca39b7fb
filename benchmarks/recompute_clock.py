"""The seconds a transformed module's backward spends recomputing, clocked where it happens.

A plan's recompute time from whole steps (its step less the captured graph's, paired by round) carries this
machine's step noise: quartiles of several ms on the 100 ms decoder step (benchmarks/results/region_recipes_runs/),
more than the whole recomputation at compile@0.5-0.7's bytes. This clock times the recomputations
themselves: every outermost recipe run in backward (`fxmem.nn.recast`'s `_recompute`: remat sites, dropout
remakes, a region's closure run as recipes) and every checkpoint region's body run again by torch's checkpoint in
backward. What it leaves out is what whole steps see besides: the forward's registrations and pack hooks (per remat
site, a few Python calls) and effects on the ops around.

    clock = RecomputeClock.on(module)     # instruments `module` (its regions) and recast, until `off()`
    step(); clock.seconds                  # this step's recomputation; clock.runs: each one's seconds, in order
    clocked_seconds(module, step, 15)      # (each recomputation's least, summed; the median step)
"""
from __future__ import annotations

import time

import torch

from fxmem.nn import recast
from fxmem.nn.checkpoint import CheckpointRegion


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RecomputeClock:
    """Accumulates, in `seconds`, the wall time of the outermost recomputations while it is on (one at a time), and
    lists each in `runs`."""

    def __init__(self):
        self.seconds = 0.0
        self.runs: list[float] = []
        self._depth = 0
        self._started = 0.0
        self._handles: list = []
        self._original = None

    @classmethod
    def on(cls, module: torch.nn.Module) -> "RecomputeClock":
        clock = cls()
        clock._original = original = recast._recompute

        def clocked(recipe, private=False):
            clock._enter()
            try:
                return original(recipe, private)
            finally:
                clock._leave()
        recast._recompute = clocked
        for region in module.modules():
            if isinstance(region, CheckpointRegion):
                clock._handles.append(region.body.register_forward_pre_hook(clock._body_enter))
                clock._handles.append(region.body.register_forward_hook(clock._body_leave, always_call=True))
        return clock

    def off(self) -> None:
        recast._recompute = self._original
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def inside(self) -> bool:
        """Whether a recomputation is running now (and being clocked)."""
        return self._depth > 0

    def reset(self) -> float:
        """This step's seconds so far, and start again from zero (`runs` too)."""
        seconds, self.seconds, self.runs = self.seconds, 0.0, []
        return seconds

    def _body_enter(self, module, args):
        if _in_backward():
            self._enter()

    def _body_leave(self, module, args, output):
        if _in_backward():
            self._leave()

    def _enter(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._started = time.perf_counter()

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            seconds = time.perf_counter() - self._started
            self.seconds += seconds
            self.runs.append(seconds)


def clocked_runs(module, step, steps: int) -> tuple[list[list[float]], list[float]]:
    """`steps` steps of `module` under the clock: each step's recomputations (seconds, in order) and its total."""
    clock = RecomputeClock.on(module)
    try:
        runs, per_step = [], []
        for _ in range(steps):
            clock.reset()
            step()
            runs.append(clock.runs)
            per_step.append(clock.reset())
    finally:
        clock.off()
    return runs, per_step


def each_least(runs: list[list[float]], per_step: list[float]) -> float:
    """Each recomputation's least over the steps, summed (the least whole step when steps ran different
    recomputations)."""
    return sum(map(min, zip(*runs))) if len({len(r) for r in runs}) == 1 else min(per_step)


def clocked_seconds(module, step, steps: int) -> tuple[float, float]:
    """Seconds per step `module`'s backward spends recomputing (`RecomputeClock`) over `steps` steps: the sum of
    each recomputation's least (the floor's estimator: it sums each op's least time; the least of whole steps
    when steps ran different recomputations), and the median step."""
    runs, per_step = clocked_runs(module, step, steps)
    return each_least(runs, per_step), sorted(per_step)[len(per_step) // 2]
