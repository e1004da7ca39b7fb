"""`value_key`: the storage a node hands on: the one its trace marked (`OpRecord.node_value`), else its last
record's output, or for a node whose ops return no tensor (a dropout with p=0 returns its input) its input's,
whichever run left the graph's example values ("fxmem_val" from a refresh, "val" from torch.export)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import fx

from fxmem.costmodel import value_key


def _record(*out_keys, node_value=None):
    return SimpleNamespace(out_keys=list(out_keys), node_value=node_value)


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
    records = [_record(1, 2, 3, node_value=1), _record(2), _record(3)]
    assert value_key({relu.name: records}, relu) == 1
    assert value_key({relu.name: [_record(1, 2, 3), _record(2), _record(3)]}, relu) == 3  # (unmarked: the last)
