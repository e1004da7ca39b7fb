"""Small graph helpers the parts of the precision pass share: a node's float dtype, its tensor arguments,
parameter attributes, module-path patterns."""
from __future__ import annotations

import fnmatch

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxmem.depgroups import attr_of
from fxmem.node_value import node_value


def orig_float_dtype(node: fx.Node) -> torch.dtype | None:
    """The float dtype of a node's (first float) output in the graph as it is now, or None."""
    for value in pytree.tree_leaves(node_value(node)):
        if isinstance(value, torch.Tensor):
            return value.dtype if value.is_floating_point() else None
    return None


def matching_pattern(path: str, patterns) -> str | None:
    for pattern in patterns:
        if path == pattern or fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern + "."):
            return pattern
    return None


def node_args(node: fx.Node) -> list[fx.Node]:
    out = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a))
    return out


def is_param_attr(graph_module: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "get_attr":
        return False
    try:
        return isinstance(attr_of(graph_module, node.target), nn.Parameter)
    except AttributeError:
        return False


def node_by_name(graph_module, name):
    for node in graph_module.graph.nodes:
        if node.name == name:
            return node
    raise KeyError(name)
