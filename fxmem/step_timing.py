"""Interleaved step timing: the one loop fxmem and its benchmarks time training steps with.

One step of each closure per round, the order rotated every round, so that load on the machine (or a slow first
kernel) hits every closure alike; `sync()` runs before and after each timed step (CUDA: synchronize, kernels run
asynchronously). No warm-up here: callers run their cold step (a compile, a first allocation) first.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable


def interleaved_times(steps: dict[Hashable, Callable[[], None]], rounds: int, sync: Callable[[], None] = lambda: None,
                      until_seconds: float = 0.0, max_rounds: int | None = None) -> dict[Hashable, list[float]]:
    """Seconds of each step per round: `rounds` rounds, and more (up to `max_rounds`) until every step has run
    `until_seconds` in all."""
    times: dict[Hashable, list[float]] = {key: [] for key in steps}
    keys = list(steps)
    for i in range(max(rounds, max_rounds or 0)):
        if i >= rounds and min(sum(seconds) for seconds in times.values()) >= until_seconds:
            break
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            sync()
            started = time.perf_counter()
            steps[key]()
            sync()
            times[key].append(time.perf_counter() - started)
    return times
