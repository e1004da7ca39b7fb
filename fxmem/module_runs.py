"""Runs of graph nodes owned by one module call, as the checkpoint and offload passes make them candidate regions:
the names and places they share once each pass has built its runs."""
from __future__ import annotations

from torch import fx

from .errors import PolicyError


def finish_runs(runs: list, nodes: list[fx.Node], explicit, policy_key: str) -> None:
    """Name repeated calls of one module apart (`path`, `path#1`, ...), place each run in `nodes` (`first`, `last`:
    its first and last node's positions), and refuse module paths the policy named explicitly that no run belongs
    to (a PolicyError naming `policy_key`). A run has `path`, `nodes`, `first` and `last`."""
    calls: dict[str, int] = {}
    for run in runs:
        seen = calls.get(run.path, 0)
        calls[run.path] = seen + 1
        if seen:
            run.path = f"{run.path}#{seen}"
    position = {node: i for i, node in enumerate(nodes)}
    for run in runs:
        run.first, run.last = position[run.nodes[0]], position[run.nodes[-1]]
    missing = [path for path in explicit or () if not any(run.path.split("#")[0] == path for run in runs)]
    if missing:
        raise PolicyError(f"{policy_key}: no graph nodes belong to module(s) {missing}")
