"""The op table's save rules (`fxmem.ops.saved`) against what autograd really keeps: for each op call here, the
storages its rule names (inputs, outputs, the tensors of a list argument) are the storages autograd's saved-tensor
hooks see packed, no more, no fewer. These are the rules a mixture-of-experts router and its dispatch run on
(topk, index, index_add): before, topk was said to keep its input where it keeps its indices, index and index_put
kept nothing (their indices sit in a list), index_add missed its source, std and norms their result, gather its
input (Mixtral's activations 1.3% under the measured ones), scatter_reduce and index_reduce their self and result
(PyG's PNA 4% under), hardtanh (ReLU6) and threshold their input, not their result."""
from __future__ import annotations

import pytest
import torch

from fxmem import ops as optable

aten = torch.ops.aten


def _x():
    return torch.randn(4, 6, requires_grad=True)


def _index():
    return torch.tensor([0, 2, 1])


def _source():
    return torch.randn(3, 6, requires_grad=True)


CALLS = {
    "topk": lambda: (aten.topk.default, (_x(), 2)),
    "sort": lambda: (aten.sort.default, (_x(),)),
    "max.dim": lambda: (aten.max.dim, (_x(), 1)),
    "min.dim": lambda: (aten.min.dim, (_x(), 1)),
    "kthvalue": lambda: (aten.kthvalue.default, (_x(), 2, 1)),
    "median.dim": lambda: (aten.median.dim, (_x(), 1)),
    "mode": lambda: (aten.mode.default, (_x(), 1)),
    "max (whole)": lambda: (aten.max.default, (_x(),)),
    "median (whole)": lambda: (aten.median.default, (_x(),)),
    "max of two": lambda: (aten.max.other, (_x(), torch.randn(4, 6))),
    "var": lambda: (aten.var.correction, (_x(), [1])),
    "var_mean": lambda: (aten.var_mean.correction, (_x(), [1])),
    "std": lambda: (aten.std.correction, (_x(), [1])),
    "std_mean": lambda: (aten.std_mean.correction, (_x(), [1])),
    "linalg_vector_norm": lambda: (aten.linalg_vector_norm.default, (_x(), 2, [1])),
    "norm": lambda: (aten.norm.ScalarOpt_dim, (_x(), 2, [1])),
    "index": lambda: (aten.index.Tensor, (_x(), [_index()])),
    "index, a whole dim first": lambda: (aten.index.Tensor, (_x(), [None, _index()])),
    "index_put": lambda: (aten.index_put.default, (_x(), [_index()], _source())),
    "index_add": lambda: (aten.index_add.default, (_x(), 0, _index(), _source())),
    "index_copy": lambda: (aten.index_copy.default, (_x(), 0, _index(), _source())),
    "index_select": lambda: (aten.index_select.default, (_x(), 0, _index())),
    "gather": lambda: (aten.gather.default, (_x(), 1, torch.zeros(4, 2, dtype=torch.long))),
    "scatter": lambda: (aten.scatter.src, (_x(), 1, torch.zeros(4, 2, dtype=torch.long), torch.randn(4, 2))),
    "embedding": lambda: (aten.embedding.default, (_x(), _index())),
    "scatter_add": lambda: (aten.scatter_add.default, (_x(), 0, _index().view(3, 1).expand(3, 6), _source())),
    "scatter_reduce amax": lambda: (aten.scatter_reduce.two,
                                    (_x(), 0, _index().view(3, 1).expand(3, 6), _source(), "amax")),
    "scatter_reduce sum": lambda: (aten.scatter_reduce.two,
                                   (_x(), 0, _index().view(3, 1).expand(3, 6), _source(), "sum")),
    "hardtanh": lambda: (aten.hardtanh.default, (_x(),)),
    "threshold": lambda: (aten.threshold.default, (_x(), 0.1, 0.0)),
    "index_reduce": lambda: (aten.index_reduce.default, (_x(), 0, _index(), _source(), "mean")),
}


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _packed_storages(op, args) -> tuple[set, object]:
    """The storages autograd packs while `op(*args)` runs, and its output."""
    packed = set()

    def pack(tensor):
        packed.add(_storage(tensor))
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = op(*args)
    return packed, out


def _named_storages(op, args, out) -> set:
    """The storages the op table's rule for this call names."""
    requires_grad = tuple(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args)
    slots, known = optable.saved(op, optable.SaveCtx(tuple(args), {}, requires_grad))
    assert known, op
    outs = out if isinstance(out, (tuple, list)) else (out,)
    named = set()
    for kind, position in slots:
        if kind == "in":
            named.add(_storage(args[position]))
        elif kind == "out":
            named.add(_storage(outs[position]))
        elif kind == "list":
            named.update(_storage(tensor) for tensor in args[position] if isinstance(tensor, torch.Tensor))
    return named


@pytest.mark.parametrize("name", CALLS)
def test_the_op_table_names_what_autograd_keeps(name):
    torch.manual_seed(0)
    op, args = CALLS[name]()
    packed, out = _packed_storages(op, args)
    assert packed, f"{name}: autograd kept nothing (the case checks nothing)"
    assert _named_storages(op, args, out) == packed
