"""Dropout that saves its mask packed, a bit per element: what `passes.checkpoint.compact_dropout` puts in place
of CPU `aten.dropout`.

    y = bool_mask_dropout(x, 0.1, training, 1.1111111640930176, torch.float32)

The same Bernoulli numbers as `aten.dropout`, drawn as a bool mask and packed eight to a byte
(`fxmem.nn.dropout_ops`): outputs and gradients are bit-identical, and autograd saves an eighth of a byte per
element instead of the input dtype's bytes. `DrawTape` records a checkpoint region's packed masks in the forward
and hands them to the recomputation instead of drawing again. `bool_mask_dropout_remat` (for the checkpoint pass's
`remat`) recomputes a consumer's saved output from the input and the packed mask.
Design: docs/design/checkpoint.md, "Dropout masks", "Bit-packed masks" and "The runtime modules".
"""
from __future__ import annotations

import contextvars
import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .bitmask import memory_order
from .compiled_recompute import recompute_compiled
from .dropout_ops import masked_scale, packed_bernoulli
from .recast import active_scope
from .remat import register_recompute

# the op of the draws a region keeps (its DrawTape) or draws again: bool_mask_dropout's packed Bernoulli draw,
# whose output is the packed mask; keep_ops saved before the masks were packed name aten's draw (`kept_draws`)
DRAW_OPS = frozenset({"packed_bernoulli"})
_UNPACKED_DRAW_OPS = frozenset({"bernoulli"})


def kept_draws(keep_ops) -> frozenset:
    """`keep_ops` (a checkpoint region's) with aten's draw, which regions saved before masks were packed name,
    read as the packed draw: the same plan, the masks kept."""
    keep_ops = frozenset(keep_ops)
    if keep_ops & _UNPACKED_DRAW_OPS:
        return keep_ops - _UNPACKED_DRAW_OPS | DRAW_OPS
    return keep_ops

_TAPE: contextvars.ContextVar = contextvars.ContextVar("fxmem_draw_tape", default=None)


class DrawTape:
    """Packed masks drawn by one call of a region's body, replayed by its later calls (the recomputation)."""

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

    def draw(self, tensor: torch.Tensor, probability: float) -> torch.Tensor:
        if self.replaying:
            packed = self.masks[self.pos]
            self.pos += 1
            return packed
        packed = _draw(tensor, probability)
        self.masks.append(packed)
        return packed


def _draw(tensor: torch.Tensor, probability: float) -> torch.Tensor:
    """The tensor's mask, packed: drawn in its memory order, as aten.dropout fills its float mask
    (`empty_like(tensor)`), and kept a bit per element in that order (`fxmem.nn.bitmask`)."""
    return draw_mask(tensor.numel(), tensor.device, probability)


def draw_mask(numel: int, device, probability: float) -> torch.Tensor:
    """`_draw` for a tensor of `numel` elements on `device` (a recomputation drawing a forward's masks again)."""
    return packed_bernoulli(numel, 1 - probability, device)


def _dense(tensor: torch.Tensor) -> bool:
    """The tensor fills its memory without gaps or overlaps in some order of its dims (contiguous, transposed,
    permuted)."""
    return tensor.permute(memory_order(tensor.stride())).is_contiguous()


@functools.lru_cache(maxsize=None)
def scale_number(dtype: torch.dtype, probability: float) -> float:
    """1/(1-p) as `aten.dropout` rounds it (ones of the tensor's dtype divided by 1 - p), as a number (exact: a
    value of `dtype`; multiplying by it is multiplying by that 0-dim tensor). Computed on real tensors whatever mode
    is active (a fake trace's scale is this number too)."""
    with _disable_current_modes():
        return float(torch.ones((), dtype=dtype) / (1 - probability))


