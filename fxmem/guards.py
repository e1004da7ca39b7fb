"""Input checks for captured programs, with errors that name the input and the dim.

A bare `torch.export` module fails a call with an unsupported shape with `Guard failed: x.size()[1] == 8`.
`InputGuard` checks the same constraints itself (static dims, shared symbolic dims, value ranges) and says which
input, which dim, what was expected and why the dim is fixed. A python value (an int, a flag) is a constant of the
graph, which a call with another value would silently ignore: the guard refuses it, naming the input.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .errors import InputShapeError


@dataclass(frozen=True)
class DimSpec:
    """One dim of one flattened input: `static` holds the fixed size, else `symbol` names a symbolic size."""

    static: int | None
    symbol: str | None = None
    lower: int | None = None
    upper: int | None = None


@dataclass(frozen=True)
class InputSpec:
    name: str  # user-facing path, e.g. "args[0]" or "kwargs['attention_mask']"
    dims: tuple[DimSpec, ...] | None  # None: not a tensor
    dtype: str | None = None
    constant: tuple = ()  # (value,): a python value (bool, int, float, str) the graph holds as a constant


# python values an input may hold as a constant of the graph (torch.export specialises them)
CONSTANT_TYPES = (bool, int, float, str)


class InputGuard(nn.Module):
    """Checks the flattened inputs of a captured program before the graph runs."""

    def __init__(self, specs: list[InputSpec]):
        super().__init__()
        self.specs = list(specs)

    def forward(self, *flat):
        bound: dict[str, tuple[int, str, int]] = {}
        for spec, value in zip(self.specs, flat):
            if spec.constant:
                _check_constant(spec, value)
            if spec.dims is None or not isinstance(value, torch.Tensor):
                continue
            if value.dim() != len(spec.dims):
                raise InputShapeError(
                    f"input {spec.name}: expected a {len(spec.dims)}-d tensor (as in the example inputs), "
                    f"got shape {tuple(value.shape)}")
            for axis, (dim, size) in enumerate(zip(spec.dims, value.shape)):
                size = int(size)
                if dim.static is not None:
                    if size != dim.static:
                        raise InputShapeError(
                            f"input {spec.name} dim {axis}: the captured model is specialised to size {dim.static}, "
                            f"got {size}. The model forced this dim static during capture (a size-1 example dim, "
                            f"or the model's code/weights fix it); capture again with example inputs of that shape, "
                            f"or pass dynamic_shapes=... to fxmem.capture")
                    continue
                if dim.lower is not None and size < dim.lower or dim.upper is not None and size > dim.upper:
                    raise InputShapeError(
                        f"input {spec.name} dim {axis}: size {size} is outside the range the model supports "
                        f"[{dim.lower}, {dim.upper}] (e.g. a position table or block size)")
                if dim.symbol in bound and bound[dim.symbol][0] != size:
                    other_size, other_name, other_dim = bound[dim.symbol]
                    raise InputShapeError(
                        f"input {spec.name} dim {axis} (size {size}) must equal input {other_name} dim {other_dim} "
                        f"(size {other_size}): the model uses them together")
                bound.setdefault(dim.symbol, (size, spec.name, axis))
        return None


def _check_constant(spec: InputSpec, value) -> None:
    """A python value is a constant of the captured graph: another value would be silently ignored."""
    expected = spec.constant[0]
    same_nan = isinstance(value, float) and isinstance(expected, float) and value != value and expected != expected
    if isinstance(value, CONSTANT_TYPES) and isinstance(value, bool) == isinstance(expected, bool) \
            and (value == expected or same_nan):
        return
    raise InputShapeError(
        f"input {spec.name}: the captured model holds the value {expected!r} it was captured with as a constant "
        f"(torch.export fixes python values), got {value!r}; capture again with that value, or pass a tensor")
