"""MLP classifier on sklearn's handwritten digits (for pruning / sparsity experiments).

What it is
    ``Linear(64, hidden) -> ReLU -> [Dropout] -> Linear(hidden, hidden) -> ReLU -> [Dropout] -> Linear(hidden, 10)``
    (``n_hidden_layers`` ReLU layers). ReLU on purpose: hot/cold-neuron and activation-sparsity
    methods that count exact zeros apply here (unlike the GELU models). ``forward(x) -> logits (B, 10)``.

Data
    ``sklearn.datasets.load_digits`` (1797 8x8 images, ships with scikit-learn), flattened to 64
    features scaled to [0, 1]. Images 0..1499 are the training split, 1500.. are held out.
    Labels in ``example_inputs``/``calibration_data`` batches are positional: row ``r`` is an image
    of digit ``r % 10`` (``loss_fn`` uses that, so it needs only the inputs); ``evaluate`` uses the
    real labels of the held-out split.

Default size
    hidden 256, 2 hidden layers, dropout 0.0, input (32, 64): about 85 K parameters. Untrained by
    default; ``build_model(trained=True)`` fits it (Adam lr 3e-3, 20 epochs over the 1500 training
    images, about a second on CPU, held-out accuracy ~0.92; the last sklearn digits are from other
    writers and harder), which is what pruning experiments want.

Scaling
    ``build_model(hidden=, n_hidden_layers=, dropout=)``; ``example_inputs(batch=)``.

Export notes
    Plain linear/relu graph: captures in train and eval mode; under ``Dim.AUTO`` the batch stays
    dynamic and the feature dim (64) is specialised.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(hidden=256, n_hidden_layers=2, dropout=0.0, trained=False)
INPUT_DEFAULTS = dict(batch=32)
_N_TRAIN = 1500


class MLP(nn.Module):
    def __init__(self, hidden=256, n_hidden_layers=2, dropout=0.0, in_features=64, n_classes=10):
        super().__init__()
        layers, d = [], in_features
        for _ in range(n_hidden_layers):
            layers += [nn.Linear(d, hidden), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            d = hidden
        layers.append(nn.Linear(d, n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def _load():
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target, dtype=torch.long)


def build_model(**kwargs):
    cfg = {**DEFAULTS, **{k: v for k, v in kwargs.items() if k in DEFAULTS}}
    torch.manual_seed(0)
    model = MLP(hidden=cfg["hidden"], n_hidden_layers=cfg["n_hidden_layers"], dropout=cfg["dropout"])
    if cfg["trained"]:
        _fit(model)
    return model


def _fit(model, epochs=20, batch=64, lr=3e-3):
    x, y = _load()
    x, y = x[:_N_TRAIN], y[:_N_TRAIN]
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(x.shape[0], generator=g)
        for s in range(0, x.shape[0], batch):
            idx = perm[s:s + batch]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    model.zero_grad(set_to_none=True)


def _positional_batch(x, y, batch, offset):
    """Row r is the (offset + r // 10)-th training image of digit r % 10."""
    rows = []
    for r in range(batch):
        idx = torch.nonzero(y[:_N_TRAIN] == r % 10).flatten()
        rows.append(x[idx[(offset + r // 10) % idx.numel()]])
    return torch.stack(rows)


def example_inputs(batch=INPUT_DEFAULTS["batch"], **_):
    x, y = _load()
    return (_positional_batch(x, y, batch, 0),)


def loss_fn(output, inputs):
    """Cross-entropy against the positional labels: row r is digit r % 10."""
    labels = torch.arange(output.shape[0], device=output.device) % 10
    return F.cross_entropy(output, labels)


def calibration_data(n_batches=8, batch=INPUT_DEFAULTS["batch"]):
    x, y = _load()
    per = (batch + 9) // 10
    return [(_positional_batch(x, y, batch, (1 + i) * per),) for i in range(n_batches)]


@torch.no_grad()
def evaluate(module, batch=INPUT_DEFAULTS["batch"]):
    """Classification accuracy on held-out digits (images 1500..), real labels, full batches only."""
    was_training = getattr(module, "training", False)
    try:
        module.eval()
    except NotImplementedError:  # bare torch.export module: evaluated in the mode it was captured in
        pass
    x, y = _load()
    x, y = x[_N_TRAIN:], y[_N_TRAIN:]
    n = (x.shape[0] // batch) * batch
    correct = 0
    try:
        for s in range(0, n, batch):
            correct += (module(x[s:s + batch]).argmax(-1) == y[s:s + batch]).sum().item()
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass
    return correct / n
