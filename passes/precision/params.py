"""Parameters replaced on a snapshot only: copy-on-write of the containers along a path, new Parameter objects."""
from __future__ import annotations

import copy
import uuid

from torch import fx, nn

from fxmem.depgroups import attr_of


def own_path(gm: nn.Module, prefix: str) -> nn.Module:
    """Make the containers along `prefix` private to `gm` (shallow copies) and return the innermost.

    A Program snapshot shares its submodule containers with the Program it was taken from (torch's GraphModule
    copies only what the graph references and reuses existing containers), so a pass that sets an attribute on
    a container would change the rollback copy too. Copy-on-write keeps the change in this GraphModule. The mark is
    the owner's token (a string), not the owner: a container that refers to another GraphModule would make every
    deepcopy of a result copy that module too (a candidate the guard discarded), inside its own copy."""
    mod = gm
    if not prefix:
        return mod
    token = _owner_token(gm)
    for item in prefix.split("."):
        child = mod._modules[item]
        if getattr(child, "_fxmem_owner", None) != token:
            new = copy.copy(child)
            new._parameters = dict(child._parameters)
            new._buffers = dict(child._buffers)
            new._modules = dict(child._modules)
            new._non_persistent_buffers_set = set(child._non_persistent_buffers_set)
            object.__setattr__(new, "_fxmem_owner", token)
            mod._modules[item] = new
            child = new
        mod = child
    return mod


def _owner_token(gm: nn.Module) -> str:
    """A token naming `gm` as the owner of the containers `own_path` copied for it (copied along with it by
    deepcopy, which copies those containers too; a snapshot gets its own)."""
    token = gm.__dict__.get("_fxmem_owner_token")
    if token is None:
        token = uuid.uuid4().hex
        object.__setattr__(gm, "_fxmem_owner_token", token)
    return token


def _owner(gm: nn.Module, target: str):
    prefix, _, name = target.rpartition(".")
    return own_path(gm, prefix), name


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
