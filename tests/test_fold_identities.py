"""The example pass of docs/writing-a-pass.md: fold_identities, run through fxmem.transform as a user runs it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxmem
from examples.passes.fold_identities import FoldIdentities
from fxmem.pass_api import register
from fxmem.registry import REGISTRY

POLICY = {"version": 1, "passes": {"fold_identities": {"enabled": True}}}


class Identities(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(8, 8), nn.Dropout(0.0)

    def forward(self, x):
        h = self.drop((self.lin(x) * 1 / 1 - 0).to(torch.float32))  # 5 identities
        rows = torch.arange(x.shape[0]) + 0  # an integer + 0: an identity
        return (h + 0)[rows].relu()  # a float + 0 is not (-0.0 + 0 is +0.0)


@pytest.fixture
def fold_pass():
    register(FoldIdentities)  # (importing the module registered it; the fixture removes it after each test)
    yield
    REGISTRY.pop(FoldIdentities.name, None)


def test_folds_identities_exactly_and_records_each(fold_pass):
    torch.manual_seed(0)
    model, x = Identities(), torch.randn(4, 8)
    res = fxmem.transform(model, (x,), policy=POLICY)
    rec = res.records[0]
    assert rec.name == "fold_identities" and rec.status == "applied" and rec.exact, rec.reason
    assert rec.grad_deviation["ok"] and rec.train_check["compared"] and rec.train_check["ok"]
    reasons = sorted(c.reason.split(":")[0] for c in rec.changes)
    assert reasons == ["cast to its own dtype torch.float32", "dropout with p=0", "x * 1", "x + 0", "x - 0",
                       "x / 1"], reasons
    left = {n.name for n in res.module.graph.nodes}
    assert all(c.kind == "fold" and c.nodes_before[0] not in left and c.nodes_after[0] in left for c in rec.changes)
    assert sum(str(n.target) == "aten.add.Tensor" for n in res.module.graph.nodes) == 1  # the float x + 0
    torch.testing.assert_close(res.module(x), model(x), rtol=0, atol=0)


def test_casts_option_keeps_casts(fold_pass):
    policy = {"version": 1, "passes": {"fold_identities": {"enabled": True, "casts": False}}}
    res = fxmem.transform(Identities(), (torch.randn(4, 8),), policy=policy)
    assert not any(c.reason.startswith("cast") for c in res.records[0].changes)
