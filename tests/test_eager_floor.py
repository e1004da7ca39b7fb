"""The eager floors of benchmarks/eager_floor.py (issue 33's yardstick): what they require of a plan, on graphs
small enough to solve by hand, and their shape on a captured decoder."""
from __future__ import annotations

import math

import pytest

import fxmem
from benchmarks.eager_floor import EagerFloor, RecomputeGraph, dependency_floor, knapsack_floor

from .conftest import example


def _graph(nodes, fixed: int = 0) -> RecomputeGraph:
    """nodes: (name, seconds, bytes backward reads, bytes to keep it, input indices[, extra seconds when it reads
    a kept input])."""
    graph = RecomputeGraph(fixed=fixed)
    for name, seconds, kept, keep, inputs, *extra in nodes:
        graph._add(name, seconds, kept, keep, keep == 0, list(inputs), *extra)
    graph.total = sum(n[2] for n in nodes) + fixed
    return graph


def test_a_recomputed_node_needs_its_input_kept_or_recomputed():
    # x -> h (dear, nobody saves it) -> y (cheap, saved): dropping y means recomputing it from h, which must then
    # be kept (as many bytes as y: nothing gained) or recomputed too
    graph = _graph([("x", 1.0, 10, 10, ()), ("h", 5.0, 0, 10, (0,)), ("y", 1.0, 10, 10, (1,))])
    assert dependency_floor(graph, 10) == pytest.approx(1.0)  # x, from nothing
    assert dependency_floor(graph, 20) == pytest.approx(7.0)  # x, h and y
    # dropping each op alone sees only y's second
    assert knapsack_floor([(1.0, 10), (1.0, 10)], 0, 20) == pytest.approx(2.0)


def test_a_view_is_kept_only_through_its_base():
    # x -> v (a view of x: no bytes of its own) -> y (saved): recomputing y reads v, so x must be there
    graph = _graph([("x", 4.0, 0, 10, ()), ("v", 0.0, 0, 0, (0,)), ("y", 1.0, 10, 10, (1,))])
    assert graph.views == [False, True, False]
    assert dependency_floor(graph, 10) == pytest.approx(5.0)  # y alone would keep x's 10 bytes instead


def test_a_recomputation_reading_a_kept_input_pays_its_backward_time():
    # x (saved, too dear to recompute) -> a -> b, both saved: recomputing a reads the kept x (+2 s); b after a
    # reads what a just made (no extra), but b alone reads a kept a (+3 s)
    graph = _graph([("x", 100.0, 10, 10, (), 0.0), ("a", 1.0, 10, 10, (0,), 2.0), ("b", 1.0, 10, 10, (1,), 3.0)])
    assert dependency_floor(graph, 10) == pytest.approx(3.0)  # a from the kept x: 1 + 2 (b alone: 4)
    assert dependency_floor(graph, 20) == pytest.approx(4.0)  # a (from x, +2), then b from the fresh a
    assert dependency_floor(graph, 10, situated=False) == pytest.approx(1.0)
    assert dependency_floor(graph, 20, situated=False) == pytest.approx(2.0)
    # a node without compute inputs reads kept tensors only (parameters, inputs): it always pays
    graph = _graph([("x", 1.0, 10, 10, (), 0.5)])
    assert dependency_floor(graph, 10) == pytest.approx(1.5)


def test_an_output_backward_does_not_read_costs_its_bytes_when_a_recomputation_reads_it():
    # m saves 10 bytes of its own making but not its 20-byte output, which c (saved, 20 bytes) is made from:
    # recomputing c from a kept m keeps m's output too (a batched matmul's product under its contiguous copy)
    graph = _graph([("m", 100.0, 10, 10, ()), ("c", 1.0, 20, 20, (0,))])
    assert dependency_floor(graph, 20) == pytest.approx(1.0)  # without the output's bytes: c alone
    graph.out_keep[0] = 20
    assert dependency_floor(graph, 20) == pytest.approx(101.0)  # c from a kept m would keep 30 bytes: m too


def test_bytes_no_plan_drops_make_the_floor_infinite():
    graph = _graph([("x", 1.0, 10, 10, ())], fixed=5)
    assert dependency_floor(graph, 10) == pytest.approx(1.0)
    assert math.isinf(dependency_floor(graph, 11))  # the fixed 5 bytes stay
    assert dependency_floor(graph, 0) == 0.0


@pytest.fixture(scope="module")
def gpt_floor():
    model, args, kwargs, loss_fn = example("gpt")
    program = fxmem.capture(model, args, kwargs)
    program.refresh()
    return program, EagerFloor.of(program, loss_fn)


def test_decoder_floor_keeps_masks_apart_and_grows_with_the_bytes_dropped(gpt_floor):
    program, floor = gpt_floor
    graph = floor.graph
    dropouts = [n.name for n in program.graph.nodes if str(n.target) == "aten.dropout.default"]
    assert dropouts and {n + ".mask" for n in dropouts} <= set(graph.names)
    masks = [graph.names.index(n + ".mask") for n in dropouts]
    # a mask is read by its dropout's remake, kept packed (a bit per element)
    assert all(graph.needed[i] and graph.seconds[i] >= 0 for i in masks)
    assert all(graph.names.index(n + ".mask") in graph.inputs[graph.names.index(n)] for n in dropouts)
    steps = [int(graph.total * f) for f in (0.0, 0.2, 0.4, 0.6, 0.8)]
    seconds = [floor.seconds(d) for d in steps]
    # (dropping nothing recomputes nothing: HiGHS's bound is zero within its tolerance)
    assert floor.plan(0) == [] and seconds[0] < 1e-6 and all(math.isfinite(s) for s in seconds)
    assert all(a <= b + 1e-9 for a, b in zip(seconds, seconds[1:])), seconds
    assert seconds[-1] > 0
    assert math.isinf(floor.seconds(graph.total))  # the loss's own saves stay


def test_decoder_backward_times_cover_saved_outputs(gpt_floor):
    from benchmarks.backward_times import backward_node_times
    program, floor = gpt_floor
    model, args, kwargs, loss_fn = example("gpt")
    times = backward_node_times(program, loss_fn, steps=1)
    ops = {n.name: str(n.target) for n in program.graph.nodes}
    # the saved outputs' producers are timed (a GELU, the layer norms, the dropouts' remakes), the forward's
    # last op's too; nothing that is not a node of the graph
    kinds = {ops[name].split(".")[1] for name in times}
    assert {"gelu", "layer_norm", "dropout", "linear"} <= kinds, kinds
    assert all(t > 0 for t in times.values()) and set(times) <= set(ops)
    # the floor charges them where a recomputation reads a kept input: never below the forward-time floor
    drop = int(floor.graph.total * 0.5)
    assert floor.seconds(drop) >= floor.forward_seconds(drop) - 1e-9
    assert any(e > 0 for e in floor.graph.extra)
    # the attention's `att @ v` saves its operands' copies, not its product, which its `contiguous` copies
    matmuls = [floor.graph.names.index(n.name) for n in program.graph.nodes if str(n.target) == "aten.matmul.default"]
    assert any(floor.graph.out_keep[i] > 0 for i in matmuls)
