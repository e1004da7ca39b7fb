"""Candidate regions where the module structure gives none: the graph's own runs of nodes, cut by what they save.

Checkpoint and offload find their regions at module boundaries (`nn_module_stack`). A model written with functional
ops at its root (a CNN calling `F.conv2d` on its own parameters, a scan in a Python loop) has no such boundaries:
its saves belong to no module run, and a pass built on module runs finds nothing to act on. When the module runs
hold less than `MODULE_SHARE` of what the forward saves, the nodes they leave out are cut into segments: runs of
consecutive nodes, each closed once it holds about 1/`SEGMENTS` of those nodes' saved bytes. A segment is named
by its first and last node (`graph:conv2d..relu_3`).
"""
from __future__ import annotations

import operator
from typing import Callable

from torch import fx

MODULE_SHARE = 0.5  # module runs saving less than this share of the forward's bytes: the rest is segmented
SEGMENTS = 8  # segments the left-out nodes' saved bytes are cut into (about)


def with_segments(runs: list, nodes: list[fx.Node], saved_by_node: dict[str, int],
                  may_hold: Callable[[fx.Node], bool], make: Callable[[str, list], object]) -> list:
    """`runs` (module runs, each with `nodes`) and, when they save less than MODULE_SHARE of the forward's bytes,
    `make(name, segment)` for each segment of the nodes `may_hold` admits and no run holds, in graph order."""
    owned = {node for run in runs for node in run.nodes}
    if not needs_segments(owned, saved_by_node):
        return runs
    segments = graph_segments(nodes, lambda node: may_hold(node) and node not in owned, saved_by_node)
    position = {node: i for i, node in enumerate(nodes)}
    out = runs + [make(segment_name(segment), segment) for segment in segments]
    return sorted(out, key=lambda run: position[run.nodes[0]])


def needs_segments(owned: set, saved_by_node: dict[str, int]) -> bool:
    """True when the nodes in module runs (`owned`) save less than MODULE_SHARE of all saved bytes."""
    total = sum(saved_by_node.values())
    in_runs = sum(saved_by_node.get(node.name, 0) for node in owned)
    return total > 0 and in_runs < MODULE_SHARE * total


def graph_segments(nodes: list[fx.Node], may_hold: Callable[[fx.Node], bool],
                   saved_by_node: dict[str, int]) -> list[list[fx.Node]]:
    """Runs of consecutive `nodes` that `may_hold` admits, each cut after it saves 1/SEGMENTS of their bytes.
    Placeholders and attributes do not break a run; a getitem stays with the node whose tuple it reads (a run
    hands on tensors, not a tuple); any other node `may_hold` refuses ends the run before it."""
    share = sum(saved_by_node.get(node.name, 0) for node in nodes if may_hold(node)) / SEGMENTS
    segments: list[list[fx.Node]] = []
    current: list[fx.Node] | None = None
    members: set[fx.Node] = set()  # the current segment's nodes
    held = 0  # bytes the current segment saves
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if current is not None and _reads_tuple(node) in members:
            current.append(node)
            continue
        if not may_hold(node) or node.target is operator.getitem:
            current = None
            continue
        if current is None or held >= max(share, 1):
            current, members, held = [], set(), 0
            segments.append(current)
        current.append(node)
        members.add(node)
        held += saved_by_node.get(node.name, 0)
    return [segment for segment in segments if any(saved_by_node.get(node.name, 0) for node in segment)]


def segment_name(segment: list[fx.Node]) -> str:
    """`graph:first..last` by node name (one node: `graph:name`), apart from every module path."""
    first, last = segment[0].name, segment[-1].name
    return f"graph:{first}" if first == last else f"graph:{first}..{last}"


def _reads_tuple(node: fx.Node) -> fx.Node | None:
    """The node whose tuple `node` reads an element of (None: `node` is no getitem)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0]
    return None
