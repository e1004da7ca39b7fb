"""How a module that a pass inserted tells the cost model what it does with saved tensors.

A checkpoint region recomputes what its body would save (except ops it keeps); an offload region moves what its
body saves off the device until backward needs it. Such a module sets `fxmem_region = RegionInfo(...)`; the
cost model runs `body` in its static trace and models the region's memory. Passes own their modules; this is
the only contract between them and the cost model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from ..ops import packet


@dataclass
class RegionInfo:
    kind: str  # "recompute" | "offload"
    body: Callable[..., Any]  # the computation, called with the region's inputs
    keep_ops: frozenset = field(default_factory=frozenset)  # op packet names whose outputs are saved anyway
    # recompute: kept ops whose outputs the region itself holds until its whole backward is done (dropout masks a
    # draw tape replays), not only until the backward of the op that saves them
    held_ops: frozenset = field(default_factory=frozenset)
    tier: str = "cpu"  # offload: "cpu" | "disk"
    offload_inputs: bool = False  # recompute: the region's saved inputs are offloaded too (offload around checkpoint)
    # recompute: its forward runs inside the module's recipe scope and backward recomputes only what it reads, under
    # no_grad (`fxmem.nn.region_recipe`), not by torch's checkpoint
    as_recipes: bool = False

    def keeps(self, func) -> bool:
        return names_op(func, self.keep_ops)

    def holds(self, func) -> bool:
        return names_op(func, self.held_ops)


def names_op(func, ops) -> bool:
    """`func` is one of `ops`, by its packet name or its full overload name (how keep_ops name ops)."""
    return bool(ops) and (packet(func) in ops or str(func) in ops)


def region_info(mod: nn.Module) -> RegionInfo | None:
    info = getattr(mod, "fxmem_region", None)
    return info if isinstance(info, RegionInfo) else None
