"""Seeded random models for the fuzz harness (`tests/test_fuzz.py`, `benchmarks/fuzz_budget.py`).

`fuzz_case(seed)` builds a stack of layers drawn from linear, convolution, normalization, dropout, pooling,
concatenation, reshape/permute, in-place ops and hand-written attention, with shapes small enough for a CPU, and
its example input. The model, its weights and its input are a deterministic function of the seed. Every model is
valid for autograd: an in-place op only writes a tensor no earlier op saved.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("relu", "gelu", "tanh", "silu", "none")


def activate(h: torch.Tensor, name: str) -> torch.Tensor:
    """The activation `name` (one of ACTIVATIONS) applied out of place."""
    if name == "relu":
        return torch.relu(h)
    if name == "gelu":
        return F.gelu(h)
    if name == "tanh":
        return torch.tanh(h)
    if name == "silu":
        return F.silu(h)
    return h


def write_in_place(h: torch.Tensor, how: str) -> torch.Tensor:
    """An in-place op on `h` (a fresh output no op saved) or on a slice of it: relu_, mul_, add_, clamp_ or a slice
    scaled in place (autograd's CopySlices)."""
    if how == "relu_":
        return h.relu_()
    if how == "mul_":
        return h.mul_(0.5)
    if how == "add_":
        return h.add_(1.0)
    if how == "clamp_":
        return h.clamp_(-1.0, 1.0)
    h[..., : max(1, h.shape[-1] // 2)].mul_(2.0)
    return h


IN_PLACE = ("relu_", "mul_", "add_", "clamp_", "slice_mul_")


# ============================================================================================ sequence layers
# every sequence layer maps (B, T, C) -> (B, T', C'), and says its output width and length

class SeqLinear(nn.Module):
    def __init__(self, rng: random.Random, length: int, width: int):
        super().__init__()
        self.out_width = rng.choice((8, 16, 24, 32, 48))
        self.out_length = length
        self.fc = nn.Linear(width, self.out_width, bias=rng.random() < 0.8)
        self.act = rng.choice(ACTIVATIONS)
        self.in_place = rng.choice(IN_PLACE) if rng.random() < 0.4 else None

    def forward(self, h):
        h = self.fc(h)
        if self.in_place is not None:
            h = write_in_place(h, self.in_place)
        return activate(h, self.act)


class SeqMLPBlock(nn.Module):
    """Pre-norm residual MLP: h + fc2(act(fc1(norm(h))))."""

    def __init__(self, rng: random.Random, length: int, width: int):
        super().__init__()
        self.out_width, self.out_length = width, length
        hidden = width * rng.choice((1, 2, 4))
        self.norm = nn.LayerNorm(width) if rng.random() < 0.7 else nn.Identity()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.act = rng.choice(ACTIVATIONS[:-1])
        self.drop = nn.Dropout(rng.choice((0.0, 0.1, 0.3))) if rng.random() < 0.5 else nn.Identity()

    def forward(self, h):
        return h + self.drop(self.fc2(activate(self.fc1(self.norm(h)), self.act)))


class SeqNorm(nn.Module):
    def __init__(self, rng: random.Random, length: int, width: int):
        super().__init__()
        self.out_width, self.out_length = width, length
        self.kind = rng.choice(("layer", "batch", "rms"))
        if self.kind == "layer":
            self.norm = nn.LayerNorm(width, elementwise_affine=rng.random() < 0.8)
        elif self.kind == "batch":
            self.norm = nn.BatchNorm1d(width)
        else:
            self.norm = nn.RMSNorm(width)

    def forward(self, h):
        if self.kind == "batch":
            return self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.norm(h)


class SeqDropout(nn.Module):
    def __init__(self, rng: random.Random, length: int, width: int):
        super().__init__()
        self.out_width, self.out_length = width, length
        self.drop = nn.Dropout(rng.choice((0.0, 0.1, 0.5)))

    def forward(self, h):
        return self.drop(h)


class SeqPool(nn.Module):
    """Pooling over the sequence: (B, T, C) -> (B, T // 2, C) through a transpose."""

    def __init__(self, rng: random.Random, length: int, width: int):
        super().__init__()
        self.out_width, self.out_length = width, length // 2
        self.kind = rng.choice(("max", "avg"))

    def forward(self, h):
        h = h.transpose(1, 2)
        h = F.max_pool1d(h, 2) if self.kind == "max" else F.avg_pool1d(h, 2)
        return h.transpose(1, 2)


class SeqConcat(nn.Module):
    """cat([branch(h), h], -1) or cat([h, branch(h)], -1); the branch is a linear (optionally activated)."""

    def __init__(self, rng: random.Random, length: int, width: int):
        super().__init__()
        extra = rng.choice((8, 16, 32))
        self.out_width, self.out_length = width + extra, length
        self.branch = nn.Linear(width, extra)
        self.act = rng.choice(ACTIVATIONS)
        self.first = rng.random() < 0.5

    def forward(self, h):
        b = activate(self.branch(h), self.act)
        return torch.cat([b, h] if self.first else [h, b], -1)


class SeqPermute(nn.Module):
    """Token mixing over the sequence (transpose, linear over T, transpose back), or a channel shuffle
    (reshape to groups, swap, reshape back), or a round trip through a flat (B, T * C) view."""

    def __init__(self, rng: random.Random, length: int, width: int):
        super().__init__()
        self.out_width, self.out_length = width, length
        self.kind = rng.choice(("mix", "shuffle", "flat"))
        self.groups = next(g for g in (4, 2, 1) if width % g == 0)
        self.mix = nn.Linear(length, length) if self.kind == "mix" else None

    def forward(self, h):
        b, t, c = h.shape
        if self.kind == "mix":
            return self.mix(h.transpose(1, 2)).transpose(1, 2)
        if self.kind == "shuffle":
            return h.reshape(b, t, self.groups, c // self.groups).transpose(2, 3).reshape(b, t, c)
        return (h.reshape(b, t * c) * 2.0).view(b, t, c)


class SeqAttention(nn.Module):
    """Hand-written multi-head self-attention with a residual: matmul, scale (mul or div), optional causal mask
    (masked_fill from a buffer, or an additive mask), softmax, dropout, matmul, output projection."""

    def __init__(self, rng: random.Random, length: int, width: int):
        super().__init__()
        self.out_width, self.out_length = width, length
        self.heads = next(n for n in (rng.choice((1, 2, 4)), 2, 1) if width % n == 0)
        self.qkv = nn.Linear(width, 3 * width, bias=rng.random() < 0.7)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(rng.choice((0.0, 0.1))) if rng.random() < 0.5 else nn.Identity()
        self.mask = rng.choice(("none", "fill", "additive"))
        self.divide = rng.random() < 0.5
        self.register_buffer("causal", torch.tril(torch.ones(length, length, dtype=torch.bool)), persistent=False)

    def forward(self, h):
        b, t, c = h.shape
        q, k, v = self.qkv(h).split(c, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scale = math.sqrt(c // self.heads)
        scores = q @ k.transpose(-2, -1)
        scores = scores / scale if self.divide else scores * (1.0 / scale)
        if self.mask == "fill":
            scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        elif self.mask == "additive":
            scores = scores + (~self.causal[:t, :t]).float() * -1e9
        att = self.drop(torch.softmax(scores, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return h + self.proj(y)


SEQ_LAYERS = (SeqLinear, SeqMLPBlock, SeqNorm, SeqDropout, SeqPool, SeqConcat, SeqPermute, SeqAttention)


# ============================================================================================ image layers
# every image layer maps (B, C, H, W) -> (B, C', H', W'), and says its output channels and side

class ImgConv(nn.Module):
    def __init__(self, rng: random.Random, side: int, channels: int):
        super().__init__()
        self.out_channels = rng.choice((4, 8, 12, 16))
        stride = 2 if side >= 8 and rng.random() < 0.25 else 1
        kernel = rng.choice((1, 3))
        self.out_side = (side + 2 * (kernel // 2) - kernel) // stride + 1
        self.conv = nn.Conv2d(channels, self.out_channels, kernel, stride=stride, padding=kernel // 2,
                              bias=rng.random() < 0.7)
        self.act = rng.choice(ACTIVATIONS)
        self.in_place = rng.choice(IN_PLACE) if rng.random() < 0.4 else None

    def forward(self, h):
        h = self.conv(h)
        if self.in_place is not None:
            h = write_in_place(h, self.in_place)
        return activate(h, self.act)


class ImgResBlock(nn.Module):
    """h + conv2(act(norm(conv1(h))))."""

    def __init__(self, rng: random.Random, side: int, channels: int):
        super().__init__()
        self.out_channels, self.out_side = channels, side
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels) if rng.random() < 0.6 else nn.Identity()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = rng.choice(ACTIVATIONS[:-1])

    def forward(self, h):
        return h + self.conv2(activate(self.norm(self.conv1(h)), self.act))


class ImgNorm(nn.Module):
    def __init__(self, rng: random.Random, side: int, channels: int):
        super().__init__()
        self.out_channels, self.out_side = channels, side
        groups = next(g for g in (4, 2, 1) if channels % g == 0)
        self.norm = nn.BatchNorm2d(channels) if rng.random() < 0.6 else nn.GroupNorm(groups, channels)

    def forward(self, h):
        return self.norm(h)


class ImgDropout(nn.Module):
    def __init__(self, rng: random.Random, side: int, channels: int):
        super().__init__()
        self.out_channels, self.out_side = channels, side
        p = rng.choice((0.0, 0.1, 0.5))
        self.drop = nn.Dropout2d(p) if rng.random() < 0.4 else nn.Dropout(p)

    def forward(self, h):
        return self.drop(h)


class ImgPool(nn.Module):
    def __init__(self, rng: random.Random, side: int, channels: int):
        super().__init__()
        self.out_channels, self.out_side = channels, side // 2
        self.pool = nn.MaxPool2d(2) if rng.random() < 0.5 else nn.AvgPool2d(2)

    def forward(self, h):
        return self.pool(h)


class ImgConcat(nn.Module):
    """cat([branch(h), h], 1): a convolution branch beside the skip."""

    def __init__(self, rng: random.Random, side: int, channels: int):
        super().__init__()
        extra = rng.choice((4, 8))
        self.out_channels, self.out_side = channels + extra, side
        self.branch = nn.Conv2d(channels, extra, 3, padding=1)
        self.act = rng.choice(ACTIVATIONS)
        self.first = rng.random() < 0.5

    def forward(self, h):
        b = activate(self.branch(h), self.act)
        return torch.cat([b, h] if self.first else [h, b], 1)


class ImgPermute(nn.Module):
    """Channel shuffle (reshape, transpose, reshape), or channels-last and back with a pointwise op between."""

    def __init__(self, rng: random.Random, side: int, channels: int):
        super().__init__()
        self.out_channels, self.out_side = channels, side
        self.groups = next(g for g in (4, 2, 1) if channels % g == 0)
        self.shuffle = rng.random() < 0.5

    def forward(self, h):
        b, c, hh, ww = h.shape
        if self.shuffle:
            return h.reshape(b, self.groups, c // self.groups, hh, ww).transpose(1, 2).reshape(b, c, hh, ww)
        return (h.permute(0, 2, 3, 1) * 0.5).permute(0, 3, 1, 2).contiguous()


class ImgAttention(nn.Module):
    """Self-attention over the pixels: flatten to (B, H*W, C), SeqAttention, back to (B, C, H, W)."""

    def __init__(self, rng: random.Random, side: int, channels: int):
        super().__init__()
        self.out_channels, self.out_side = channels, side
        self.attn = SeqAttention(rng, side * side, channels)

    def forward(self, h):
        b, c, hh, ww = h.shape
        y = self.attn(h.flatten(2).transpose(1, 2))
        return y.transpose(1, 2).reshape(b, c, hh, ww)


IMG_LAYERS = (ImgConv, ImgResBlock, ImgNorm, ImgDropout, ImgPool, ImgConcat, ImgPermute, ImgAttention)


# ============================================================================================ models

class FuzzModel(nn.Module):
    """A stem, the drawn layers in order, and a head (a linear on the flattened or mean-pooled features)."""

    def __init__(self, stem: nn.Module, layers: list[nn.Module], head: nn.Module, image: bool, pool_head: bool):
        super().__init__()
        self.stem, self.layers, self.head = stem, nn.ModuleList(layers), head
        self.image, self.pool_head = image, pool_head

    def forward(self, x):
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        h = h.mean(dim=(2, 3) if self.image else 1) if self.pool_head else h.flatten(1)
        return self.head(h)


@dataclass
class FuzzCase:
    """One random model: `model(*args)` gives its output; `layers` names the drawn layers in order."""
    seed: int
    model: nn.Module
    args: tuple
    layers: list[str]

    def describe(self) -> str:
        return f"seed {self.seed}: " + " -> ".join(self.layers)


def _draw_layers(rng: random.Random, kinds: tuple, size: int, width: int, depth: int, min_size: int):
    """`depth` layers drawn from `kinds`, each built on the previous one's output; pooling only while the size
    stays at least `min_size`, attention only on short sequences."""
    layers = []
    for _ in range(depth):
        options = [k for k in kinds if (k not in (SeqPool, ImgPool) or size // 2 >= min_size)
                   and (k is not ImgAttention or size * size <= 64)]
        layer = rng.choice(options)(rng, size, width)
        layers.append(layer)
        size = getattr(layer, "out_length", getattr(layer, "out_side", size))
        width = getattr(layer, "out_width", getattr(layer, "out_channels", width))
    return layers, size, width


def fuzz_case(seed: int) -> FuzzCase:
    """The random model of `seed`, with its weights and example input (deterministic in `seed`)."""
    with torch.random.fork_rng():  # (the caller's RNG state is left as it was)
        torch.manual_seed(seed)
        return _build(seed, random.Random(seed))


def _build(seed: int, rng: random.Random) -> FuzzCase:
    image = rng.random() < 0.4
    if image:
        batch, side, in_ch, width = rng.choice((2, 4)), rng.choice((8, 16)), 3, rng.choice((4, 8))
        stem = nn.Conv2d(in_ch, width, 3, padding=1)
        kinds = IMG_LAYERS
    else:
        batch, side, in_ch, width = rng.choice((2, 4, 8)), rng.choice((8, 16, 24)), rng.choice((6, 12)), \
            rng.choice((16, 32))
        stem = nn.Linear(in_ch, width)
        kinds = SEQ_LAYERS
    layers, size, out_width = _draw_layers(rng, kinds, side, width, rng.randint(2, 6), 2)
    pool_head = rng.random() < 0.5
    features = out_width if pool_head else out_width * (size * size if image else size)
    head = nn.Linear(features, rng.choice((1, 4, 10)))
    model = FuzzModel(stem, layers, head, image, pool_head)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, in_ch, side, side) if image else (batch, side, in_ch)
    x = torch.randn(*shape, generator=gen)
    return FuzzCase(seed, model, (x,), [type(layer).__name__ for layer in layers])
