"""The strides of the gradients the static backward walk hands from op to op.

A gradient need not be laid out as the tensor it belongs to: add hands its output's gradient to both inputs as it
is, a transpose's backward transposes it, an elementwise formula lays its result out after its operands. Where a
formula reshapes a gradient that is not contiguous in the shape it needs (a view's backward is a reshape), it
copies. The walk learns each input gradient's strides from running the op's formula at the strides of its output
gradients (`fxmem.costmodel.formula.formula_run`), and keeps them here per tensor until the op that made the tensor
runs its backward.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch._prims_common import compute_elementwise_output_strides, is_non_overlapping_and_dense_or_false, \
    make_contiguous_strides_for

from .example_size import example_size


class TensorLayout(NamedTuple):
    """Where a tensor lies in its storage."""
    shape: tuple
    stride: tuple
    offset: int


def layout_of(tensor: torch.Tensor) -> TensorLayout | None:
    """The tensor's layout (symbolic sizes at their example values, without a guard), or None when a size has no
    example value (a data-dependent one)."""
    try:
        return TensorLayout(tuple(map(example_size, tensor.shape)), tuple(map(example_size, tensor.stride())),
                            example_size(tensor.storage_offset()))
    except Exception:  # noqa: BLE001 - no example value
        return None


def _meta(shape: tuple, stride: tuple) -> torch.Tensor:
    return torch.empty_strided(shape, stride, device="meta")


def fresh_strides(layout: TensorLayout) -> tuple:
    """The strides of a new tensor made like `layout`'s (`torch.empty_like`): its own when it is dense, else
    contiguous."""
    if is_non_overlapping_and_dense_or_false(_meta(layout.shape, layout.stride)):
        return layout.stride
    return tuple(make_contiguous_strides_for(layout.shape))


class GradLayouts:
    """Tensor (storage key, layout) -> the strides of the gradient it has received so far."""

    def __init__(self):
        self.strides: dict[tuple, tuple] = {}

    def take(self, key: int | None, layout: TensorLayout | None) -> tuple | None:
        """The strides of the gradient an output (`key`, `layout`) has received, which its op's backward consumes:
        as received, or a fresh tensor's when none is known."""
        if key is None or layout is None:
            return None
        return self.strides.pop((key, layout), None) or fresh_strides(layout)

    def receive(self, key: int | None, layout: TensorLayout | None, strides: tuple | None) -> None:
        """An input (`key`, `layout`) receives a gradient of `strides`; added to one it has (autograd's
        accumulation, `old + new` or `old.add_(new)`), the sum is laid out after the old one first."""
        if key is None or layout is None or strides is None or len(strides) != len(layout.shape):
            return
        old = self.strides.get((key, layout))
        if old is not None and old != strides:
            strides = tuple(compute_elementwise_output_strides(_meta(layout.shape, old),
                                                               _meta(layout.shape, strides)))
        self.strides[(key, layout)] = strides
