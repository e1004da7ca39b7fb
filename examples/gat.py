"""Knowledge distillation between two GATs (torch_geometric ``GATConv``) on Zachary's karate club.

What it is
    ``Distill`` holds a larger *teacher* GAT (2 ``GATConv`` layers, 4 heads x 32 hidden, ELU) whose
    parameters are frozen (``requires_grad_(False)``) and a smaller *student* GAT (2 layers,
    2 heads x 8 hidden). ``forward(x, edge_index)`` returns ``(student_logits, teacher_logits)``,
    both (num_nodes, 4); the teacher runs under ``torch.no_grad()``, so only the student saves
    activations for backward. ``loss_fn`` = cross-entropy of the student on the training labels
    + ``alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))`` over all nodes.

Data
    ``torch_geometric.datasets.KarateClub()`` (ships inside torch_geometric's source; no download,
    no files written): 34 nodes, 156 directed edges, one-hot features (34 dims), 4 classes.
    Labels are recovered from the inputs (features are one-hot node ids: ``x.argmax(-1)``), so
    subgraphs, permutations and unions of copies work. Split: nodes with id % 3 == 2 are held out
    (``evaluate``: student accuracy), the rest are training nodes.
    ``build_model(teacher_trained=True)`` first fits the teacher on the training nodes (200 Adam
    steps, under a second), which makes the distillation signal meaningful; default is random.

Default size
    Teacher 2 x GATConv(heads=4, hidden=32) ~ 6.8 K params (frozen); student 2 x GATConv(heads=2,
    hidden=8) ~ 0.7 K params (trainable). Inputs ``(x, edge_index)`` = (float32 (34, 34), int64 (2, 156)).

Scaling
    ``build_model(teacher_hidden=, teacher_heads=, student_hidden=, student_heads=, n_layers=)``;
    ``example_inputs(copies=k)`` (disjoint union of k copies: 34k nodes) or ``example_inputs(num_nodes=n)``
    (induced subgraph on nodes 0..n-1).

Export notes
    Captures with ``torch.export(strict=False)`` in train and eval mode. The ``torch.no_grad()`` teacher
    becomes a ``torch.ops.higher_order.wrap_with_set_grad_enabled(False, submod, ...)`` node whose body is
    a nested GraphModule. GATConv's self-loop handling (remove_self_loops / add_self_loops) gives
    data-dependent (unbacked) edge counts. With ``Dim.AUTO`` on both dims of both inputs, the node and
    edge counts stay dynamic; the feature dim (34) and edge_index's leading 2 are specialised.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(teacher_hidden=32, teacher_heads=4, student_hidden=8, student_heads=2, n_layers=2,
                dropout=0.2, teacher_trained=False)
NUM_FEATURES = 34
NUM_CLASSES = 4
TEMPERATURE = 2.0
ALPHA = 0.5


class GAT(nn.Module):
    """GATConv stack: hidden layers concat heads + ELU; the last layer averages its heads."""

    def __init__(self, in_channels, hidden, heads, out_channels, n_layers=2, dropout=0.2):
        super().__init__()
        from torch_geometric.nn import GATConv

        self.convs = nn.ModuleList()
        d = in_channels
        for _ in range(n_layers - 1):
            self.convs.append(GATConv(d, hidden, heads=heads, dropout=dropout))
            d = hidden * heads
        self.convs.append(GATConv(d, out_channels, heads=heads, concat=False, dropout=dropout))
        self.dropout = nn.Dropout(dropout)
        self.act = nn.ELU()

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(self.dropout(x), edge_index)
            if i < len(self.convs) - 1:
                x = self.act(x)
        return x


class Distill(nn.Module):
    def __init__(self, teacher, student):
        super().__init__()
        self.teacher = teacher.requires_grad_(False)
        self.student = student

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()  # the frozen teacher never uses dropout
        return self

    def forward(self, x, edge_index):
        with torch.no_grad():
            teacher_logits = self.teacher(x, edge_index)
        student_logits = self.student(x, edge_index)
        return student_logits, teacher_logits


def build_model(**kwargs):
    cfg = {**DEFAULTS, **{k: v for k, v in kwargs.items() if k in DEFAULTS}}
    torch.manual_seed(0)
    teacher = GAT(NUM_FEATURES, cfg["teacher_hidden"], cfg["teacher_heads"], NUM_CLASSES, cfg["n_layers"], cfg["dropout"])
    student = GAT(NUM_FEATURES, cfg["student_hidden"], cfg["student_heads"], NUM_CLASSES, cfg["n_layers"], cfg["dropout"])
    if cfg["teacher_trained"]:
        _fit(teacher)
    model = Distill(teacher, student)
    model.train()
    return model


def _fit(gat, steps=200):
    inputs = example_inputs()
    y, train, _ = _labels_and_masks(inputs[0])
    opt = torch.optim.Adam(gat.parameters(), lr=0.01, weight_decay=5e-4)
    gat.train()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(gat(*inputs)[train], y[train]).backward()
        opt.step()
    gat.zero_grad(set_to_none=True)
    gat.eval()


# ---------------------------------------------------------------- karate club data (ships with PyG)

def _karate():
    from torch_geometric.datasets import KarateClub

    return KarateClub()[0]


def example_inputs(copies=1, num_nodes=None, **_):
    """``(x, edge_index)`` of the karate club graph (or the induced subgraph on nodes 0..num_nodes-1,
    or a disjoint union of ``copies`` copies)."""
    data = _karate()
    x, ei = data.x.clone(), data.edge_index.clone()
    if num_nodes is not None:
        from torch_geometric.utils import subgraph

        subset = torch.arange(num_nodes)
        ei, _ = subgraph(subset, data.edge_index, relabel_nodes=True, num_nodes=data.num_nodes)
        x = data.x[subset].clone()
    if copies > 1:
        n = x.size(0)
        ei = torch.cat([ei + i * n for i in range(copies)], dim=1)
        x = torch.cat([x] * copies, dim=0)
    return (x, ei)


# KarateClub().y (4 communities), stored as a constant so loss_fn also runs on fake tensors
# (fxmem's traced estimate calls loss_fn under FakeTensorMode, where building the dataset cannot run).
# tests/test_examples_files.py checks it still equals the dataset's labels.
KARATE_LABELS = [1, 1, 1, 1, 3, 3, 3, 1, 0, 1, 3, 1, 1, 1, 0, 0, 3, 1, 0, 1, 0, 1, 0, 0, 2, 2, 0, 0, 2, 0, 0, 2, 0, 0]


def _labels_and_masks(x):
    ids = x.argmax(dim=-1)  # features are one-hot node ids
    y = torch.tensor(KARATE_LABELS, device=x.device)[ids]
    heldout = (ids % 3) == 2
    return y, ~heldout, heldout


def loss_fn(output, inputs, temperature=TEMPERATURE, alpha=ALPHA):
    """CE(student, labels) on training nodes + alpha * T^2 * KL(teacher || student) on all nodes."""
    student, teacher = output
    y, train, _ = _labels_and_masks(inputs[0])
    w = train.to(student.dtype)
    ce = (F.cross_entropy(student, y, reduction="none") * w).sum() / w.sum().clamp_min(1.0)
    kl = F.kl_div(F.log_softmax(student / temperature, dim=-1), F.log_softmax(teacher / temperature, dim=-1),
                  reduction="batchmean", log_target=True)
    return ce + alpha * temperature ** 2 * kl


def calibration_data(n_batches=8):
    """The real karate graph ``n_batches`` times, each with a different deterministic node order
    (same shapes: 34 nodes, 156 edges)."""
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
    """Student accuracy on the 11 held-out nodes (id % 3 == 2)."""
    was_training = getattr(module, "training", False)
    try:
        module.eval()
    except NotImplementedError:  # bare torch.export module: evaluated in the mode it was captured in
        pass
    try:
        inputs = example_inputs()
        student, _ = module(*inputs)
        y, _, held = _labels_and_masks(inputs[0])
        return (student.argmax(-1)[held] == y[held]).float().mean().item()
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass
