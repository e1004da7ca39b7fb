"""`value_key`: the storage a node hands on: the one its trace marked (`OpRecord.values_made`), else its last
record's output, or for a node whose ops return no tensor (a dropout with p=0 returns its input) its input's,
whichever run left the graph's example values ("fxmem_val" from a refresh, "val" from torch.export)."""
from __future__ import annotations

import operator
from types import SimpleNamespace

import pytest
import torch
from torch import fx

from fxmem.costmodel import value_key


def _record(*out_keys, values_made=None):
    return SimpleNamespace(out_keys=list(out_keys), values_made=values_made or {})


def _relu_then_identity(meta_key: str | None):
    """x -> relu -> dropout(p=0); each node's example value under `meta_key` (None: none)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.relu, (x,))
    same = graph.call_function(torch.nn.functional.dropout, (relu,), {"p": 0.0})
    graph.output(same)
    if meta_key is not None:
        for node in (x, relu, same):
            node.meta[meta_key] = torch.empty(4)
    return relu, same


@pytest.mark.parametrize("meta_key", ["fxmem_val", "val"])
def test_a_node_returning_its_input_hands_on_the_inputs_storage(meta_key):
    relu, same = _relu_then_identity(meta_key)
    by_node = {relu.name: [_record(7)], same.name: [_record()]}
    assert value_key(by_node, same) == 7


def test_without_example_values_nothing_is_guessed():
    relu, same = _relu_then_identity(None)
    by_node = {relu.name: [_record(7)], same.name: []}
    assert value_key(by_node, same) is None


def test_the_marked_record_wins_over_later_ones():
    """A composite group norm: native_group_norm makes (output, mean, rstd), then detaches the statistics; the
    trace marks the output as the node's value."""
    relu, _ = _relu_then_identity("fxmem_val")
    records = [_record(1, 2, 3, values_made={(): 1}), _record(2), _record(3)]
    assert value_key({relu.name: records}, relu) == 1
    assert value_key({relu.name: [_record(1, 2, 3), _record(2), _record(3)]}, relu) == 3  # (unmarked: the last)


def test_an_element_of_a_nodes_tuple_is_the_storage_marked_for_its_path():
    """An LSTM returns (output, (h, c)): `out[0]` and `out[1][0]` are getitems, which run no op of their own; the
    trace marks each element's storage on the record that made it (`OpRecord.values_made`)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    lstm = graph.call_function(torch.lstm, (x,))
    output = graph.call_function(operator.getitem, (lstm, 0))
    states = graph.call_function(operator.getitem, (lstm, 1))
    h = graph.call_function(operator.getitem, (states, 0))
    graph.output((output, h))
    records = [_record(5, 6, values_made={(0,): 5}), _record(8, 9, values_made={(1, 0): 8, (1, 1): 9})]
    by_node = {lstm.name: records}
    assert (value_key(by_node, output), value_key(by_node, h)) == (5, 8)
    assert value_key(by_node, states) is None  # a tuple: no one storage
