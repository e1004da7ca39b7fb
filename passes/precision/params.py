"""Parameters replaced on a snapshot only: new Parameter objects on containers made private to it
(`fxmem.copy_on_write`)."""
from __future__ import annotations

from torch import fx, nn

from fxmem.copy_on_write import private_owner
from fxmem.depgroups import attr_of


def _owner(graph_module: nn.Module, target: str):
    prefix, _, name = target.rpartition(".")
    return private_owner(graph_module, prefix), name


def replace_params(graph_module: fx.GraphModule, convert, only=None) -> list[str]:
    """Replace the get_attr'd parameters with new Parameters `convert(param)` (tied parameters stay tied).

    New Parameter objects on the snapshot's own containers: the rollback copy keeps the old ones."""
    done: dict[int, nn.Parameter] = {}
    names = []
    for node in graph_module.graph.nodes:
        if node.op != "get_attr" or (only is not None and node.target not in only):
            continue
        try:
            param = attr_of(graph_module, node.target)
        except AttributeError:
            continue
        if not isinstance(param, nn.Parameter):
            continue
        new = done.get(id(param))
        if new is None:
            new = convert(param)
            done[id(param)] = new
        owner, name = _owner(graph_module, node.target)
        if getattr(owner, name) is not new:
            owner._parameters[name] = new
            names.append(node.target)
    return names
