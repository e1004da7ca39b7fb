"""Dropout that saves a bool mask: what `passes.checkpoint.compact_dropout` puts in place of CPU `aten.dropout`.

    y = bool_mask_dropout(x, 0.1, training, 1.1111111640930176, torch.float32)

The same Bernoulli numbers as `aten.dropout`, drawn into a bool mask: outputs and gradients are bit-identical,
and autograd saves 1 byte per element instead of the input dtype's. `DrawTape` records a checkpoint region's masks
in the forward and hands them to the recomputation instead of drawing again. `bool_mask_dropout_remat` (for the
checkpoint pass's `remat`) recomputes a consumer's saved output from the input and the mask.
Design: docs/design/checkpoint.md, "Dropout masks" and "The runtime modules".
"""
from __future__ import annotations

import contextvars

import torch

from .remat import register_recompute

_TAPE: contextvars.ContextVar = contextvars.ContextVar("fxmem_draw_tape", default=None)


class DrawTape:
    """Masks drawn by one call of a region's body, replayed by its later calls (the recomputation)."""

    def __init__(self, body):
        self.body = body
        self.masks: list[torch.Tensor] = []
        self.replaying = False
        self.pos = 0

    def __call__(self, *args):
        token = _TAPE.set(self)
        try:
            return self.body(*args)
        finally:
            _TAPE.reset(token)
            self.replaying, self.pos = True, 0  # the next call replays from the first draw

    def draw(self, x: torch.Tensor, p: float) -> torch.Tensor:
        if self.replaying:
            keep = self.masks[self.pos]
            self.pos += 1
            return keep
        keep = _draw(x, p)
        self.masks.append(keep)
        return keep


def _draw(x: torch.Tensor, p: float) -> torch.Tensor:
    """A bool mask with x's shape and strides, drawn in x's memory order, as aten.dropout fills its float mask
    (`empty_like(x)`): drawn contiguous over x's dims ordered as in memory, then permuted back."""
    order = _memory_order(x)
    dense = torch.empty([x.shape[d] for d in order], dtype=torch.bool, device=x.device)
    return torch.ops.aten.bernoulli.p(dense, 1 - p).permute(sorted(range(x.dim()), key=order.__getitem__))


def _memory_order(x: torch.Tensor) -> list[int]:
    """x's dims, outermost in memory first (a transposed tensor's swapped back)."""
    return sorted(range(x.dim()), key=lambda d: -x.stride(d))


def _dense(x: torch.Tensor) -> bool:
    """x fills its memory without gaps or overlaps in some order of its dims (contiguous, transposed, permuted)."""
    return x.permute(_memory_order(x)).is_contiguous()


def dropout_scale(x: torch.Tensor, p: float) -> torch.Tensor:
    """1/(1-p) as `aten.dropout` rounds it (ones of x's dtype divided by 1 - p), as a 0-dim tensor of x's dtype."""
    return torch.ones((), dtype=x.dtype, device=x.device) / (1 - p)


def bool_mask_dropout(x: torch.Tensor, p: float, train: bool, scale: float | None = None,
                      scale_dtype: torch.dtype | None = None, remat: bool = False) -> torch.Tensor:
    """`aten.dropout(x, p, train)` with a bool mask saved for backward (same random numbers, same values)."""
    if not train or p == 0 or x.numel() == 0:
        return x
    if p == 1 or not _dense(x) or torch.compiler.is_compiling():
        # under torch.compile the compiler's own dropout (its RNG, fused; eager's masks are not reproduced anyway)
        # an input with gaps or overlaps: the float mask (empty_like(x)) would be contiguous, filled in another
        # order than a bool draw follows; the original dropout keeps it exact. (A transposed input is dense: its
        # mask is drawn in its memory order. Its strides can differ between a fake trace and the real run, a batch
        # norm's output, so deciding on contiguity made the cost model plan a bool mask the run did not draw.)
        return torch.ops.aten.dropout(x, p, True)
    tape = _TAPE.get()
    keep = tape.draw(x, p) if tape is not None else _draw(x, p)
    s = scale if scale is not None and x.dtype == scale_dtype else dropout_scale(x, p)
    out = _apply_mask(x, keep, s)
    if remat:
        register_recompute(out, _apply_mask, (x, keep, s))
    return out


def _apply_mask(x: torch.Tensor, keep: torch.Tensor, s) -> torch.Tensor:
    # The mask goes in as uint8, a view of the same bytes: CPU kernels convert a bool operand to x's dtype
    # element by element, which took longer than the multiply (and much longer than uint8's conversion on a fp32
    # tensor). Autograd saves the uint8 view (1 byte per element); the backward's grad * mask converts it the
    # same fast way. Masking in place spares a temporary: the product is not saved, only the mask is. Scaling first,
    # masking last (the same values: a product with 0 or 1 is exact): the mask's multiply is the first op of the
    # backward, so a checkpoint region ending in a dropout recomputes there, before the scaling's gradient (a
    # tensor of x's size) is made, not while it is live.
    return torch.mul(x, s).mul_(keep.view(torch.uint8))


def bool_mask_dropout_remat(x: torch.Tensor, p: float, train: bool, scale: float | None = None,
                            scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`bool_mask_dropout` whose output, where a consumer saves it (e.g. attention probabilities feeding `@ v`),
    is recomputed in backward from the input and the mask (`fxmem.nn.recast`: both are saved anyway)."""
    return bool_mask_dropout(x, p, train, scale, scale_dtype, remat=True)
