"""An fx graph as a networkx DiGraph (fx nodes as vertices, an edge from each input to its user), so graph
questions (topological orders, reachability) use networkx's algorithms instead of hand-written searches."""
from __future__ import annotations

from typing import Callable

import networkx as nx
from torch import fx


def as_digraph(graph: fx.Graph, keep: Callable[[fx.Node], bool] = lambda node: True) -> nx.DiGraph:
    """The data-flow graph of `graph`'s nodes for which `keep` holds (edges between kept nodes only)."""
    digraph = nx.DiGraph()
    kept = [node for node in graph.nodes if keep(node)]
    digraph.add_nodes_from(kept)
    members = set(kept)
    digraph.add_edges_from((source, node) for node in kept for source in node.all_input_nodes if source in members)
    return digraph
