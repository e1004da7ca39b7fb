"""Bool masks packed eight elements to a byte, and unpacked again, bit for bit.

    packed = pack(keep)                       # keep: bool, any dense layout -> uint8[ceil(n / 8)], memory order
    keep = unpack(packed, shape, stride)      # the same bool mask, laid out as `shape` and `stride`

A dropout's mask is a bool per element: a byte. Packed, it keeps an eighth (`fxmem.nn.dropout_ops`). Element i of
the mask in memory order is bit i % 8 of byte i // 8. Both directions work on 8 bytes at once as one int64 (one
multiply by a constant and a few masks and shifts), so packing the reference decoder's 4.6 MiB of masks takes well
under a millisecond on CPU. The int64 view reads the bytes little-endian; a big-endian machine takes the per-bit
path (`_pack_bits` / `_unpack_bits`, also the tests' reference).
"""
from __future__ import annotations

import math
import sys

import torch

# pack: the bytes b0..b7 (each 0 or 1) of an int64, times this, put b_i at bit 56 + i (no carries: every product
# term lands on its own bit)
_GATHER = 0x0102040810204080
# unpack: a byte y times this is y in every byte; & _SPREAD keeps bit i of y in byte i
_REPEAT = 0x0101010101010101
_SPREAD = 0x8040201008040201 - (1 << 64)  # (as a signed int64)
# a byte holding 0 or 2^i plus 0x7F has bit 7 set exactly when it was nonzero
_NONZERO = 0x7F7F7F7F7F7F7F7F
_ONES = 0x0101010101010101
_LITTLE = sys.byteorder == "little"


def packed_size(numel: int) -> int:
    """Bytes a mask of `numel` elements packs into."""
    return (numel + 7) // 8


def memory_order(stride) -> list[int]:
    """The dims of a tensor with these strides, outermost in memory first (a transposed tensor's swapped back)."""
    return sorted(range(len(stride)), key=lambda d: -stride[d])


def pack(keep: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """`keep` (bool, dense in some order of its dims) as uint8[ceil(n / 8)], its elements in memory order.
    `scratch`: `keep` is the caller's own temporary, which packing may overwrite (no int64 copy of it is made)."""
    flat = keep.permute(memory_order(keep.stride())).reshape(-1)
    numel = flat.numel()
    if numel % 8:
        flat, scratch = torch.cat([flat, flat.new_zeros(8 - numel % 8)]), True
    if not _LITTLE:
        return _pack_bits(flat)
    words = flat.view(torch.uint8).view(torch.int64)
    words = words.mul_(_GATHER) if scratch else words * _GATHER
    return words.bitwise_right_shift_(56).bitwise_and_(0xFF).to(torch.uint8)


def unpack(packed: torch.Tensor, shape, stride) -> torch.Tensor:
    """The bool mask `pack` packed, laid out as `shape` and `stride` (the packed tensor's device)."""
    order = memory_order(stride)
    dense_shape = [shape[d] for d in order]
    numel = math.prod(shape)
    if _LITTLE:
        words = packed.to(torch.int64).mul_(_REPEAT).bitwise_and_(_SPREAD)
        words.add_(_NONZERO).bitwise_right_shift_(7).bitwise_and_(_ONES)
        flat = words.view(torch.uint8)
    else:
        flat = _unpack_bits(packed)
    dense = flat[:numel].view(torch.bool).view(dense_shape)
    return dense.permute(sorted(range(len(shape)), key=order.__getitem__))


def _weights(device) -> torch.Tensor:
    return torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)


def _pack_bits(flat: torch.Tensor) -> torch.Tensor:
    """`pack` bit by bit (any byte order): uint8 sums of element i << (i % 8), eight at a time."""
    lanes = flat.view(-1, 8).to(torch.uint8) * _weights(flat.device)
    return lanes.sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """`unpack`'s uint8 0/1 elements bit by bit (any byte order)."""
    return (packed.view(-1, 1).bitwise_and(_weights(packed.device)) != 0).to(torch.uint8).view(-1)
