"""GCN node classifier (torch_geometric ``GCNConv``) on Zachary's karate club.

What it is
    ``n_layers`` (default 3) ``GCNConv`` layers with ReLU and dropout between them, the last
    layer producing class logits per node. ``forward(x, edge_index) -> logits (num_nodes, 4)``.

Data
    ``torch_geometric.datasets.KarateClub()``: the graph ships inside torch_geometric's source
    (no download, no files written). 34 nodes, 156 directed edges, one-hot node features
    (34 dims), 4 community labels. Because features are one-hot, a node's identity is
    ``x.argmax(-1)``, so ``loss_fn`` recovers each node's label from the inputs alone, even for
    a subgraph, a permutation or a disjoint union of copies.
    Split (deterministic): nodes with ``id % 3 == 2`` are held out (11 nodes, used by
    ``evaluate``); the other 23 are the training nodes used by ``loss_fn``.

Default size
    hidden 16, 3 layers, dropout 0.5. Inputs ``(x, edge_index)`` = (float32 (34, 34), int64 (2, 156)).
    About 0.9 K parameters.

Scaling
    ``build_model(hidden=..., n_layers=...)``; ``example_inputs(copies=k)`` gives the disjoint union
    of k copies of the graph (34k nodes, 156k edges, as PyG mini-batching does);
    ``example_inputs(num_nodes=n)`` gives the induced subgraph on nodes 0..n-1.

Export notes
    ``GCNConv`` (with its cached-less ``gcn_norm``: add_remaining_self_loops, scatter-add degree,
    index_select / scatter message passing) captures with ``torch.export(strict=False)``; with
    ``Dim.AUTO`` on both dims of both inputs, the node and edge counts stay dynamic, the feature
    dim (34) and edge_index's leading 2 are specialised.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(hidden=16, n_layers=3, dropout=0.5)
NUM_FEATURES = 34
NUM_CLASSES = 4


class GCN(nn.Module):
    def __init__(self, in_channels=NUM_FEATURES, hidden=16, out_channels=NUM_CLASSES, n_layers=3, dropout=0.5):
        super().__init__()
        from torch_geometric.nn import GCNConv

        dims = [in_channels] + [hidden] * (n_layers - 1) + [out_channels]
        self.convs = nn.ModuleList([GCNConv(a, b) for a, b in zip(dims[:-1], dims[1:])])
        self.dropout = nn.Dropout(dropout)
        self.act = nn.ReLU()

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = self.dropout(self.act(x))
        return x


def build_model(**kwargs):
    cfg = {**DEFAULTS, **{k: v for k, v in kwargs.items() if k in DEFAULTS}}
    torch.manual_seed(0)
    return GCN(hidden=cfg["hidden"], n_layers=cfg["n_layers"], dropout=cfg["dropout"])


# ---------------------------------------------------------------- karate club data (ships with PyG)

def _karate():
    from torch_geometric.datasets import KarateClub

    return KarateClub()[0]


def _subgraph(data, num_nodes):
    from torch_geometric.utils import subgraph

    subset = torch.arange(num_nodes)
    ei, _ = subgraph(subset, data.edge_index, relabel_nodes=True, num_nodes=data.num_nodes)
    return data.x[subset].clone(), ei


def _union(x, edge_index, copies):
    n = x.size(0)
    xs = torch.cat([x] * copies, dim=0)
    eis = torch.cat([edge_index + i * n for i in range(copies)], dim=1)
    return xs, eis


def example_inputs(copies=1, num_nodes=None, **_):
    """``(x, edge_index)`` of the karate club graph (or a subgraph / a union of copies)."""
    data = _karate()
    if num_nodes is not None:
        x, ei = _subgraph(data, num_nodes)
    else:
        x, ei = data.x.clone(), data.edge_index.clone()
    if copies > 1:
        x, ei = _union(x, ei, copies)
    return (x, ei)


def _node_ids(x):
    return x.argmax(dim=-1)  # features are one-hot node ids


# KarateClub().y (4 communities), stored as a constant so loss_fn also runs on fake tensors
# (fxmem's traced estimate calls loss_fn under FakeTensorMode, where building the dataset cannot run).
# tests/test_examples_files.py checks it still equals the dataset's labels.
KARATE_LABELS = [1, 1, 1, 1, 3, 3, 3, 1, 0, 1, 3, 1, 1, 1, 0, 0, 3, 1, 0, 1, 0, 1, 0, 0, 2, 2, 0, 0, 2, 0, 0, 2, 0, 0]


def _labels_and_masks(x):
    ids = _node_ids(x)
    y = torch.tensor(KARATE_LABELS, device=x.device)[ids]
    heldout = (ids % 3) == 2
    return y, ~heldout, heldout


def loss_fn(output, inputs):
    """Cross-entropy on the training nodes (node id % 3 != 2) present in the inputs."""
    logits = output[0] if isinstance(output, (tuple, list)) else output
    y, train, _ = _labels_and_masks(inputs[0])
    w = train.to(logits.dtype)
    ce = F.cross_entropy(logits, y, reduction="none")
    return (ce * w).sum() / w.sum().clamp_min(1.0)


def calibration_data(n_batches=8):
    """The real karate graph ``n_batches`` times, each with a different deterministic node order.

    Same shapes every time (34 nodes, 156 edges), real features and edges; node i of batch b is
    original node ``perm_b[i]``.
    """
    data = _karate()
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(n_batches):
        perm = torch.arange(data.num_nodes) if b == 0 else torch.randperm(data.num_nodes, generator=g)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        out.append((data.x[perm].clone(), inv[data.edge_index]))
    return out


@torch.no_grad()
def evaluate(module):
    """Accuracy on the 11 held-out nodes (id % 3 == 2) of the karate club graph."""
    was_training = getattr(module, "training", False)
    try:
        module.eval()
    except NotImplementedError:  # bare torch.export module: evaluated in the mode it was captured in
        pass
    try:
        inputs = example_inputs()
        out = module(*inputs)
        logits = out[0] if isinstance(out, (tuple, list)) else out
        y, _, held = _labels_and_masks(inputs[0])
        return (logits.argmax(-1)[held] == y[held]).float().mean().item()
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass
