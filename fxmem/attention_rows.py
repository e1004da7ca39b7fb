"""Fully masked query rows: what eager attention gives them, after the SDPA rewrite, without the score matrix.

A left-padded batch through a Hugging Face decoder has query rows whose additive mask is `finfo(dtype).min` in
every column. Eager attention gives them a uniform softmax (the mean of v) and still sends the softmax Jacobian
back to q and k; the fused SDPA kernels agree on the value, not on that gradient (their log-sum-exp rounds).
`emit_fully_masked_rows` selects those rows at run time from the mask and replaces them, with `where`, by

    mean_j v_j + (L - L.detach()),    L = scale * q_row @ mean_j k_j (v_j - mean v)^T

(L is attention's first-order term at the uniform distribution: eager's gradient, zero value). Cost: two
(D x Dv) products per head. Limits: attention dropout in training does not reach these rows; a learned additive
bias gets no gradient from them (where that changes a gradient, verification rolls the pass back). Design:
docs/design/overview.md, "Padded batches".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

aten = torch.ops.aten


@dataclass(frozen=True)
class SdpaCall:
    """The graph nodes (or constants) of one SDPA call: q, k, v in (..., H, L, E) layout, its additive mask and
    scale, and the query heads per key/value head (`enable_gqa`)."""
    query: fx.Node
    key: fx.Node
    value: fx.Node
    mask: fx.Node
    scale: float | fx.Node
    gqa_groups: int = 1


def emit_fully_masked_rows(graph: fx.Graph, call: SdpaCall, out: fx.Node, mask_dtype: torch.dtype,
                           ndim: int) -> fx.Node:
    """`out` with its fully masked rows replaced by eager attention's value and gradient (nodes inserted at the
    graph's insertion point). `ndim`: the rank of q, k and v."""
    emit = graph.call_function
    lowest = torch.finfo(mask_dtype).min
    # (a learned bias's extremes, detached: no autograd node keeps the bias and its extremes alive to backward)
    mask_const = emit(aten.detach.default, (call.mask,))
    top = emit(aten.amax.default, (mask_const, [-1], True))
    bottom = emit(aten.amin.default, (mask_const, [-1], True))
    full = emit(aten.logical_and.default, (emit(aten.eq.Scalar, (top, lowest)), emit(aten.eq.Scalar, (bottom, lowest))))
    v_const = emit(aten.detach.default, (call.value,))
    v_mean_const = emit(aten.mean.dim, (v_const, [-2], True))
    keys = emit(aten.sym_size.int, (call.key, ndim - 2))
    kv_mean = emit(aten.div.Scalar, (emit(aten.matmul.default, (emit(aten.transpose.int, (call.key, -2, -1)), v_const)),
                                   keys))
    k_mean = emit(aten.mean.dim, (call.key, [-2], True))
    centred = emit(aten.sub.Tensor, (kv_mean, emit(aten.matmul.default, (emit(aten.transpose.int, (k_mean, -2, -1)),
                                                                       v_mean_const))))
    v_mean = emit(aten.mean.dim, (call.value, [-2], True))
    if call.gqa_groups > 1:
        centred, v_mean = (emit(aten.repeat_interleave.self_int, (t, call.gqa_groups, ndim - 3))
                           for t in (centred, v_mean))
    first_order = emit(aten.mul.Tensor, (emit(aten.matmul.default, (call.query, centred)), call.scale))
    zero_valued = emit(aten.sub.Tensor, (first_order, emit(aten.detach.default, (first_order,))))
    eager_rows = emit(aten.add.Tensor, (v_mean, zero_valued))
    return emit(aten.where.self, (full, eager_rows, out))

