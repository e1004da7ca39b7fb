"""Module runs as candidate regions (fxmem/module_runs.py): repeated calls named apart, explicit paths checked."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxmem
from fxmem.errors import PolicyError
from fxmem.module_runs import finish_runs


class _Run:
    def __init__(self, path, nodes):
        self.path, self.nodes, self.first, self.last = path, nodes, 0, 0


def test_repeated_calls_are_named_apart_and_placed():
    nodes = list("abcdef")
    runs = [_Run("pool", ["a", "b"]), _Run("fc", ["c"]), _Run("pool", ["d", "e"])]
    finish_runs(runs, nodes, None, "passes.checkpoint.regions")
    assert [(r.path, r.first, r.last) for r in runs] == [("pool", 0, 1), ("fc", 2, 2), ("pool#1", 3, 4)]
    finish_runs([_Run("pool", ["a"])], nodes, ["pool"], "passes.checkpoint.regions")  # named and present: fine


@pytest.mark.parametrize("pass_name", ["checkpoint", "offload"])
def test_an_explicit_module_without_nodes_is_refused_naming_the_key(pass_name):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    policy = {"version": 1, "passes": {pass_name: {"enabled": True, "regions": ["missing"]}}}
    with pytest.raises(PolicyError, match=rf"passes\.{pass_name}\.regions: no graph nodes belong to module\(s\) "
                                          r"\['missing'\]"):
        fxmem.transform(model, (torch.randn(4, 8),), policy=policy, budget="90%")
