"""Matrix-product operands made explicit: the copy `aten.matmul` makes of a strided operand, as a graph node.

`q @ k.transpose(-2, -1)` on attention heads split from one projection: `aten.matmul` folds the batch dims of
each operand with a reshape, which copies a strided operand, and its `bmm` saves that copy for backward. The copy
is no graph value, so nothing can be recomputed from it: an attention softmax's scores are a matrix product of two
tensors autograd keeps anyway, but those tensors exist only inside the matmul. `materialize_matmul_operands`
writes `aten.contiguous` after such an operand: the same bytes, saved by the same `bmm` (its reshape is then a
view), bit-identical products; made earlier in the forward, which the caller's check weighs. Remat can then
recompute the scores, and the softmax chain after them, from the copies (`remat_sites(scores=True)`). The caller
checks with the cost model that the rewrite changes no byte (`CheckpointRun.remat`).
"""
from __future__ import annotations

import torch
from torch import fx

from fxmem.node_value import node_value

_MATMUL = torch.ops.aten.matmul.default
_CONTIGUOUS = torch.ops.aten.contiguous.default


def materialize_matmul_operands(graph: fx.Graph) -> list[str]:
    """Insert `aten.contiguous` for every batched `aten.matmul` operand that its batch reshape copies; the names
    of the matmul nodes rewritten. Batched: both operands have 3 or more dims and the same batch shape (no
    broadcast, whose copy would be the expanded tensor, larger than the operand)."""
    rewritten = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _MATMUL or len(node.args) != 2 or node.kwargs:
            continue
        operands = [node_value(a, tensor_only=True) if isinstance(a, fx.Node) else None for a in node.args]
        if not all(isinstance(t, torch.Tensor) for t in operands) or not batched(*operands):
            continue
        copied = [i for i, t in enumerate(operands) if _reshape_copies(t)]
        for i in copied:
            # right after the operand: nothing runs between the copy's backward and the operand's, and none of the
            # ops between the operand and the matmul (an attention's softmax and dropout, whose backwards run back
            # to back for remat's shared recomputation) has a copy's backward between its own
            with graph.inserting_after(node.args[i]):
                copy = graph.call_function(_CONTIGUOUS, (node.args[i],))
            copy.meta.update(node.args[i].meta)
            for key in ("val", "fxmem_val"):  # (the operand's example values, laid out as the copy is)
                if isinstance(copy.meta.get(key), torch.Tensor):
                    copy.meta[key] = copy.meta[key].contiguous()
            node.args = tuple(copy if j == i else a for j, a in enumerate(node.args))
        if copied:
            rewritten.append(node.name)
    return rewritten


def batched(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() >= 3 and b.dim() >= 3 and a.shape[:-2] == b.shape[:-2]


def _reshape_copies(t: torch.Tensor) -> bool:
    """Folding the batch dims of `t` (matmul's reshape to 3 dims) is no view: it copies. Asked of torch's own
    reshape, on the example value (a fake tensor: no memory)."""
    return not t.reshape(-1, *t.shape[-2:])._is_view()
