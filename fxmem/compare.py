"""Comparing outputs and gradients: one place for what "equal" means, used by capture, verification and tests.

Float32 and wider values are equal within the caller's (atol, rtol), element by element. Values computed in bf16 or
fp16 (`Precision`) cannot be: two correct programs round differently, more so the deeper the model. With the float32
shadows of both programs (`fxmem.shadow`), a value is equal when the shadows agree within (atol, rtol) and the
low-precision value is at most `ACCURACY_FACTOR` times further from the reference's shadow than the reference is,
plus one rounding (eps of the dtype, relative to the shadow's norm). Without shadows, at least
`torch.testing.assert_close`'s tolerances for the dtype hold. Zero tolerances always mean identical values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

LOW_PRECISION = (torch.bfloat16, torch.float16)
# torch.testing.assert_close's defaults (rtol, atol) for the dtype: the least a comparison without shadows allows
ASSERT_CLOSE_TOLERANCES = {torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}
# how much further from the float32 values a low-precision result may be than the reference's (dynamo's accuracy
# check against an fp64 reference uses the same factor)
ACCURACY_FACTOR = 2.0


def _leaves(x):
    # HF ModelOutput is a registered pytree / OrderedDict; dict-like outputs flatten by key
    return pytree.tree_leaves(x)


def least_precise_of(dtypes) -> torch.dtype | None:
    """The least precise of bf16 / fp16 among `dtypes`; None when it holds neither."""
    present = set(dtypes)
    low = [d for d in LOW_PRECISION if d in present]
    return max(low, key=lambda d: torch.finfo(d).eps) if low else None


def least_precise(*trees) -> torch.dtype | None:
    """The least precise of bf16 / fp16 among the tensor leaves of `trees`; None when they hold neither."""
    return least_precise_of(x.dtype for tree in trees for x in _leaves(tree) if isinstance(x, torch.Tensor))


@dataclass(frozen=True)
class Precision:
    """What compared values were computed in: `dtype` the least precise float dtype (bf16 / fp16; None = float32 or
    wider) and, when there are such runs, the same values from the float32 shadows of the reference's program and of
    the compared one (same structure as the values)."""
    dtype: torch.dtype | None = None
    ref_shadow: Any = None
    got_shadow: Any = None

    def leaves(self, count: int) -> list[Precision]:
        """The precision of each of `count` flattened values (no shadows where theirs flatten otherwise)."""
        shadows = [_leaves(tree) if tree is not None else [] for tree in (self.ref_shadow, self.got_shadow)]
        if any(len(leaves) != count for leaves in shadows):
            return [Precision(self.dtype)] * count
        return [Precision(self.dtype, ref, got) for ref, got in zip(*shadows)]

    def named(self, name: str) -> Precision:
        """The precision of the value `name` in a dict of them (the shadows are dicts by the same names)."""
        ref, got = ((tree or {}).get(name) for tree in (self.ref_shadow, self.got_shadow))
        return Precision(self.dtype, ref, got)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_difference(ref: torch.Tensor, got: torch.Tensor, atol: float, rtol: float,
                      precision: Precision | None = None, equal_nan: bool = True) -> str | None:
    """None when two floating tensors of one shape are equal (see the module docstring); else what differs."""
    a, b = ref.detach().double(), got.detach().double()
    low = precision.dtype if precision is not None else None
    if low is None or (atol == 0 and rtol == 0):
        return _allclose_difference(a, b, atol, rtol, equal_nan)
    shadows = (precision.ref_shadow, precision.got_shadow)
    if all(isinstance(s, torch.Tensor) and s.shape == a.shape for s in shadows):
        return _shadow_difference(a, b, [s.detach().double() for s in shadows], atol, rtol, low)
    floor_rtol, floor_atol = ASSERT_CLOSE_TOLERANCES[low]
    why = _allclose_difference(a, b, max(atol, floor_atol), max(rtol, floor_rtol), equal_nan)
    return None if why is None else f"{why} at {dtype_name(low)}'s tolerance, no float32 shadow"


def _allclose_difference(a, b, atol, rtol, equal_nan) -> str | None:
    if torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=equal_nan):
        return None
    return f"max abs diff {(a - b).abs().max().item():.3g} (atol {atol:g}, rtol {rtol:g})"


def _shadow_difference(a, b, shadows, atol, rtol, low) -> str | None:
    """`a` (reference) and `b` in dtype `low`, judged by their float32 shadows: those agree within (atol, rtol), and
    `b` is no further from the reference's shadow than `ACCURACY_FACTOR` times `a`, plus one rounding."""
    truth, other = shadows
    why = _allclose_difference(truth, other, atol, rtol, True)
    if why is not None:
        return f"{why} in float32 (the programs' float32 shadows)"
    same = (a == b) | (a.isnan() & b.isnan())
    if not ((a.isfinite() & b.isfinite()) | same).all():
        return f"non-finite values differ in {dtype_name(low)}"
    kept = a.isfinite() & b.isfinite() & truth.isfinite()
    a, b, truth = a[kept], b[kept], truth[kept]
    ref_error, error, scale = (a - truth).norm().item(), (b - truth).norm().item(), truth.norm().item()
    allowed = ACCURACY_FACTOR * ref_error + torch.finfo(low).eps * scale + atol * math.sqrt(truth.numel())
    if error <= allowed:
        return None
    return (f"{dtype_name(low)} result {error / max(scale, 1e-30):.3g} from float32 (relative), the reference's "
            f"{ref_error / max(scale, 1e-30):.3g}: more than {ACCURACY_FACTOR:g}x plus one {dtype_name(low)} rounding")


