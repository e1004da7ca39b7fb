"""Packed dropout masks: `fxmem.nn.bitmask` (pack / unpack, bit for bit, any dense layout) and the two custom ops
of `fxmem.nn.dropout_ops` (the packed draw, the masked product and its gradient, what autograd saves)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.nn import bitmask
from fxmem.nn.checkpoint import CheckpointRegion
from fxmem.nn.dropout import DRAW_OPS, bool_mask_dropout, kept_draws
from fxmem.nn.dropout_ops import masked_scale, packed_bernoulli

# (shape, the order of its dims in memory, outermost first): contiguous, transposed, permuted, sizes that are no
# multiple of 8, a single element, none
LAYOUTS = [((8, 4, 16, 16), (0, 1, 2, 3)), ((3, 5, 7), (2, 0, 1)), ((13,), (0,)), ((2, 3), (1, 0)),
           ((1,), (0,)), ((0, 4), (0, 1)), ((2, 1, 5, 7), (3, 1, 0, 2))]


def _laid_out(mask: torch.Tensor, order) -> torch.Tensor:
    """`mask` with its dims in memory in `order` (a dense, maybe non-contiguous, tensor of the same values)."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return mask.permute(order).contiguous().permute(inverse)


def _strides(tensor: torch.Tensor) -> list:
    """The strides of the dims that have any (a dim of size 1 may have any stride)."""
    return [stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 1]


@pytest.mark.parametrize("shape,order", LAYOUTS, ids=str)
def test_pack_unpack_round_trip_in_memory_order(shape, order):
    torch.manual_seed(0)
    keep = _laid_out(torch.rand(shape) > 0.3, order)
    packed = bitmask.pack(keep)
    numel = keep.numel()
    assert packed.dtype == torch.uint8 and packed.shape == (bitmask.packed_size(numel),)
    flat = keep.permute(order).reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-numel % 8)])
    assert torch.equal(packed, bitmask._pack_bits(padded))  # bit i % 8 of byte i // 8, as the per-bit path packs
    again = bitmask.unpack(packed, keep.shape, keep.stride())
    assert again.dtype == torch.bool and torch.equal(again, keep) and _strides(again) == _strides(keep)
    assert torch.equal(bitmask._unpack_bits(packed)[:numel].view(torch.bool), flat)


def test_pack_uses_every_bit():
    """Each of the 256 byte values round-trips: the multiply-and-shift forms carry nothing between bits."""
    keep = torch.tensor([[(byte >> bit) & 1 for bit in range(8)] for byte in range(256)], dtype=torch.bool)
    packed = bitmask.pack(keep)
    assert packed.tolist() == list(range(256))
    assert torch.equal(bitmask.unpack(packed, keep.shape, keep.stride()), keep)


def test_packed_bernoulli_draws_aten_s_numbers():
    """The packed draw holds the numbers aten.bernoulli.p draws into a bool tensor of as many elements, and leaves
    the generator where that draw does."""
    for numel, probability in ((1000, 0.9), (8 * 64, 0.5), (7, 0.2)):
        torch.manual_seed(3)
        packed = packed_bernoulli(numel, probability, torch.device("cpu"))
        after = torch.get_rng_state()
        torch.manual_seed(3)
        ref = torch.ops.aten.bernoulli.p(torch.empty(numel, dtype=torch.bool), probability)
        assert torch.equal(bitmask.unpack(packed, (numel,), (1,)), ref)
        assert torch.equal(after, torch.get_rng_state())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)], ids=["contiguous", "permuted"])
def test_masked_scale_is_the_unpacked_product_with_its_gradient(dtype, order):
    """Outputs and input gradients bit-identical to `torch.mul(x, scale).mul_(mask)` on the unpacked mask, in x's
    layout; autograd saves the packed mask alone."""
    torch.manual_seed(0)
    x = _laid_out(torch.randn(4, 6, 10).to(dtype), order).requires_grad_()
    keep = _laid_out(torch.rand(4, 6, 10) > 0.25, order)
    scale = float(torch.ones((), dtype=dtype) / 0.75)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = masked_scale(x, bitmask.pack(keep), scale)
    ref = torch.mul(x, scale).mul_(keep.view(torch.uint8))
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    grad = torch.randn(4, 6, 10).to(dtype)
    assert torch.equal(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, x, grad)[0])
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.uint8, bitmask.packed_size(x.numel()))]


def test_custom_ops_run_under_fake_tensors_with_their_sizes():
    with FakeTensorMode():
        packed = packed_bernoulli(4 * 6 * 10, 0.9, torch.device("cpu"))
        x = torch.empty(4, 6, 10).permute(2, 0, 1).requires_grad_()
        out = masked_scale(x, packed, 1.25)
        out.sum().backward()
        assert packed.shape == (30,) and packed.dtype == torch.uint8
        assert out.shape == x.shape and out.stride() == x.stride() and x.grad.shape == x.shape


def test_bool_mask_dropout_gradient_equals_aten_dropout_s():
    torch.manual_seed(1)
    x = torch.randn(3, 50, 7, requires_grad=True)
    torch.manual_seed(2)
    ref = torch.ops.aten.dropout(x, 0.3, True)
    torch.manual_seed(2)
    out = bool_mask_dropout(x, 0.3, True)
    grad = torch.randn_like(x)
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, x, grad)[0])


def test_regions_saved_before_packing_keep_their_masks():
    """A region's keep_ops as saved before masks were packed name aten's draw: read as the packed draw (the region
    keeps its masks on its draw tape), other kept ops as they were."""
    assert kept_draws({"bernoulli", "mm"}) == DRAW_OPS | {"mm"}
    assert kept_draws({"mm"}) == {"mm"} and kept_draws(()) == frozenset()
    body = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    region = CheckpointRegion(body, frozenset({"bernoulli", "mm"}))
    assert region.keep_ops == DRAW_OPS | {"mm"} and region.sac_ops == {"mm"}
    assert region.fxmem_region.held_ops == DRAW_OPS
