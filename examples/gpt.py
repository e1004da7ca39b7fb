"""nanoGPT-style byte-level decoder-only transformer, written by hand.

What it is
    Token + learned position embedding, ``n_layer`` pre-LN blocks of
    (LayerNorm -> CausalSelfAttention -> residual, LayerNorm -> MLP(GELU) -> residual),
    a final LayerNorm and an ``lm_head``. Attention is the classic manual form (no SDPA):
    ``q @ k^T * (1/sqrt(d))``, ``masked_fill`` with a sliced registered ``tril`` buffer
    ``bias`` of shape (1, 1, block_size, block_size), softmax, attention dropout, ``att @ v``.

Default size
    vocab 256 (bytes), block_size 128, n_layer 4, n_head 4, d_model 128, dropout 0.1;
    inputs ``(idx,)`` with idx int64 of shape (batch=4, seq_len=64); output logits (4, 64, 256).
    About 0.88 M parameters; a CPU train step takes a few tens of ms.

Scaling
    ``build_model(n_layer=12, n_head=12, d_model=768, block_size=1024)`` gives a GPT-2-small
    shaped model; ``example_inputs(batch=8, seq_len=512)`` (seq_len <= block_size).

Data
    ``calibration_data`` and ``evaluate`` use real text: the UTF-8 bytes of a few Python
    standard-library source files (shipped with every Python), cut into fixed windows.
    Deterministic, no download.

Export notes
    Captures with ``torch.export.export(..., strict=False)`` in train and eval mode. With
    ``Dim.AUTO`` on both dims of ``idx`` the batch and sequence dims stay dynamic
    (sequence length is bounded above by ``block_size`` through the position-embedding
    lookup and the buffer slice).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=128, dropout=0.1)
INPUT_DEFAULTS = dict(batch=4, seq_len=64)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, block_size, dropout):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.register_buffer(
            "bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        )

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d_model, dropout):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d_model, n_head, block_size, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, d_model, dropout):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(d_model, n_head, block_size, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab)


def build_model(**kwargs):
    """Build the GPT; keyword args override DEFAULTS (vocab_size, block_size, n_layer, n_head, d_model, dropout)."""
    cfg = {**DEFAULTS, **{k: v for k, v in kwargs.items() if k in DEFAULTS}}
    torch.manual_seed(0)
    return GPT(**cfg)


def example_inputs(batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"], vocab_size=256, **_):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab_size, (batch, seq_len), generator=g, dtype=torch.long)
    return (idx,)


def loss_fn(output, inputs):
    """Next-token cross-entropy: logits at position t predict idx[:, t+1]."""
    idx = inputs[0]
    logits = output[:, :-1, :]
    targets = idx[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# ---------------------------------------------------------------- real text data (stdlib sources)

_CALIB_MODULES = ("json", "textwrap", "string", "functools", "collections")
_HELDOUT_MODULES = ("argparse",)


def _text_bytes(module_names):
    import importlib
    import inspect

    chunks = []
    for name in module_names:
        mod = importlib.import_module(name)
        path = inspect.getsourcefile(mod)
        with open(path, "rb") as f:
            chunks.append(f.read())
    return torch.tensor(list(b"\n".join(chunks)), dtype=torch.long)


def _windows(data, n_batches, batch, seq_len):
    """Deterministic, non-overlapping (batch, seq_len) windows from a 1-D byte tensor."""
    n = n_batches * batch
    stride = max(seq_len, (data.numel() - seq_len) // max(n, 1))
    out = []
    for b in range(n_batches):
        rows = []
        for r in range(batch):
            start = ((b * batch + r) * stride) % (data.numel() - seq_len)
            rows.append(data[start:start + seq_len])
        out.append((torch.stack(rows),))
    return out


def calibration_data(n_batches=8, batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"]):
    """Byte windows of Python stdlib source text (json, textwrap, string, functools, collections)."""
    return _windows(_text_bytes(_CALIB_MODULES), n_batches, batch, seq_len)


evaluate_mode = "min"  # evaluate() is a loss: lower is better (fxmem's guard reads this, not the docstring)


@torch.no_grad()
def evaluate(module, n_batches=4, batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"]):
    """Mean next-token cross-entropy (nats/byte) on held-out stdlib text (argparse.py). Lower is better."""
    was_training = getattr(module, "training", None)
    try:
        if was_training is not None:
            try:
                module.eval()
            except NotImplementedError:  # bare torch.export module
                pass
        losses = [loss_fn(module(*inp), inp).item()
                  for inp in _windows(_text_bytes(_HELDOUT_MODULES), n_batches, batch, seq_len)]
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass
    return sum(losses) / len(losses)