def bool_mask_dropout(tensor: torch.Tensor, probability: float, train: bool, scale: float | None = None,
                      scale_dtype: torch.dtype | None = None, remat: bool = False,
                      nest: tuple | None = None) -> torch.Tensor:
    """`aten.dropout(x, p, train)` with a packed bool mask saved for backward (same random numbers, same values).
    `remat`: the output saved as a recipe; `nest` (a tuple): an input that is a recipe's output is held as that
    recipe, not as a tensor (used through its shared value when its position, 0, is in `nest`)."""
    if not train or probability == 0 or tensor.numel() == 0:
        return tensor
    if remat and probability < 1 and torch.compiler.is_compiling() and torch.is_grad_enabled():
        return _compiled_remat(tensor, probability, scale, scale_dtype)
    if probability == 1 or not _dense(tensor) or torch.compiler.is_compiling():
        # under torch.compile the compiler's own dropout (its RNG, fused; eager's masks are not reproduced anyway)
        # an input with gaps or overlaps: the float mask (empty_like(x)) would be contiguous, filled in another
        # order than a draw in memory order follows; the original dropout keeps it exact. (A transposed input is
        # dense: its mask is drawn in its memory order. Its strides can differ between a fake trace and the real
        # run, a batch norm's output, so deciding on contiguity made the cost model plan a mask the run did not
        # draw.)
        return torch.ops.aten.dropout(tensor, probability, True)
    tape = _TAPE.get()
    packed = tape.draw(tensor, probability) if tape is not None else _draw(tensor, probability)
    applied_scale = _applied_scale(tensor, probability, scale, scale_dtype)
    out = remake(tensor, packed, applied_scale)
    if remat:
        scope = active_scope() if nest is not None else None
        args = (tensor, packed, applied_scale) if scope is None else scope.as_recipe_args(
            (tensor, packed, applied_scale), nest)
        register_recompute(out, remake, args)
    return out


def _applied_scale(tensor: torch.Tensor, probability: float, scale: float | None, scale_dtype) -> float:
    """The graph's own scale where it was computed in the tensor's dtype, else 1/(1-p) as aten.dropout rounds it."""
    return scale if scale is not None and tensor.dtype == scale_dtype else scale_number(tensor.dtype, probability)


def _compiled_remat(tensor: torch.Tensor, probability: float, scale, scale_dtype) -> torch.Tensor:
    """Under torch.compile, a remat'd dropout: the mask is drawn as a plain random op (kept: the partitioner does
    not recompute random ops) and the masked product runs in a remat checkpoint, so the partitioner recomputes it
    from the input and the mask, as eager's recipe does, instead of keeping it for the consumer that saves it (the
    attention probabilities feeding `@ v`). The compiler's random numbers, as for aten.dropout there."""
    keep = torch.rand_like(tensor) >= probability
    return recompute_compiled(_masked, tensor, keep, _applied_scale(tensor, probability, scale, scale_dtype))


def _masked(tensor: torch.Tensor, keep: torch.Tensor, scale) -> torch.Tensor:
    """`remake` out of place (inside a compiled checkpoint: no in-place op, no uint8 view for CPU's eager
    kernels to convert faster; the compiler fuses the product)."""
    return torch.mul(tensor, scale) * keep


def remake(tensor: torch.Tensor, packed: torch.Tensor, scale: float) -> torch.Tensor:
    """A bool-mask dropout's output from its input, its packed mask and its scale (a number): what the forward and
    the recipe run (benchmarks time the recomputation through it). `masked_scale` computes
    `torch.mul(tensor, scale).mul_(mask.view(torch.uint8))`: the mask goes in as uint8 (CPU kernels convert a bool
    operand to x's dtype element by element, slower than the multiply), in place (the product is not saved, only the
    packed mask is); scaling first, masking last (the same values: a product with 0 or 1 is exact), so that the
    mask's multiply is the first op of the backward and a checkpoint region ending in a dropout recomputes there,
    before the scaling's gradient (a tensor of x's size) is made."""
    return masked_scale(tensor, packed, float(scale))


def bool_mask_dropout_remat(tensor: torch.Tensor, probability: float, train: bool, scale: float | None = None,
                            scale_dtype: torch.dtype | None = None, _fxmem_nest: tuple | None = None) -> torch.Tensor:
    """`bool_mask_dropout` whose output, where a consumer saves it (e.g. attention probabilities feeding `@ v`),
    is recomputed in backward from the input and the mask (`fxmem.nn.recast`: both are saved anyway).
    `_fxmem_nest` (the checkpoint pass sets it where the input is a remat site too, an attention softmax): the
    input held as its recipe, nested (`bool_mask_dropout`'s `nest`)."""
    return bool_mask_dropout(tensor, probability, train, scale, scale_dtype, remat=True, nest=_fxmem_nest)
