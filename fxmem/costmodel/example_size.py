"""A symbolic size's example value without a guard, under each torch the package supports.

torch 2.13 names it `optimization_hint`, 2.11-2.12 `size_hint`, earlier ones `hint_int` (deprecated by 2.11).
Whether a size has a value before the step runs (a backed symbol: yes; an unbacked one, from data: no) is asked of
the symbol's node, which every supported torch answers alike (2.13's `has_guarding_hint` does the same, 2.11 has
no such name).
"""
from __future__ import annotations

import torch

try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint as example_size
except ImportError:
    try:
        from torch.fx.experimental.symbolic_shapes import size_hint as example_size
    except ImportError:
        from torch.fx.experimental.symbolic_shapes import hint_int as example_size


def known_size(value) -> int | None:
    """`value` as an int where it has one before the step runs: an int as is, a backed symbol at its example value;
    None for a size that depends on the data (an unbacked symbol)."""
    if not isinstance(value, torch.SymInt):
        return value
    return int(example_size(value)) if value.node.has_hint() else None


__all__ = ["example_size", "known_size"]
