"""Copy-on-write of the module containers along a dotted path, so a pass changes its own program's tree only.

`Program.snapshot()` shares submodule containers with the program it was taken from (torch's GraphModule copies
only what the graph references and reuses existing containers), so setting or deleting an attribute on a shared
container would change the rollback copy too. `private_owner(root, "h.3.mlp")` first replaces every container on
the path by a shallow copy with its own parameter, buffer, module and non-persistent-buffer collections, then
returns the innermost one, which the caller may change freely.
"""
from __future__ import annotations

import copy
import uuid

from torch import nn


def private_owner(root: nn.Module, prefix: str) -> nn.Module:
    """The module at `prefix` (the root for ""), with every container on the way made private to `root`.

    A container is copied once per owner: copies carry the owner's token (a string, not the owner: a container that
    refers to another GraphModule would make every deepcopy of a result copy that module too, inside its own
    copy), and a container already carrying `root`'s token is `root`'s own."""
    module = root
    if not prefix:
        return module
    token = _owner_token(root)
    for item in prefix.split("."):
        child = module._modules[item]
        if getattr(child, "_fxmem_owner", None) != token:
            private_copy = copy.copy(child)
            private_copy._parameters = dict(child._parameters)
            private_copy._buffers = dict(child._buffers)
            private_copy._modules = dict(child._modules)
            private_copy._non_persistent_buffers_set = set(child._non_persistent_buffers_set)
            object.__setattr__(private_copy, "_fxmem_owner", token)
            module._modules[item] = private_copy
            child = private_copy
        module = child
    return module


def _owner_token(root: nn.Module) -> str:
    """A token naming `root` as the owner of the containers `private_owner` copied for it (copied along with it by
    deepcopy, which copies those containers too; a snapshot gets its own)."""
    token = root.__dict__.get("_fxmem_owner_token")
    if token is None:
        token = uuid.uuid4().hex
        object.__setattr__(root, "_fxmem_owner_token", token)
    return token
