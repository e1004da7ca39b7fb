"""Outline a set of nodes of a Program's graph into a child GraphModule called through one `call_module` node.

Passes that wrap part of a graph in a module (checkpoint regions, offload regions) share this helper:

    from fxmem.outline import outline
    call = outline(program, nodes, "ckpt_h_0", wrap=lambda body: CheckpointRegion(body))

Parameters and buffers stay owned by the outer module and are passed in as arguments; the region must be convex
(else `OutlineError` names a node on the offending path); the outer graph is re-ordered as little as possible, so
execution order stays as it was elsewhere; node meta is kept. Call `program.refresh()` after outlining.
Design: docs/design/overview.md, "Outlining a region".
"""
from __future__ import annotations

import operator
import re
from typing import Callable, Iterable

import networkx as nx
from torch import fx, nn

from .errors import FxmemError
from .fx_digraph import as_digraph
from .program import Program

__all__ = ["outline", "OutlineError", "check_outline", "region_boundary", "unique_name", "stable_toposort"]


class OutlineError(FxmemError):
    """The nodes given to `outline` cannot become one call (not convex, contain placeholders/outputs, ...)."""


def region_boundary(nodes: Iterable[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(inputs, outputs) of a node set, in graph order.

    inputs: values defined outside the set (get_attr nodes included) that nodes of the set read.
    outputs: nodes of the set that a node outside the set reads.
    """
    members = {node for node in nodes if node.op != "get_attr"}
    ins: dict[fx.Node, None] = {}
    outs: dict[fx.Node, None] = {}
    for node in _in_graph_order(members):
        for source in node.all_input_nodes:
            if source not in members:
                ins.setdefault(source, None)
        if any(u not in members for u in node.users):
            outs[node] = None
    return list(ins), list(outs)


def unique_name(root: nn.Module, name: str) -> str:
    """`name`, or `name_1`, `name_2`, ... if the root already has such an attribute."""
    base = re.sub(r"[^0-9A-Za-z_]", "_", name) or "region"  # dots and other punctuation -> '_'
    if base[0].isdigit():
        base = "_" + base
    cand, suffix = base, 0
    while hasattr(root, cand):
        suffix += 1
        cand = f"{base}_{suffix}"
    return cand


def outline(program: Program, nodes: list[fx.Node], name: str,
            wrap: Callable[[fx.GraphModule], nn.Module] | None = None, recompile: bool = True) -> fx.Node:
    """Replace `nodes` of `program`'s graph by one call to a new submodule; return the call node.

    program: the Program to rewrite (in place). nodes: the region (any order; get_attr nodes are left outside).
    name: attribute name for the new submodule on the root (dots become underscores; made unique).
    wrap: builds the module from the child GraphModule (default: the child itself).
    recompile: lint the graph and regenerate the root's code. A caller outlining many regions passes False and
    does both once after the last (`program.module.graph.lint(); program.module.recompile()`): on a 12-layer
    decoder each costs about as much as the outlining itself.
    Submodules the nodes call (regions outlined before, inside a block `fxmem.distribute` outlines) move into the
    new submodule.
    Raises OutlineError if the region is empty, contains placeholders/outputs, or is not convex.
    """
    graph_module = program.module
    graph = graph_module.graph
    members, inputs, outputs = check_outline(nodes, name)
    member_set = set(members)

    # ---------------------------------------------------------------------------- the child graph
    child = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for input_node in inputs:
        placeholder = child.placeholder(input_node.name)
        placeholder.meta = dict(input_node.meta)
        env[input_node] = placeholder
    for node in members:
        env[node] = child.node_copy(node, lambda a: env[a])
    if len(outputs) == 1:
        child.output(env[outputs[0]])
    else:
        child.output(tuple(env[output_node] for output_node in outputs))
    child.lint()
    # submodules the region calls (an earlier region inside a block being outlined) move into the body
    inner = [node.target for node in members if node.op == "call_module"]
    body = fx.GraphModule(graph_module if inner else nn.Module(), child,
                          class_name="Region_" + re.sub(r"[^0-9A-Za-z_]", "_", name))
    mod = wrap(body) if wrap is not None else body

    attr = unique_name(graph_module, name)
    graph_module.add_submodule(attr, mod)

    # ---------------------------------------------------------------------------- the call in the outer graph
    with graph.inserting_after(members[-1]):
        call = graph.call_module(attr, tuple(inputs))
    call.meta["nn_module_stack"] = _common_stack(members)
    call.meta["fxmem_region"] = attr
    if len(outputs) == 1:
        call.meta.update({k: v for k, v in outputs[0].meta.items() if k in ("val", "fxmem_val", "tensor_meta")})
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in member_set)
    else:
        call.meta["val"] = tuple(output_node.meta.get("val") for output_node in outputs)
        prev = call
        for index, output_node in enumerate(outputs):
            with graph.inserting_after(prev):
                getitem = graph.call_function(operator.getitem, (call, index))
            getitem.meta = {k: v for k, v in output_node.meta.items()
                            if k in ("val", "fxmem_val", "tensor_meta", "nn_module_stack", "stack_trace")}
            output_node.replace_all_uses_with(getitem,
                                              delete_user_cb=lambda u: u not in member_set and u is not call)
            prev = getitem
    for node in reversed(members):
        graph.erase_node(node)
    for target in inner:
        if not any(node.op == "call_module" and node.target == target for node in graph.nodes):
            parent, _, leaf = target.rpartition(".")
            delattr(graph_module.get_submodule(parent) if parent else graph_module, leaf)
    stable_toposort(graph)
    if recompile:
        graph.lint()
        graph_module.recompile()
    return call


def check_outline(nodes: list[fx.Node], name: str) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """What `outline` checks before it changes anything: (members in graph order, inputs, outputs), or
    OutlineError (empty, placeholders/outputs, not convex, nothing used outside)."""
    members = [n for n in _in_graph_order(set(nodes)) if n.op != "get_attr"]
    if not members:
        raise OutlineError(f"outline {name!r}: no nodes to outline")
    bad = [n.name for n in members if n.op in ("placeholder", "output")]
    if bad:
        raise OutlineError(f"outline {name!r}: cannot outline placeholder/output nodes {bad}")
    _check_convex(set(members), name)
    inputs, outputs = region_boundary(members)
    if not outputs:
        raise OutlineError(f"outline {name!r}: the region's values are never used outside it "
                           f"(nothing to return; first node {members[0].name})")
    return members, inputs, outputs


# ============================================================================================ helpers

def _in_graph_order(nodes: set) -> list[fx.Node]:
    if not nodes:
        return []
    graph = next(iter(nodes)).graph
    return [n for n in graph.nodes if n in nodes]


def _check_convex(members: set, name: str) -> None:
    """No path member -> outside -> ... -> member."""
    order = {n: i for i, n in enumerate(next(iter(members)).graph.nodes)}
    last = max(order[n] for n in members)
    # forward search from outside users of members, limited to nodes before the region's last node
    frontier = [user for n in members for user in n.users if user not in members and order[user] < last]
    seen: set = set()
    while frontier:
        outside = frontier.pop()
        if outside in seen:
            continue
        seen.add(outside)
        for user in outside.users:
            if user in members:
                raise OutlineError(f"outline {name!r}: the nodes are not convex: {outside.name} (outside) reads a "
                                   f"region value and feeds {user.name} (inside)")
            if order[user] < last:
                frontier.append(user)


def _common_stack(members: list[fx.Node]) -> dict:
    stacks = [list((n.meta.get("nn_module_stack") or {}).items()) for n in members]
    stacks = [stack for stack in stacks if stack]
    if not stacks:
        return {}
    common = stacks[0]
    for stack in stacks[1:]:
        depth = 0
        while depth < min(len(common), len(stack)) and common[depth][0] == stack[depth][0]:
            depth += 1
        common = common[:depth]
    return dict(common)


def stable_toposort(graph: fx.Graph) -> None:
    """Re-order `graph` topologically, keeping each node as early as its original position allows (the
    lexicographic topological order on the original positions: when the graph is already ordered nothing moves)."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    try:
        order = list(nx.lexicographical_topological_sort(as_digraph(graph), key=position.__getitem__))
    except nx.NetworkXUnfeasible:
        raise OutlineError("graph has a cycle after outlining") from None
    if order == nodes:
        return
    previous = None
    for node in order:  # move nodes into place: append each after the previous one
        if previous is not None and previous.next is not node:
            previous.append(node)
        previous = node