"""The example value of an fx node: the FakeTensor (or python scalar, or tuple of them) the node produced when the
graph last ran on the example inputs.

Two runs leave one in `node.meta`: `program.refresh()` stores a concrete one under "fxmem_val" (sizes at the
example inputs), and torch.export stores a symbolic one under "val" (sizes such as `s0` where a dim is dynamic).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

CONCRETE = "concrete"  # "fxmem_val", else "val": sizes at the example inputs where fxmem has refreshed the graph
SYMBOLIC = "symbolic"  # "val", else "fxmem_val": export's symbolic sizes where the node has them
EXPORT = "export"  # "val" alone: what export recorded, None for a node fxmem added without one

_KEYS = {CONCRETE: ("fxmem_val", "val"), SYMBOLIC: ("val", "fxmem_val"), EXPORT: ("val",)}


def node_value(arg, *, source: str = CONCRETE, tensor_only: bool = False, literals: bool = False) -> Any:
    """The example value of `arg`, an fx node (or an argument of one): the first of `source`'s meta keys that
    holds a value other than None, else None.

    tensor_only: None unless the value is a tensor (a python scalar or a tuple of tensors gives None).
    literals: an argument that is not a node (a python scalar, a dtype in `node.args`) is its own value; without
    it, None.
    """
    if not isinstance(arg, fx.Node):
        value = arg if literals else None
    else:
        value = next((arg.meta[key] for key in _KEYS[source] if arg.meta.get(key) is not None), None)
    if tensor_only and not isinstance(value, torch.Tensor):
        return None
    return value
