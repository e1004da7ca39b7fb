"""benchmarks/recompute_ops.py: the aten ops a transformed module's backward runs again, timed one by one (issue 33's
split of the recomputation), and nothing else."""
from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.eager_floor import RecomputeGraph
from benchmarks.recompute_ops import clock_steps, draw_seconds, floor_split, op_split
from fxmem.nn import recast
from fxmem.nn.checkpoint import CheckpointRegion
from fxmem.nn.dropout import DRAW_OPS
from fxmem.nn.region_graph import DROPOUTS

from .conftest import gpt_at_activation_budget, train_and_clear


@pytest.fixture(scope="module")
def gpt_12():
    """The example decoder at a 12% activation budget: regions and remat sites (`gpt_at_activation_budget`)."""
    return gpt_at_activation_budget("12%")


def test_op_split_times_the_recomputed_ops_only(gpt_12):
    ref, res, args, kwargs, loss_fn, _ = gpt_12
    module = res.module

    def step():
        train_and_clear(module, args, kwargs, loss_fn)
    step()
    split, least_step = op_split(module, step, 3)
    assert recast._recompute.__name__ == "_recompute"  # instruments off again
    # the plan recomputes matrix products in its regions; every count is a whole number of ops per step
    assert split and all(count > 0 and seconds >= 0 for count, seconds in split.values())
    assert any(name in split for name in ("addmm", "mm", "bmm"))
    assert "embedding" not in split  # (forward ops of the graph are not recomputation)
    each_least = sum(seconds for _, seconds in split.values())
    assert 0 < each_least <= least_step  # a sum of per-op minima lies at or below the least step's sum
    clocked, least_clocked = clock_steps(module, step, 3)
    assert 0 < clocked <= least_clocked  # likewise each recomputation's least against the least step
    # the captured graph recomputes nothing
    plain = copy.deepcopy(ref)
    split, least_step = op_split(plain, lambda: train_and_clear(plain, args, kwargs, loss_fn), 2)
    assert split == {} and least_step == 0.0


def test_op_split_counts_draws_where_a_region_draws_its_masks_again(gpt_12):
    _, res, args, kwargs, loss_fn, _ = gpt_12
    module = res.module
    redraws = any(not region.keep_ops & DRAW_OPS and any(n.target in DROPOUTS for n in region.body.graph.nodes)
                  for region in module.modules() if isinstance(region, CheckpointRegion))
    split, _ = op_split(module, lambda: train_and_clear(module, args, kwargs, loss_fn), 2)
    assert any(op in split for op in DRAW_OPS) == redraws
    assert (draw_seconds(split) > 0) == redraws


def test_floor_split_prices_the_floors_plan_by_graph_op():
    class Floor:  # the two things floor_split reads of an EagerFloor
        def __init__(self, graph, plan):
            self.graph, self._plan = graph, plan

        def plan(self, drop):
            return self._plan

    graph = RecomputeGraph()
    graph._add("linear", 2.0, 10, 10, False, [])
    graph._add("dropout.mask", 3.0, 10, 2, False, [])
    graph._add("dropout", 0.5, 10, 10, False, [0, 1], 0.25)
    graph._add("linear_1", 1.0, 10, 10, False, [2])

    class Node:
        def __init__(self, name, target):
            self.name, self.target, self.op = name, target, "call_function"

    class Program:
        class graph:
            nodes = [Node("linear", torch.ops.aten.linear.default), Node("dropout", torch.ops.aten.dropout.default),
                     Node("linear_1", torch.ops.aten.linear.default)]

    split = floor_split(Floor(graph, ["linear", "dropout.mask", "dropout", "linear_1"]), 0, Program)
    assert split == {"linear": (2, pytest.approx(3.0)), "dropout mask drawn again": (1, pytest.approx(3.0)),
                     "dropout": (1, pytest.approx(0.75))}
