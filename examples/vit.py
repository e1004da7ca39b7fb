"""Tiny Vision Transformer, hand written, classifying sklearn's handwritten digits.

What it is
    Patch embedding (Conv2d, kernel = stride = patch), a learned [CLS] token, learned position
    embeddings, ``n_layer`` pre-LN encoder blocks (multi-head self-attention + GELU MLP, dropout),
    final LayerNorm and a linear head on the [CLS] token. ``forward(x) -> logits (B, 10)``.
    The attention is written differently from ``gpt.py`` on purpose: scores with ``torch.einsum``
    and scaling by *division* (``/ math.sqrt(head_dim)``), no mask::

        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(dh)
        att = dropout(scores.softmax(dim=-1))
        out = torch.einsum("bhqk,bhkd->bhqd", att, v)

Data
    ``sklearn.datasets.load_digits`` (ships with scikit-learn, no download): 8x8 images scaled to
    [0, 1] and bilinearly up-sampled to ``img_size`` (16). Labels are positional: row ``r`` of every
    batch produced here is an image of digit ``r % 10`` (``loss_fn`` uses that, so it needs only the
    inputs). Images 0..1499 feed ``example_inputs`` / ``calibration_data``; 1500.. are held out for
    ``evaluate`` (accuracy, real labels).

Default size
    img 16, patch 4 (16 patches + CLS = 17 tokens), d_model 64, 4 layers, 4 heads, MLP 4x, dropout 0.1;
    input (10, 1, 16, 16); about 0.2 M parameters.

Scaling
    ``build_model(d_model=, n_layer=, n_head=, img_size=, patch=)``; ``example_inputs(batch=, img_size=)``
    (img_size must equal the model's).

Export notes
    Captures with ``torch.export(strict=False)`` in train and eval mode; ``einsum`` shows up as
    ``aten.einsum.default`` in the exported graph. Under ``Dim.AUTO`` the channel dim (1) is
    specialised; batch, H and W stay symbolic, with the guard ``(H // patch) * (W // patch) == n_patches``
    (the position embedding fixes the number of patches: 17x19 and 32x8 inputs run, 20x20 fails the guard).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(img_size=16, patch=4, in_channels=1, d_model=64, n_layer=4, n_head=4, mlp_ratio=4,
                dropout=0.1, n_classes=10)
INPUT_DEFAULTS = dict(batch=10, img_size=16)
_N_TRAIN = 1500


class Attention(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, h, N, dh)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.head_dim)
        att = self.attn_drop(scores.softmax(dim=-1))
        out = torch.einsum("bhqk,bhkd->bhqd", att, v)
        out = out.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(out))


class Block(nn.Module):
    def __init__(self, d_model, n_head, mlp_ratio, dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(mlp_ratio * d_model, d_model), nn.Dropout(dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, img_size=16, patch=4, in_channels=1, d_model=64, n_layer=4, n_head=4, mlp_ratio=4,
                 dropout=0.1, n_classes=10):
        super().__init__()
        n_patches = (img_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, d_model, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, d_model) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d_model, n_head, mlp_ratio, dropout) for _ in range(n_layer)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, n_patches, d)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = self.drop(torch.cat([cls, x], dim=1) + self.pos_embed)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


def build_model(**kwargs):
    cfg = {**DEFAULTS, **{k: v for k, v in kwargs.items() if k in DEFAULTS}}
    torch.manual_seed(0)
    return ViT(**cfg)


# ---------------------------------------------------------------- sklearn digits (ships with sklearn)

def _load(img_size):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    return x, torch.tensor(d.target, dtype=torch.long)


def _positional_batch(x, y, batch, offset):
    """Row r is the (offset + r // 10)-th training image of digit r % 10."""
    rows = []
    for r in range(batch):
        idx = torch.nonzero(y[:_N_TRAIN] == r % 10).flatten()
        rows.append(x[idx[(offset + r // 10) % idx.numel()]])
    return torch.stack(rows).contiguous()


def example_inputs(batch=INPUT_DEFAULTS["batch"], img_size=INPUT_DEFAULTS["img_size"], **_):
    x, y = _load(img_size)
    return (_positional_batch(x, y, batch, 0),)


def loss_fn(output, inputs):
    """Cross-entropy against the positional labels: row r is digit r % 10."""
    labels = torch.arange(output.shape[0], device=output.device) % 10
    return F.cross_entropy(output, labels)


def calibration_data(n_batches=8, batch=INPUT_DEFAULTS["batch"], img_size=INPUT_DEFAULTS["img_size"]):
    x, y = _load(img_size)
    per = (batch + 9) // 10
    return [(_positional_batch(x, y, batch, (1 + i) * per),) for i in range(n_batches)]


@torch.no_grad()
def evaluate(module, img_size=INPUT_DEFAULTS["img_size"], batch=INPUT_DEFAULTS["batch"]):
    """Classification accuracy on the 297 held-out digits (images 1500..), real labels."""
    was_training = getattr(module, "training", False)
    try:
        module.eval()
    except NotImplementedError:  # bare torch.export module: evaluated in the mode it was captured in
        pass
    x, y = _load(img_size)
    x, y = x[_N_TRAIN:], y[_N_TRAIN:]
    correct = 0
    try:
        for s in range(0, x.shape[0] - batch + 1, batch):  # full batches only (static-batch graphs work too)
            correct += (module(x[s:s + batch]).argmax(-1) == y[s:s + batch]).sum().item()
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass
    return correct / ((x.shape[0] // batch) * batch)
