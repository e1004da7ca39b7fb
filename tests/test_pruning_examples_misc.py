"""Structural pruning on the ViT, hybrid GNN+attention and GAT example files (see test_pruning_examples.py)."""
from __future__ import annotations

import pytest

from tests.test_pruning_examples import check_example

CASES = {
    "vit": (dict(), 4),  # MLPs; attention heads and the patch embedding are coupled
    "gnn_stan": (dict(), 2),  # first GCN layer chain + MLP head
    "gat": (dict(), 0),  # heads reshape every hidden dim: nothing prunable, and the pass says so
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pruning_example_misc(name):
    build, n = CASES[name]
    check_example(name, build, n)
