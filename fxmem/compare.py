"""Comparing outputs and gradients: one place for what "equal" means, used by capture, verification and tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree


def _leaves(x):
    # HF ModelOutput is a registered pytree / OrderedDict; dict-like outputs flatten by key
    return pytree.tree_leaves(x)


def compare_outputs(ref, got, *, atol: float, rtol: float) -> str | None:
    """None when every tensor leaf matches within (atol, rtol); else a one-line description of the worst leaf."""
    a, b = _leaves(ref), _leaves(got)
    if len(a) != len(b):
        return f"output structure differs: {len(a)} leaves vs {len(b)}"
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
            xd, yd = x.detach().double(), y.detach().double()
            if not torch.allclose(xd, yd, atol=atol, rtol=rtol, equal_nan=True):
                d = (xd - yd).abs().max().item()
                return f"output leaf {i}: max abs diff {d:.3g} (atol {atol:g}, rtol {rtol:g})"
        elif not torch.equal(x, y):
            return f"output leaf {i}: integer/bool values differ"
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
