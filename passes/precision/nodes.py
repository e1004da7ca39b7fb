"""Small graph helpers the parts of the precision pass share: a node's float dtype, its tensor arguments,
parameter attributes, module-path patterns."""
from __future__ import annotations

import fnmatch

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxmem.depgroups import attr_of
from fxmem.node_value import node_value


def orig_float_dtype(n: fx.Node) -> torch.dtype | None:
    """The float dtype of a node's (first float) output in the graph as it is now, or None."""
    for t in pytree.tree_leaves(node_value(n)):
        if isinstance(t, torch.Tensor):
            return t.dtype if t.is_floating_point() else None
    return None


def matching_pattern(path: str, patterns) -> str | None:
    for p in patterns:
        if path == p or fnmatch.fnmatchcase(path, p) or path.startswith(p + "."):
            return p
    return None


def node_args(n: fx.Node) -> list[fx.Node]:
    out = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a))
    return out


def is_param_attr(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op != "get_attr":
        return False
    try:
        return isinstance(attr_of(gm, n.target), nn.Parameter)
    except AttributeError:
        return False


def node_by_name(gm, name):
    for n in gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(name)
