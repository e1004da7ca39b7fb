"""The repeated blocks of a model, found from its graph: the transformer layers `h.0`, `h.1`, ... of one type under
one parent. Several parts read them: the checkpoint pass keeps regions inside blocks for FSDP, the offload pass
records them in its plan, `fxmem.distribute` shards each block apart."""
from __future__ import annotations

from torch import fx

from .program import module_stack


def named_stack(node: fx.Node) -> list[tuple[str, str]]:
    """[(module path, type name), ...] of the modules a node belongs to, outermost first, without the root."""
    return [(path, type_name) for path, type_name in module_stack(node) if path]


def block_paths(gm: fx.GraphModule) -> list[str]:
    """Outermost repeated blocks: modules of one type under one parent whose names are numbers."""
    seen: dict[str, str] = {}
    order: list[str] = []
    for n in gm.graph.nodes:
        for p, t in named_stack(n):
            if p not in seen:
                seen[p] = t
                order.append(p)
    groups: dict[tuple[str, str], list[str]] = {}
    for p in order:
        parent, _, leaf = p.rpartition(".")
        if leaf.isdigit():
            groups.setdefault((parent, seen[p]), []).append(p)
    cands = [ps for ps in groups.values() if len(ps) >= 2]
    if not cands:
        return []
    depth = min(ps[0].count(".") for ps in cands)
    out = []
    for ps in cands:
        if ps[0].count(".") == depth:
            out.extend(ps)
    return [p for p in order if p in set(out)]


def node_blocks(gm: fx.GraphModule) -> dict[fx.Node, str | None]:
    """Each node's block (`block_paths`), None for the root's nodes."""
    paths = set(block_paths(gm))
    return {n: next((p for p, _ in named_stack(n) if p in paths), None) for n in gm.graph.nodes}
