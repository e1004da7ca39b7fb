"""Fully masked query rows: what eager attention gives them, after the SDPA rewrite, without the score matrix.

A left-padded batch through a Hugging Face decoder builds an additive mask whose rows for padding queries hold
`finfo(dtype).min` in every column (causal and padding together). Eager attention adds the scores to it and every
sum rounds to that same value, so the row's softmax is exactly uniform: the output is the mean of v, and autograd
still sends the softmax Jacobian at the uniform distribution back to the scores (the add passes the gradient on
unchanged). The fused SDPA kernels agree on the forward value but not on that gradient: their log-sum-exp rounds
at such magnitudes (the CPU flash kernel gives the keys n times the gradient), so the rewrite would change the
gradients of any model whose loss reads a padding position's output (HF's shifted labels do, at the last one).

`emit_fully_masked_rows` adds, after the SDPA node, the exact eager value and gradient for those rows, selected at
run time from the mask (rows whose every entry is the dtype's lowest value), with `where`:

    out_row = mean_j v_j + (L - L.detach()),    L = scale * q_row @ mean_j k_j (v_j - mean v)^T

L is softmax attention's first-order term at the uniform distribution, so its gradient towards q and k is the
one eager gives; its value is removed exactly (x - x = 0). The extra work is two (D x Dv) products per head,
nothing of size (Lq x Lk); SDPA's rows that `where` replaces get a zero output gradient, so its backward adds
nothing for them.
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
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node
    scale: float | fx.Node
    gqa_groups: int = 1


def emit_fully_masked_rows(graph: fx.Graph, call: SdpaCall, out: fx.Node, mask_dtype: torch.dtype,
                           ndim: int) -> fx.Node:
    """`out` with its fully masked rows replaced by eager attention's value and gradient (nodes inserted at the
    graph's insertion point). `ndim`: the rank of q, k and v."""
    fn = graph.call_function
    lowest = torch.finfo(mask_dtype).min
    top = fn(aten.amax.default, (call.mask, [-1], True))
    bottom = fn(aten.amin.default, (call.mask, [-1], True))
    full = fn(aten.logical_and.default, (fn(aten.eq.Scalar, (top, lowest)), fn(aten.eq.Scalar, (bottom, lowest))))
    v_const = fn(aten.detach.default, (call.v,))
    v_mean_const = fn(aten.mean.dim, (v_const, [-2], True))
    keys = fn(aten.sym_size.int, (call.k, ndim - 2))
    kv_mean = fn(aten.div.Scalar, (fn(aten.matmul.default, (fn(aten.transpose.int, (call.k, -2, -1)), v_const)),
                                   keys))
    k_mean = fn(aten.mean.dim, (call.k, [-2], True))
    centred = fn(aten.sub.Tensor, (kv_mean, fn(aten.matmul.default, (fn(aten.transpose.int, (k_mean, -2, -1)),
                                                                       v_mean_const))))
    v_mean = fn(aten.mean.dim, (call.v, [-2], True))
    if call.gqa_groups > 1:
        centred, v_mean = (fn(aten.repeat_interleave.self_int, (t, call.gqa_groups, ndim - 3))
                           for t in (centred, v_mean))
    first_order = fn(aten.mul.Tensor, (fn(aten.matmul.default, (call.q, centred)), call.scale))
    zero_valued = fn(aten.sub.Tensor, (first_order, fn(aten.detach.default, (first_order,))))
    eager_rows = fn(aten.add.Tensor, (v_mean, zero_valued))
    return fn(aten.where.self, (full, eager_rows, out))

