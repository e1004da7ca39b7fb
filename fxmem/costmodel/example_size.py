"""A symbolic size's example value without a guard, under each torch the package supports.

torch 2.13 names it `optimization_hint`, 2.11-2.12 `size_hint`, earlier ones `hint_int` (deprecated by 2.11).
"""
from __future__ import annotations

try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint as example_size
except ImportError:
    try:
        from torch.fx.experimental.symbolic_shapes import size_hint as example_size
    except ImportError:
        from torch.fx.experimental.symbolic_shapes import hint_int as example_size

__all__ = ["example_size"]
