"""Hybrid GNN + spatio-temporal attention network (STAN) for graph-level classification.

What it is
    A brain-network style classifier: each sample ("subject") has N regions (nodes) on a shared
    connectivity graph, a feature vector per region, and a time series per region.

    * GNN branch: 2 ``torch_geometric.nn.GCNConv`` layers over the B subject graphs, batched as one
      disjoint union (edge_index offset by ``b * N`` inside ``forward``) -> (B, N, gnn_hidden).
    * Spatio-temporal branch: every region's series is embedded per step (Linear(1, d) + learned
      position embedding), then *temporal* multi-head self-attention over the T steps of each region
      (written by hand: ``q @ k^T / sqrt(dh)`` -> softmax -> dropout -> ``@ v``), mean-pooled over
      time, then *spatial* self-attention across the N regions (hand-written too, scaled by a ``mul``)
      -> (B, N, d).
    * Fusion: concat both per-region embeddings, mean+max pool over regions, MLP -> logits (B, 2).

Inputs: ``(x_nodes, edge_index, series)``
    x_nodes    float32 (B, N, F)   per-region features (F = 8 summary statistics of the series:
                                   mean, std, min, max, lag-1..4 autocorrelation)
    edge_index int64   (2, E)      shared connectivity over node ids 0..N-1 (ring +-1 and +-4 hops)
    series     float32 (B, N, T)   per-region time series
    Default B=4, N=16, E=64, T=32, F=8. Output: logits (B, 2).

Data (synthetic, deterministic)
    Generated with a seeded ``torch.Generator``: a nonlinear vector autoregression on the graph,
    ``s_t = tanh(c * A_norm s_{t-1}) + 0.5 * noise``, with coupling c = 0.6 (class 0) or 1.4 (class 1)
    plus a class-1 slow oscillation in half of the regions. Row ``b`` of every batch has label
    ``b % 2`` (positional labels, so ``loss_fn`` needs only the inputs). ``calibration_data`` uses seeds
    1.., ``evaluate`` (accuracy) uses held-out seeds 1000...

Default size / scaling
    gnn_hidden 32, d_model 32, 4 heads, dropout 0.1, max_len 128: about 21 K parameters.
    ``build_model(gnn_hidden=, d_model=, n_head=, max_len=)``; ``example_inputs(batch=, num_nodes=, seq_len=)``
    (seq_len <= max_len).

Export notes
    Captures with ``torch.export(strict=False)`` in train and eval mode. Under ``Dim.AUTO`` on every
    dim of every input: B, N, E and T stay dynamic; F (8) and edge_index's leading 2 are specialised
    and T is bounded by ``max_len`` (position-embedding slice).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(gnn_hidden=32, d_model=32, n_head=4, dropout=0.1, max_len=128, n_features=8, n_classes=2)
INPUT_DEFAULTS = dict(batch=4, num_nodes=16, seq_len=32)


class TemporalAttention(nn.Module):
    """Multi-head self-attention over time, independently for every (subject, region)."""

    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, h):  # h: (S, T, d) with S = B * N
        S, T, d = h.shape
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        q = q.reshape(S, T, self.n_head, d // self.n_head).transpose(1, 2)
        k = k.reshape(S, T, self.n_head, d // self.n_head).transpose(1, 2)
        v = v.reshape(S, T, self.n_head, d // self.n_head).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        att = self.attn_drop(torch.softmax(scores, dim=-1))
        out = torch.matmul(att, v).transpose(1, 2).reshape(S, T, d)
        return self.proj(out)


class SpatialAttention(nn.Module):
    """Single-head self-attention across regions of one subject."""

    def __init__(self, d_model, dropout):
        super().__init__()
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.scale = d_model ** -0.5
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, h):  # h: (B, N, d)
        scores = torch.bmm(self.q(h), self.k(h).transpose(1, 2)) * self.scale
        att = self.attn_drop(F.softmax(scores, dim=-1))
        return torch.bmm(att, self.v(h))


class GNNSTAN(nn.Module):
    def __init__(self, n_features=8, gnn_hidden=32, d_model=32, n_head=4, dropout=0.1, max_len=128, n_classes=2):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.gcn1 = GCNConv(n_features, gnn_hidden)
        self.gcn2 = GCNConv(gnn_hidden, gnn_hidden)
        self.step_embed = nn.Linear(1, d_model)
        self.pos_embed = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        self.ln_t = nn.LayerNorm(d_model)
        self.temporal = TemporalAttention(d_model, n_head, dropout)
        self.ln_s = nn.LayerNorm(d_model)
        self.spatial = SpatialAttention(d_model, dropout)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Sequential(
            nn.Linear(2 * (gnn_hidden + d_model), 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, n_classes)
        )

    def forward(self, x_nodes, edge_index, series):
        B, N, T = series.shape
        # GNN branch over the disjoint union of the B subject graphs
        offsets = (torch.arange(B, device=edge_index.device) * N).view(1, B, 1)
        ei = (edge_index.unsqueeze(1) + offsets).flatten(1)  # (2, B * E)
        g = F.relu(self.gcn1(x_nodes.flatten(0, 1), ei))
        g = self.dropout(g)
        g = F.relu(self.gcn2(g, ei)).view(B, N, -1)
        # temporal attention per region
        h = self.step_embed(series.reshape(B * N, T, 1)) + self.pos_embed[:T]
        h = h + self.temporal(self.ln_t(h))
        h = h.mean(dim=1).view(B, N, -1)
        # spatial attention across regions
        h = h + self.spatial(self.ln_s(h))
        # fusion + graph-level readout
        z = torch.cat([g, h], dim=-1)
        z = torch.cat([z.mean(dim=1), z.amax(dim=1)], dim=-1)
        return self.head(z)


def build_model(**kwargs):
    cfg = {**DEFAULTS, **{k: v for k, v in kwargs.items() if k in DEFAULTS}}
    torch.manual_seed(0)
    return GNNSTAN(**cfg)


# ---------------------------------------------------------------- synthetic deterministic data

def _graph(num_nodes):
    src, dst = [], []
    for i in range(num_nodes):
        for hop in (1, 4):
            for j in ((i + hop) % num_nodes, (i - hop) % num_nodes):
                if j != i:
                    src.append(i)
                    dst.append(j)
    ei = torch.tensor([src, dst], dtype=torch.long)
    return torch.unique(ei, dim=1)  # drop duplicates for tiny N


def _features(series):
    """(B, N, T) -> (B, N, 8): mean, std, min, max, lag-1..4 autocorrelation."""
    mu = series.mean(-1, keepdim=True)
    c = series - mu
    var = (c * c).mean(-1).clamp_min(1e-6)
    ac = [(c[..., l:] * c[..., :-l]).mean(-1) / var for l in (1, 2, 3, 4)]
    return torch.stack([mu.squeeze(-1), var.sqrt(), series.amin(-1), series.amax(-1), *ac], dim=-1)


def _sample(batch, num_nodes, seq_len, seed):
    g = torch.Generator().manual_seed(seed)
    ei = _graph(num_nodes)
    adj = torch.zeros(num_nodes, num_nodes)
    adj[ei[0], ei[1]] = 1.0
    adj = adj / adj.sum(-1, keepdim=True).clamp_min(1.0)
    labels = torch.arange(batch) % 2
    coupling = torch.where(labels == 1, 1.4, 0.6).view(batch, 1)
    osc_regions = (torch.arange(num_nodes) % 2 == 0).float()
    s = torch.randn(batch, num_nodes, generator=g)
    steps = []
    for t in range(seq_len + 8):  # 8 burn-in steps
        drive = 0.3 * math.sin(2 * math.pi * t / 12.0) * osc_regions * labels.view(batch, 1)
        s = torch.tanh(coupling * (s @ adj.T)) + drive + 0.5 * torch.randn(batch, num_nodes, generator=g)
        steps.append(s)
    series = torch.stack(steps[8:], dim=-1)  # (B, N, T)
    return (_features(series), ei, series)


def example_inputs(batch=INPUT_DEFAULTS["batch"], num_nodes=INPUT_DEFAULTS["num_nodes"],
                   seq_len=INPUT_DEFAULTS["seq_len"], **_):
    return _sample(batch, num_nodes, seq_len, seed=0)


def loss_fn(output, inputs):
    """Cross-entropy against the positional labels: row b of the batch has class b % 2."""
    labels = torch.arange(output.shape[0], device=output.device) % 2
    return F.cross_entropy(output, labels)


def calibration_data(n_batches=8, batch=INPUT_DEFAULTS["batch"], num_nodes=INPUT_DEFAULTS["num_nodes"],
                     seq_len=INPUT_DEFAULTS["seq_len"]):
    return [_sample(batch, num_nodes, seq_len, seed=1 + i) for i in range(n_batches)]


@torch.no_grad()
def evaluate(module, n_batches=4):
    """Accuracy on held-out synthetic subjects (seeds 1000..)."""
    was_training = getattr(module, "training", False)
    try:
        module.eval()
    except NotImplementedError:  # bare torch.export module: evaluated in the mode it was captured in
        pass
    correct = total = 0
    try:
        for i in range(n_batches):
            inp = _sample(INPUT_DEFAULTS["batch"], INPUT_DEFAULTS["num_nodes"], INPUT_DEFAULTS["seq_len"], 1000 + i)
            logits = module(*inp)
            labels = torch.arange(logits.shape[0]) % 2
            correct += (logits.argmax(-1) == labels).sum().item()
            total += labels.numel()
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass
    return correct / total
