"""Capture errors a user can act on, and PyG pooling without `size=` captured.

PyG computes sizes from tensor values (`int(batch.max()) + 1`) where the caller does not pass them. Global pooling
without `size=` is captured (the number of graphs stays a size read at run time) and pools any number of graphs as
the model does. Where a size cannot be kept symbolic, the error is one line naming the module, the PyG call and the
argument that takes the size, and torch's long output (the partial graph) is in a file the message names, never on
stderr; the CLI exits 2 with that one line.
"""
from __future__ import annotations

import copy
import os
import re
import textwrap

import pytest
import torch
from torch import nn

import fxmem
from fxmem import library_sizes
from fxmem.cli import main
from fxmem.errors import CaptureError

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.nn import GCNConv, GraphNorm, global_add_pool, global_max_pool, global_mean_pool  # noqa: E402


class _Pools(nn.Module):
    """Graph classification: a GCN layer, then add, mean and max pooling by the batch vector (no `size=`)."""

    def __init__(self):
        super().__init__()
        self.conv = GCNConv(6, 8)
        self.head = nn.Linear(24, 2)

    def forward(self, x, edge_index, batch):
        h = self.conv(x, edge_index).relu()
        pooled = [global_add_pool(h, batch), global_mean_pool(h, batch), global_max_pool(h, batch)]
        return self.head(torch.cat(pooled, dim=-1))


class _Normed(nn.Module):
    """GraphNorm by the batch vector without `batch_size=`: a size PyG reads with int(), which capture cannot keep."""

    def __init__(self):
        super().__init__()
        self.conv = GCNConv(6, 8)
        self.norm = GraphNorm(8)

    def forward(self, x, edge_index, batch):
        return self.norm(self.conv(x, edge_index), batch).sum(dim=-1)


def _graphs(sizes, seed=0):
    """(x, edge_index, batch) of a batch of random graphs with the given node counts."""
    g = torch.Generator().manual_seed(seed)
    xs, edges, batch, start = [], [], [], 0
    for i, n in enumerate(sizes):
        xs.append(torch.randn(n, 6, generator=g))
        edges.append(torch.randint(0, n, (2, 2 * n), generator=g) + start)
        batch.append(torch.full((n,), i))
        start += n
    return torch.cat(xs), torch.cat(edges, dim=1), torch.cat(batch)


def test_pyg_pooling_without_size_is_captured_and_pools_any_number_of_graphs(tmp_path):
    torch.manual_seed(0)
    model = _Pools()
    example = _graphs([5, 4, 3])
    result = fxmem.transform(model, example, policy="low")
    loaded = fxmem.load(result.save(tmp_path / "r"))
    for sizes in ([5, 4, 3], [3, 6], [4, 2, 5, 3, 2]):
        inputs = _graphs(sizes, seed=len(sizes))
        expected = model(*inputs)
        assert expected.shape == (len(sizes), 2)
        for module in (result.module, loaded):
            torch.testing.assert_close(module(*inputs), expected)
    # low is exact on a training step too: the gradients of every parameter
    inputs = _graphs([3, 6])
    got, ref = copy.deepcopy(result.module), copy.deepcopy(model)
    got(*inputs).square().sum().backward()
    ref(*inputs).square().sum().backward()
    grads = dict(got.named_parameters())
    for name, param in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, msg=name)


def test_pyg_functions_are_pyg_own_again_after_capture():
    from torch_geometric.nn.pool import glob
    from torch_geometric.utils import _scatter
    fxmem.capture(_Pools(), _graphs([2, 3]))
    assert glob.scatter is _scatter.scatter and pyg.utils.scatter is _scatter.scatter


def _one_line_naming_a_details_file(message: str) -> str:
    assert "\n" not in message.strip(), message
    found = re.search(r"partial graph: (\S+\.txt)$", message)
    assert found, message
    return found.group(1)


def test_a_size_pyg_reads_from_values_is_one_line_naming_the_module_and_the_size_argument(capfd):
    with pytest.raises(CaptureError) as info:
        fxmem.capture(_Normed(), _graphs([4, 3]))
    message = str(info.value)
    details = _one_line_naming_a_details_file(message)
    try:
        assert "in module 'norm' (GraphNorm)" in message
        assert "call GraphNorm with batch_size=" in message and "torch_geometric/nn/norm/graph_norm.py" in message
        text = open(details, encoding="utf-8").read()
        assert text.startswith(message.split("; torch's full error")[0])
        assert "GuardOnDataDependentSymNode" in text and "def forward(" in text  # torch's error and partial graph
    finally:
        os.remove(details)
    assert capfd.readouterr().err == "", "torch's output goes to the file, not to stderr"


def test_pyg_pooling_hint_names_size_where_capture_cannot_keep_it(monkeypatch):
    """Without fxmem's symbolic sizes (a PyG whose scatter fxmem does not know), the hint says what to pass."""
    monkeypatch.setattr(library_sizes, "_PYG_SCATTER", ("torch_geometric.no_such_module", "scatter"))
    with pytest.raises(CaptureError) as info:
        fxmem.capture(_Pools(), _graphs([4, 3]))
    message = str(info.value)
    os.remove(_one_line_naming_a_details_file(message))
    assert "in module '<root>' (_Pools)" in message
    assert "call global_add_pool(..., size=) the number of graphs" in message


NORMED_FILE = """
import torch
from torch_geometric.nn import GCNConv, GraphNorm


class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = GCNConv(6, 8)
        self.norm = GraphNorm(8)

    def forward(self, x, edge_index, batch):
        return self.norm(self.conv(x, edge_index), batch).sum(dim=-1)


def build_model():
    return Normed()


def example_inputs():
    x = torch.randn(7, 6)
    edge_index = torch.tensor([[0, 1, 2, 4, 5], [1, 2, 3, 5, 6]])
    return (x, edge_index, torch.tensor([0, 0, 0, 0, 1, 1, 1]))
"""


@pytest.mark.parametrize("command", ["estimate", "optimize"])
def test_cli_capture_error_is_one_line_and_exits_2(tmp_path, capfd, command):
    path = tmp_path / "normed.py"
    path.write_text(textwrap.dedent(NORMED_FILE))
    extra = ["--policy", "low", "--quiet", "--out", str(tmp_path / "out")] if command == "optimize" else []
    code = main([command, str(path), *extra])
    captured = capfd.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, captured.err
    assert lines[0].startswith("fxmem: error: could not capture Normed: in module 'norm' (GraphNorm)")
    assert "batch_size=" in lines[0]
    os.remove(_one_line_naming_a_details_file(lines[0]))
    assert not (tmp_path / "out").exists()
