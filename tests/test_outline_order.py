"""`fxmem.outline.stable_toposort`: the graph back in topological order with the fewest moves (each node as early
as its original position allows), an ordered graph untouched, a cycle refused."""
from __future__ import annotations

import pytest
import torch
from torch import fx

from fxmem.outline import OutlineError, stable_toposort


def branches(x):
    a = x.sin()
    b = x.cos()
    c = a + 1
    d = b * 2
    return c + d


def names(graph: fx.Graph) -> list[str]:
    return [node.name for node in graph.nodes]


def test_an_ordered_graph_is_left_as_it_is():
    graph = fx.symbolic_trace(branches).graph
    before = list(graph.nodes)
    stable_toposort(graph)
    assert list(graph.nodes) == before


def test_a_node_moved_before_its_input_goes_right_after_it_and_nothing_else_moves():
    graph = fx.symbolic_trace(branches).graph
    nodes = {node.name: node for node in graph.nodes}
    nodes["x"].append(nodes["add"])  # c = a + 1 now runs before a
    assert names(graph) == ["x", "add", "sin", "cos", "mul", "add_1", "output"]
    stable_toposort(graph)
    assert names(graph) == ["x", "sin", "add", "cos", "mul", "add_1", "output"]
    graph.lint()


def test_a_moved_node_goes_back_as_early_as_its_inputs_allow():
    graph = fx.symbolic_trace(branches).graph
    nodes = {node.name: node for node in graph.nodes}
    nodes["x"].append(nodes["mul"])  # d = b * 2 first: it now comes before c = a + 1 in the original positions
    stable_toposort(graph)
    assert names(graph) == ["x", "sin", "cos", "mul", "add", "add_1", "output"]


def test_a_cycle_is_refused():
    graph = fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(torch.neg, (x,))
    second = graph.call_function(torch.add, (first, first))
    first.args = (second,)
    graph.output(second)
    with pytest.raises(OutlineError, match="cycle"):
        stable_toposort(graph)
