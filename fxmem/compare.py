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


def _leaves(tree):
    # HF ModelOutput is a registered pytree / OrderedDict; dict-like outputs flatten by key
    return pytree.tree_leaves(tree)


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
    ref_double, got_double = ref.detach().double(), got.detach().double()
    low = precision.dtype if precision is not None else None
    if low is None or (atol == 0 and rtol == 0):
        return _allclose_difference(ref_double, got_double, atol, rtol, equal_nan)
    shadows = (precision.ref_shadow, precision.got_shadow)
    if all(isinstance(shadow, torch.Tensor) and shadow.shape == ref_double.shape for shadow in shadows):
        shadow_doubles = [shadow.detach().double() for shadow in shadows]
        return _shadow_difference(ref_double, got_double, shadow_doubles, atol, rtol, low)
    floor_rtol, floor_atol = ASSERT_CLOSE_TOLERANCES[low]
    why = _allclose_difference(ref_double, got_double, max(atol, floor_atol), max(rtol, floor_rtol), equal_nan)
    return None if why is None else f"{why} at {dtype_name(low)}'s tolerance, no float32 shadow"


def _allclose_difference(ref, got, atol, rtol, equal_nan) -> str | None:
    if torch.allclose(ref, got, atol=atol, rtol=rtol, equal_nan=equal_nan):
        return None
    return f"max abs diff {(ref - got).abs().max().item():.3g} (atol {atol:g}, rtol {rtol:g})"


def _shadow_difference(ref, got, shadows, atol, rtol, low) -> str | None:
    """`ref` (reference) and `got` in dtype `low`, judged by their float32 shadows: those agree within (atol, rtol),
    and `got` is no further from the reference's shadow than `ACCURACY_FACTOR` times `ref`, plus one rounding."""
    truth, other = shadows
    why = _allclose_difference(truth, other, atol, rtol, True)
    if why is not None:
        return f"{why} in float32 (the programs' float32 shadows)"
    same = (ref == got) | (ref.isnan() & got.isnan())
    if not ((ref.isfinite() & got.isfinite()) | same).all():
        return f"non-finite values differ in {dtype_name(low)}"
    kept = ref.isfinite() & got.isfinite() & truth.isfinite()
    ref, got, truth = ref[kept], got[kept], truth[kept]
    ref_error, error, scale = (ref - truth).norm().item(), (got - truth).norm().item(), truth.norm().item()
    allowed = ACCURACY_FACTOR * ref_error + torch.finfo(low).eps * scale + atol * math.sqrt(truth.numel())
    if error <= allowed:
        return None
    return (f"{dtype_name(low)} result {error / max(scale, 1e-30):.3g} from float32 (relative), the reference's "
            f"{ref_error / max(scale, 1e-30):.3g}: more than {ACCURACY_FACTOR:g}x plus one {dtype_name(low)} rounding")


def compare_outputs(ref, got, *, atol: float, rtol: float, precision: Precision | None = None) -> str | None:
    """None when every tensor leaf matches within (atol, rtol), at the precision the values were computed in
    (`precision`; by default the least precise of the reference's leaves); else a one-line description of the first
    leaf that differs."""
    ref_leaves, got_leaves = _leaves(ref), _leaves(got)
    if len(ref_leaves) != len(got_leaves):
        return f"output structure differs: {len(ref_leaves)} leaves vs {len(got_leaves)}"
    precisions = (precision or Precision(least_precise(ref))).leaves(len(ref_leaves))
    for index, (ref_leaf, got_leaf) in enumerate(zip(ref_leaves, got_leaves)):
        if isinstance(ref_leaf, torch.Tensor) != isinstance(got_leaf, torch.Tensor):
            return f"output leaf {index}: tensor vs {type(got_leaf).__name__}"
        if not isinstance(ref_leaf, torch.Tensor):
            if ref_leaf != got_leaf:
                return f"output leaf {index}: {ref_leaf!r} != {got_leaf!r}"
            continue
        if ref_leaf.shape != got_leaf.shape:
            return f"output leaf {index}: shape {tuple(ref_leaf.shape)} vs {tuple(got_leaf.shape)}"
        if ref_leaf.dtype.is_floating_point or got_leaf.dtype.is_floating_point:
            why = tensor_difference(ref_leaf, got_leaf, atol, rtol, precisions[index])
            if why is not None:
                return f"output leaf {index}: {why}"
        elif not torch.equal(ref_leaf, got_leaf):
            return f"output leaf {index}: integer/bool values differ"
    return None


def compare_named(ref: dict, got: dict, what: str, atol: float, rtol: float, required: bool,
                  precision: Precision | None = None) -> str | None:
    """The first tensor of `ref` (by name) that `got` does not match, said as `what` (a format with the name), or
    None. `required`: a missing or reshaped one is a difference too (else it is passed over). `precision` as in
    `compare_outputs`, its shadows dicts by the same names."""
    precision = precision or Precision(least_precise(ref))
    for name, ref_tensor in ref.items():
        got_tensor = got.get(name)
        if got_tensor is None or got_tensor.shape != ref_tensor.shape:
            if not required:
                continue
            return (f"{what.format(name)} missing after the pass" if got_tensor is None else
                    f"{what.format(name)}: shape {tuple(ref_tensor.shape)} vs {tuple(got_tensor.shape)}")
        if not ref_tensor.is_floating_point():
            if not torch.equal(ref_tensor, got_tensor):
                return f"{what.format(name)} differs"
            continue
        why = tensor_difference(ref_tensor, got_tensor, atol, rtol, precision.named(name), equal_nan=False)
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
    max_abs = 0.0
    for ref_leaf, got_leaf in zip(_leaves(ref), _leaves(got)):
        if isinstance(ref_leaf, torch.Tensor) and isinstance(got_leaf, torch.Tensor) and ref_leaf.is_floating_point():
            if ref_leaf.shape != got_leaf.shape:
                return Deviation(float("inf"), float("inf"))
            ref_double, got_double = ref_leaf.detach().double(), got_leaf.detach().double()
            diff = (ref_double - got_double)
            diff = torch.nan_to_num(diff, nan=float("inf"))
            num += float((diff ** 2).sum())
            den += float((ref_double ** 2).sum())
            if diff.numel():
                max_abs = max(max_abs, float(diff.abs().max()))
    rel = (num ** 0.5) / max(den ** 0.5, 1e-30)
    return Deviation(max_abs, rel)
