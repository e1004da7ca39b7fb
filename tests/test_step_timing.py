"""`fxmem.step_timing.interleaved_times`: one step of each closure per round, the order rotated every round, and
more rounds (up to a cap) until every closure has run long enough."""
from __future__ import annotations

import time

from fxmem.step_timing import interleaved_times


def test_each_round_runs_every_step_once_in_a_rotated_order():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = interleaved_times(steps, 3)
    assert calls == list("abc" "bca" "cab")
    assert {key: len(seconds) for key, seconds in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_more_rounds_until_every_step_has_run_long_enough_and_no_more_than_the_cap():
    steps = {"slow": lambda: time.sleep(0.002), "fast": lambda: None}
    times = interleaved_times(steps, 2, until_seconds=0.01, max_rounds=50)
    assert 2 <= len(times["fast"]) <= 50 and len(times["fast"]) == len(times["slow"])
    assert len(times["fast"]) == 50  # "fast" never reaches 10 ms: the cap ends it
    synced = []
    interleaved_times({"x": lambda: None}, 2, sync=lambda: synced.append(1))
    assert len(synced) == 4  # before and after each timed step
