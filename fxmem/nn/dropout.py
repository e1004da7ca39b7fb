"""Dropout that saves a bool mask: what `passes.checkpoint.compact_dropout` puts in place of CPU `aten.dropout`.

On CPU `aten.dropout` draws Bernoulli numbers into a tensor of the input's dtype, divides it by 1 - p and
multiplies, so autograd saves a float mask (4 bytes per element for fp32). `bool_mask_dropout` draws the same
numbers into a bool tensor (the CPU generator's Bernoulli stream does not depend on the tensor's dtype), multiplies
by it, then by the value 1/(1-p) the float mask held (rounded in the input's dtype, as the mask was): outputs and
gradients are bit-identical, and the mask autograd saves takes 1 byte per element. A non-contiguous input runs the
original dropout (its mask is filled in the input's memory order). The draw is one
`aten.bernoulli.p` op, which checkpoint regions keep instead of drawing again.

    y = bool_mask_dropout(x, 0.1, training)
"""
from __future__ import annotations

import torch

def dropout_scale(x: torch.Tensor, p: float) -> torch.Tensor:
    """1/(1-p) as `aten.dropout` rounds it (ones of x's dtype divided by 1 - p), a 0-dim tensor: no host sync and
    no Python-side cache, so it traces under torch.compile inside a checkpoint region."""
    return torch.ones((), dtype=x.dtype, device=x.device).div_(1 - p)


def bool_mask_dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """`aten.dropout(x, p, train)` with a bool mask saved for backward (same random numbers, same values)."""
    if not train or p == 0 or x.numel() == 0:
        return x
    if p == 1 or not x.is_contiguous():
        # a strided input: the float mask (empty_like(x)) is filled in x's memory order, which a contiguous bool
        # draw would not follow; the original dropout keeps it exact
        return torch.ops.aten.dropout(x, p, True)
    keep = torch.ops.aten.bernoulli.p(torch.empty_like(x, dtype=torch.bool), 1 - p)
    return x * keep * dropout_scale(x, p)
