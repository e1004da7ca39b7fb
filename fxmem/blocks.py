"""The repeated blocks of a model, found from its graph: the transformer layers `h.0`, `h.1`, ... of one type under
one parent. Several parts read them: the checkpoint pass keeps regions inside blocks for FSDP, the offload pass
records them in its plan, `fxmem.distribute` shards each block apart."""
from __future__ import annotations

from torch import fx

from .program import module_stack


def named_stack(node: fx.Node) -> list[tuple[str, str]]:
    """[(module path, type name), ...] of the modules a node belongs to, outermost first, without the root."""
    return [(path, type_name) for path, type_name in module_stack(node) if path]


def block_paths(graph_module: fx.GraphModule) -> list[str]:
    """Outermost repeated blocks: modules of one type under one parent whose names are numbers."""
    seen: dict[str, str] = {}
    order: list[str] = []
    for node in graph_module.graph.nodes:
        for path, type_name in named_stack(node):
            if path not in seen:
                seen[path] = type_name
                order.append(path)
    groups: dict[tuple[str, str], list[str]] = {}
    for path in order:
        parent, _, leaf = path.rpartition(".")
        if leaf.isdigit():
            groups.setdefault((parent, seen[path]), []).append(path)
    cands = [ps for ps in groups.values() if len(ps) >= 2]
    if not cands:
        return []
    depth = min(ps[0].count(".") for ps in cands)
    out = []
    for paths in cands:
        if paths[0].count(".") == depth:
            out.extend(paths)
    return [p for p in order if p in set(out)]


def node_blocks(graph_module: fx.GraphModule) -> dict[fx.Node, str | None]:
    """Each node's block (`block_paths`), None for the root's nodes."""
    paths = set(block_paths(graph_module))
    return {n: next((p for p, _ in named_stack(n) if p in paths), None) for n in graph_module.graph.nodes}
