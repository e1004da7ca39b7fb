"""The two ops of a dropout whose mask is kept packed, a bit per element (`fxmem.nn.bitmask`).

    packed = torch.ops.fxmem.packed_bernoulli(numel, keep_probability, device)   # uint8[ceil(numel / 8)]
    y = torch.ops.fxmem.masked_scale(x, packed, scale)                           # (x * scale) * mask

`packed_bernoulli` draws `numel` Bernoulli numbers with the default generator into a bool tensor (the numbers
aten.bernoulli.p draws into a bool tensor of that many elements, in memory order) and returns them packed: its
output is what a checkpoint region's draw tape keeps and what `masked_scale` saves. `masked_scale` multiplies x by
the scale, then by the mask unpacked in x's memory order (`fxmem.nn.dropout.remake`'s arithmetic: outputs and
gradients bit-identical to aten.dropout's; the scale a number, 1/(1-p) as rounded in x's dtype: multiplying by it is
bit-identical to multiplying by the 0-dim tensor of that dtype); its autograd saves the packed mask, nothing of
x's size, and its backward unpacks the mask again (grad * mask, then * scale).

Both are custom ops (`torch.library`), so a dispatch mode sees each as one op: the cost model's trace records the
packed output, and the op table (`fxmem.ops`) says what `masked_scale` saves and that its autograd formula runs it
below autograd (`custom_autograd`). What neither the cost model nor `fxmem.measure` sees is inside them (a dispatch
mode does not see inside a custom op's kernel): the bool draw, packed in its own memory, and the unpacked mask, each
a byte per element of x, while the op runs. The backward's unpacking runs as aten ops, seen and counted by both.
Design: docs/design/checkpoint.md, "Bit-packed masks".
"""
from __future__ import annotations

import torch

from .. import ops as optable
from .bitmask import pack, packed_size, unpack


@torch.library.custom_op("fxmem::packed_bernoulli", mutates_args=())
def packed_bernoulli(numel: int, probability: float, device: torch.device) -> torch.Tensor:
    """`numel` Bernoulli(probability) draws, packed eight to a byte."""
    drawn = torch.empty(numel, dtype=torch.bool, device=device).bernoulli_(probability)
    return pack(drawn, scratch=True)


@packed_bernoulli.register_fake
def _(numel, probability, device):
    return torch.empty(packed_size(numel), dtype=torch.uint8, device=device)


@torch.library.custom_op("fxmem::masked_scale", mutates_args=())
def masked_scale(tensor: torch.Tensor, packed: torch.Tensor, scale: float) -> torch.Tensor:
    """(tensor * scale) * the packed mask."""
    keep = unpack(packed, tensor.shape, tensor.stride())
    return torch.mul(tensor, scale).mul_(keep.view(torch.uint8))


@masked_scale.register_fake
def _(tensor, packed, scale):
    return torch.empty_like(tensor)


def _setup_context(ctx, inputs, output) -> None:
    tensor, packed, scale = inputs
    ctx.layout = (tensor.shape, tensor.stride())
    ctx.scale = scale
    ctx.save_for_backward(packed)


def _backward(ctx, grad):
    packed, = ctx.saved_tensors
    keep = unpack(packed, *ctx.layout)
    # (the order autograd's formulas took for `torch.mul(x, scale).mul_(mask)`: the mask's multiply, then the scale's)
    return torch.mul(grad, keep.view(torch.uint8)).mul_(ctx.scale), None, None


masked_scale.register_autograd(_backward, setup_context=_setup_context)


def _masked_scale_saves(ctx) -> list:
    """The packed mask, when x needs a gradient."""
    return [("in", 1)] if ctx.rg(0) else []


def _flops_elements(args, out) -> int:
    return int(out.numel()) if isinstance(out, torch.Tensor) else 0


optable.register(torch.ops.fxmem.packed_bernoulli.default,
                 optable.OpInfo(optable.RANDOM, lambda ctx: [], lambda args, out: int(args[0])))
optable.register(torch.ops.fxmem.masked_scale.default,
                 optable.OpInfo(optable.POINTWISE, _masked_scale_saves, _flops_elements, custom_autograd=True))