def compare_outputs(ref, got, *, atol: float, rtol: float, precision: Precision | None = None) -> str | None:
    """None when every tensor leaf matches within (atol, rtol), at the precision the values were computed in
    (`precision`; by default the least precise of the reference's leaves); else a one-line description of the first
    leaf that differs."""
    a, b = _leaves(ref), _leaves(got)
    if len(a) != len(b):
        return f"output structure differs: {len(a)} leaves vs {len(b)}"
    precisions = (precision or Precision(least_precise(ref))).leaves(len(a))
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"output leaf {i}: tensor vs {type(y).__name__}"
        if not isinstance(x, torch.Tensor):
            if x != y:
                return f"output leaf {i}: {x!r} != {y!r}"
            continue
        if x.shape != y.shape:
            return f"output leaf {i}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if x.dtype.is_floating_point or y.dtype.is_floating_point:
            why = tensor_difference(x, y, atol, rtol, precisions[i])
            if why is not None:
                return f"output leaf {i}: {why}"
        elif not torch.equal(x, y):
            return f"output leaf {i}: integer/bool values differ"
    return None


def compare_named(ref: dict, got: dict, what: str, atol: float, rtol: float, required: bool,
                  precision: Precision | None = None) -> str | None:
    """The first tensor of `ref` (by name) that `got` does not match, said as `what` (a format with the name), or
    None. `required`: a missing or reshaped one is a difference too (else it is passed over). `precision` as in
    `compare_outputs`, its shadows dicts by the same names."""
    precision = precision or Precision(least_precise(ref))
    for name, a in ref.items():
        b = got.get(name)
        if b is None or b.shape != a.shape:
            if not required:
                continue
            return (f"{what.format(name)} missing after the pass" if b is None else
                    f"{what.format(name)}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"{what.format(name)} differs"
            continue
        why = tensor_difference(a, b, atol, rtol, precision.named(name), equal_nan=False)
        if why is not None:
            return f"{what.format(name)}: {why}"
    return None


@dataclass
class Deviation:
    """How far one result is from a reference: max abs error and relative (Frobenius) error over all leaves."""
    max_abs: float
    rel: float

    def to_dict(self):
        return {"max_abs": self.max_abs, "rel": self.rel}


def deviation(ref, got) -> Deviation:
    num = den = 0.0
    mx = 0.0
    for x, y in zip(_leaves(ref), _leaves(got)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.is_floating_point():
            if x.shape != y.shape:
                return Deviation(float("inf"), float("inf"))
            xd, yd = x.detach().double(), y.detach().double()
            diff = (xd - yd)
            diff = torch.nan_to_num(diff, nan=float("inf"))
            num += float((diff ** 2).sum())
            den += float((xd ** 2).sum())
            if diff.numel():
                mx = max(mx, float(diff.abs().max()))
    rel = (num ** 0.5) / max(den ** 0.5, 1e-30)
    return Deviation(mx, rel)
