"""Parameters replaced on a snapshot only: new Parameter objects on containers made private to it
(`fxmem.copy_on_write`)."""
from __future__ import annotations

from torch import fx, nn

from fxmem.copy_on_write import private_owner
from fxmem.depgroups import attr_of


def _owner(gm: nn.Module, target: str):
    prefix, _, name = target.rpartition(".")
    return private_owner(gm, prefix), name


def replace_params(gm: fx.GraphModule, fn, only=None) -> list[str]:
    """Replace the get_attr'd parameters with new Parameters `fn(p)` (tied parameters stay tied).

    New Parameter objects on the snapshot's own containers: the rollback copy keeps the old ones."""
    done: dict[int, nn.Parameter] = {}
    names = []
    for n in gm.graph.nodes:
        if n.op != "get_attr" or (only is not None and n.target not in only):
            continue
        try:
            p = attr_of(gm, n.target)
        except AttributeError:
            continue
        if not isinstance(p, nn.Parameter):
            continue
        new = done.get(id(p))
        if new is None:
            new = fn(p)
            done[id(p)] = new
        owner, name = _owner(gm, n.target)
        if getattr(owner, name) is not new:
            owner._parameters[name] = new
            names.append(n.target)
    return names
