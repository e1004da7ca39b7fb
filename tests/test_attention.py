"""Attention pass: the matcher on each form real code produces, the exact SDPA rewrite (outputs and gradients equal),
what is left alone (existing SDPA, non-attention softmax) and why sites are not rewritten, the cost model, the
pipeline. Approximations (HybridAttention, SemiseparableAttention) are in tests/test_attention_approx.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxmem
from fxmem.attention_match import find_attention
from fxmem.nn.attention import sdpa_dropout
from fxmem.pipeline import pass_module


_ap = pass_module("attention")
AttentionOptions, rewrite_attention = _ap.AttentionOptions, _ap.rewrite_attention

aten = torch.ops.aten
SDPA_TARGETS = (aten.scaled_dot_product_attention.default, sdpa_dropout)


# ============================================================================================ helpers

def sdpa_nodes(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def run_with_grads(gm, args, kwargs=None, seed=0):
    """Eval-mode outputs and gradients (params by identity, float inputs) of sum(out * fixed weights)."""
    kwargs = kwargs or {}
    args = tuple(a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for a in args)
    gm.eval()
    for p in gm.parameters():
        p.grad = None
    out = gm(*args, **kwargs)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    g = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=g)).sum() for t in leaves)
    loss.backward()
    grads = {id(p): p.grad.clone() for p in gm.parameters() if p.grad is not None}
    in_grads = [a.grad.clone() for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
    for p in gm.parameters():
        p.grad = None
    return [t.detach() for t in leaves], grads, in_grads


def close(a, b, tol=5e-5, floor=1e-7):
    """fp32-tight: max |a - b| <= tol * max(|a|) + floor (SDPA kernels sum in another order than
    matmul/softmax/matmul; `floor` for gradients that are mathematically zero, like the key bias's)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    err = (a.double() - b.double()).abs().max().item()
    scale = a.double().abs().max().item()
    assert err <= tol * scale + floor, f"max abs diff {err:.3g} vs max |ref| {scale:.3g} (rel {err / scale:.3g})"


def assert_same(ref, got, tol=5e-5, floor=1e-7):
    (o1, g1, i1), (o2, g2, i2) = ref, got
    assert len(o1) == len(o2)
    for a, b in zip(o1, o2):
        close(a, b, tol, floor)
    assert g1.keys() == g2.keys() and len(g1) > 0
    for k in g1:
        close(g1[k], g2[k], tol, floor)
    assert len(i1) == len(i2)
    for a, b in zip(i1, i2):
        close(a, b, tol, floor)


def rewrite(model, args, kwargs=None, opts=None, mode="train", dynamic=False):
    """Capture, rewrite (on a snapshot), and return (original program, rewritten program, PassResult).
    Static shapes unless asked (capture with dynamic dims is ~4x slower; one test covers it)."""
    p = fxmem.capture(model, args, kwargs, mode=mode, dynamic=dynamic, check=False)
    p.refresh()
    q = p.snapshot()
    # per-site byte estimates cost two static traces: checked in test_attention_examples.py only
    res = rewrite_attention(q, opts or AttentionOptions(site_bytes=False))
    q.refresh()
    return p, q, res


def check_exact(model, args, kwargs=None, *, sites, opts=None, floor=1e-7):
    p, q, res = rewrite(model, args, kwargs, opts)
    assert len(sdpa_nodes(q)) == sites, (res.notes, [c.reason for c in res.changes])
    assert len(res.changes) == sites
    assert_same(run_with_grads(p.module, args, kwargs), run_with_grads(q.module, args, kwargs), floor=floor)
    # the score matrix is gone: no softmax left in the rewritten graph
    assert not any(n.target in (aten.softmax.int, aten._softmax.default) for n in q.graph.nodes
                   if n.op == "call_function")
    return p, q, res


def sdpa_kwargs(q):
    (n,) = [n for n in sdpa_nodes(q)]
    if n.target is sdpa_dropout:
        a = n.args
        return {"attn_mask": a[3], "dropout_p": a[4], "is_causal": a[6], "scale": a[7], "enable_gqa": a[8],
                "q": a[0], "k": a[1], "v": a[2]}
    return {**n.kwargs, "q": n.args[0], "k": n.args[1], "v": n.args[2]}


# ============================================================================================ variants

class Attn(nn.Module):
    """Configurable manual multi-head attention: each knob is one form the matcher must recognise."""

    def __init__(self, d=32, h=4, *, scores="matmul", kt="transpose", scale="mul_scores", mask=None,
                 softmax_cast=False, dropout=0.0, n_ctx=64, fill=float("-inf")):
        super().__init__()
        self.h, self.dh = h, d // h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)
        self.scores, self.kt, self.scale, self.mask, self.cast, self.fill = scores, kt, scale, mask, softmax_cast, fill
        self.register_buffer("tril", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        self.register_buffer("tril_bool", torch.tril(torch.ones(n_ctx, n_ctx, dtype=torch.bool)))
        self.register_buffer("triu", torch.triu(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))

    def forward(self, x, pad=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, self.dh).transpose(1, 2) for t in (q, k, v))
        s = 1.0 / math.sqrt(self.dh)
        if self.scale == "mul_q":
            q = q * s
        if self.scale == "div_k":
            k = k / math.sqrt(self.dh)
        kt = {"transpose": lambda: k.transpose(-2, -1), "permute": lambda: k.permute(0, 1, 3, 2),
              "mT": lambda: k.mT}[self.kt]()
        if self.scores == "matmul":
            att = q @ kt
        elif self.scores == "einsum":
            att = torch.einsum("bhqd,bhkd->bhqk", q, k)
        elif self.scores == "einsum_t":
            att = torch.einsum("bhqd,bhdk->bhqk", q, kt)
        elif self.scores == "bmm":  # 3-D (B*H, T, dh) like nn.MultiheadAttention
            q, v = q.reshape(B * self.h, T, self.dh), v.reshape(B * self.h, T, self.dh)
            att = torch.bmm(q, k.reshape(B * self.h, T, self.dh).transpose(1, 2))
        if self.scale == "mul_scores":
            att = att * s
        elif self.scale == "div_scores":
            att = att / math.sqrt(q.size(-1))
        elif self.scale == "div_tensor":
            att = att / torch.tensor(float(self.dh)).sqrt()
        if self.mask == "causal_fill":
            att = att.masked_fill(self.tril[:, :, :T, :T] == 0, self.fill)
        elif self.mask == "causal_where":
            att = torch.where(self.tril_bool[:T, :T], att, float("-inf"))
        elif self.mask == "causal_tril":
            att = att.masked_fill(torch.tril(torch.ones(T, T, device=x.device)) == 0, float("-inf"))
        elif self.mask == "anticausal":
            att = att.masked_fill(self.triu[:, :, :T, :T] == 0, float("-inf"))
        elif self.mask == "additive":
            att = att + pad  # (B, 1, 1, T) float
        elif self.mask == "pad01":
            att = att.masked_fill(pad[:, None, None, :] == 0, float("-inf"))
        elif self.mask == "causal+pad":
            att = att.masked_fill(self.tril[:, :, :T, :T] == 0, float("-inf"))
            att = att.masked_fill(pad[:, None, None, :] == 0, float("-inf"))
        elif self.mask == "causal+additive":
            att = att.masked_fill(self.tril[:, :, :T, :T] == 0, float("-inf"))
            att = att + pad
        if self.cast:
            att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            att = F.softmax(att, dim=-1)
        att = self.drop(att)
        y = att @ v if self.scores != "bmm" else torch.bmm(att, v).view(B, self.h, T, -1)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Stack(nn.Module):
    def __init__(self, n=2, **kw):
        super().__init__()
        self.layers = nn.ModuleList(Attn(**kw) for _ in range(n))

    def forward(self, x, pad=None):
        for layer in self.layers:
            x = x + layer(x, pad)
        return x


def x_in(B=2, T=12, d=32):
    return torch.randn(B, T, d)


@pytest.mark.parametrize("kw", [
    dict(scores="matmul", kt="transpose", scale="mul_scores"),
    dict(scores="matmul", kt="permute", scale="div_scores"),
    dict(scores="matmul", kt="mT", scale="mul_q"),
    dict(scores="matmul", kt="transpose", scale="div_k"),
    dict(scores="einsum", scale="div_scores"),
    dict(scores="einsum_t", scale="mul_scores"),
    dict(scores="bmm", scale="mul_scores"),
    dict(scores="matmul", scale="div_tensor"),
    dict(scores="matmul", scale=None),
    dict(softmax_cast=True),
], ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_scores_scale_forms_rewritten_exactly(kw):
    model = Stack(1, **kw)
    _, q, res = check_exact(model, (x_in(),), sites=1)
    want = {"mul_scores": 1 / math.sqrt(8), "div_scores": 1 / math.sqrt(8), "mul_q": 1 / math.sqrt(8),
            "div_k": 1 / math.sqrt(8), "div_tensor": 1 / math.sqrt(8), None: 1.0}[kw.get("scale", "mul_scores")]
    for c in res.changes:
        # a scale computed by fp32 tensor ops (div_tensor) is that fp32 value
        assert c.details["scale"] == pytest.approx(want, rel=1e-12 if kw.get("scale") != "div_tensor" else 1e-6)
        assert c.details["is_causal"] is False and c.details["mask"] == "none"


@pytest.mark.parametrize("mask", ["causal_fill", "causal_where", "causal_tril"])
def test_causal_masks_become_is_causal(mask):
    _, q, res = check_exact(Stack(2, mask=mask), (x_in(),), sites=2)
    for n in sdpa_nodes(q):
        assert n.kwargs["is_causal"] is True and n.kwargs["attn_mask"] is None
    assert all("causal" in c.reason for c in res.changes)


def test_not_provably_causal_keeps_an_explicit_mask():
    # triu is a bool keep-mask but not the causal one: rewritten with attn_mask, never is_causal
    _, q, res = check_exact(Stack(1, mask="anticausal"), (x_in(),), sites=1)
    kw = sdpa_kwargs(q)
    assert kw["is_causal"] is False and kw["attn_mask"] is not None
    assert res.changes[0].details["mask"] == "bool keep-mask"


def test_causal_buffer_with_wrong_values_is_not_causal():
    model = Stack(1, mask="causal_fill")
    model.layers[0].tril[..., 5, 0] = 0  # no longer lower-triangular ones
    _, q, res = check_exact(model, (x_in(),), sites=1)
    assert sdpa_kwargs(q)["is_causal"] is False


def test_additive_padding_mask_broadcasts():
    pad = torch.zeros(2, 1, 1, 12)
    pad[1, ..., -3:] = float("-inf")
    _, q, res = check_exact(Stack(2, mask="additive"), (x_in(), pad), sites=2)
    assert all(c.details["mask"] == "additive" for c in res.changes)


def test_bool_01_padding_mask_and_causal_combined():
    pad = torch.ones(2, 12)
    pad[0, -4:] = 0
    _, q, res = check_exact(Stack(1, mask="pad01"), (x_in(), pad), sites=1)
    assert res.changes[0].details["mask"] == "bool keep-mask"
    _, q, res = check_exact(Stack(1, mask="causal+pad"), (x_in(), pad), sites=1)
    kw = sdpa_kwargs(q)
    assert kw["is_causal"] is False and kw["attn_mask"] is not None  # causal AND padding: explicit mask
    addpad = torch.zeros(2, 1, 1, 12)
    addpad[0, ..., -4:] = -1e4
    _, q, res = check_exact(Stack(1, mask="causal+additive"), (x_in(), addpad), sites=1)
    assert res.changes[0].details["mask"] == "additive+bool"


def test_dynamic_shapes_survive_the_rewrite():
    model = Stack(2, mask="causal_fill")
    p, q, _ = rewrite(model, (x_in(),), dynamic=True)
    x2 = torch.randn(3, 20, 32)  # another batch and sequence length
    model.eval()
    q.module.eval()
    torch.testing.assert_close(q.module(x2), model(x2), atol=1e-5, rtol=1e-4)


# ============================================================================================ dropout

def test_dropout_follows_the_training_flag():
    model = Stack(1, mask="causal_fill", dropout=0.2)
    x = x_in()
    p, q, res = check_exact(model, (x,), sites=1)  # eval mode: exact
    (n,) = sdpa_nodes(q)
    assert n.target is sdpa_dropout and n.args[4] == 0.2
    assert res.changes[0].details["dropout_p"] == 0.2
    gm = q.module
    gm.train()
    with torch.no_grad():
        a, b = gm(x), gm(x)
    gm.eval()
    with torch.no_grad():
        e1, e2 = gm(x), gm(x)
    assert not torch.allclose(a, b)  # train mode drops (two draws differ)
    torch.testing.assert_close(e1, e2)  # eval mode does not
    # statistically: dropout on the probabilities keeps the expectation (inverted dropout)
    with torch.no_grad():
        gm.train()
        torch.manual_seed(0)
        mean = torch.stack([gm(x) for _ in range(100)]).mean(0)
    model.eval()
    with torch.no_grad():
        ref = model(x)
    assert ((mean - ref).abs().mean() / ref.abs().mean()) < 0.05


def test_dropout_zero_in_train_mode_is_exact():
    model = Stack(1, mask="causal_fill", dropout=0.0)
    x = x_in()
    p, q, _ = rewrite(model, (x,))
    p.module.train()
    q.module.train()
    torch.testing.assert_close(q.module(x), p.module(x), atol=1e-5, rtol=1e-4)
    (n,) = sdpa_nodes(q)
    assert n.target is aten.scaled_dot_product_attention.default and n.kwargs["dropout_p"] == 0.0


# ============================================================================================ GQA, MHA

class GQA(nn.Module):
    """Llama-style grouped-query attention with repeat_kv (expand + reshape)."""

    def __init__(self, d=32, h=4, kvh=2):
        super().__init__()
        self.h, self.kvh, self.dh = h, kvh, d // h
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kvh * self.dh, bias=False)
        self.v = nn.Linear(d, kvh * self.dh, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    @staticmethod
    def repeat_kv(x, n):
        b, h, t, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.dh).transpose(1, 2)
        k = self.k(x).view(B, T, self.kvh, self.dh).transpose(1, 2)
        v = self.v(x).view(B, T, self.kvh, self.dh).transpose(1, 2)
        k, v = self.repeat_kv(k, self.h // self.kvh), self.repeat_kv(v, self.h // self.kvh)
        att = torch.matmul(q, k.transpose(2, 3)) * self.dh ** -0.5 + mask
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, -1)
        return self.o(y)


@pytest.mark.parametrize("gqa", [True, False])
def test_gqa_repeat_kv(gqa):
    mask = torch.zeros(2, 1, 12, 12).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -1e9)
    _, q, res = check_exact(GQA(), (x_in(), mask), sites=1, opts=AttentionOptions(gqa=gqa, site_bytes=False))
    kw = sdpa_kwargs(q)
    assert kw["enable_gqa"] is gqa
    assert res.changes[0].details["gqa_groups"] == 2
    kshape = tuple(kw["k"].meta["fxmem_val"].shape)
    assert kshape == ((2, 2, 12, 8) if gqa else (2, 4, 12, 8))


class MHA(nn.Module):
    def __init__(self, need_weights=True, batch_first=True):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=batch_first)
        self.need_weights = need_weights

    def forward(self, x):
        out, _ = self.mha(x, x, x, need_weights=self.need_weights)
        return out


def test_multihead_attention_internals():
    _, q, res = check_exact(MHA(), (x_in(),), sites=1)
    assert res.changes[0].module == "mha"
    assert any("3-D" in n for n in res.changes[0].details["notes"])


def test_existing_sdpa_is_left_alone():
    p, q, res = rewrite(MHA(need_weights=False), (x_in(),))
    assert not res.modified and res.changes == []
    assert len(sdpa_nodes(p)) >= 0  # the fast path may or may not be traced as SDPA ...
    assert any("already" in n for n in res.notes) or not find_attention(p)
    # ... and an explicit F.scaled_dot_product_attention model certainly is left alone

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 12, 3, 4, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    p, q, res = rewrite(Fused(), (x_in(),))
    assert not res.modified and any("already in the graph" in n for n in res.notes)
    assert str(q.graph) == str(p.graph)


# ============================================================================================ left alone / reasons

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return F.softmax(self.fc(x), dim=-1) @ torch.ones(10, 3)  # softmax then a matmul, but not attention


def test_non_attention_softmax_is_not_touched():
    p, q, res = rewrite(Classifier(), (x_in(),))
    assert not res.modified and not res.changes and not res.notes
    assert find_attention(p) == []
    assert str(q.graph) == str(p.graph)


class Weights(Attn):
    def forward(self, x, pad=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, self.dh).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        att = F.softmax(q @ k.transpose(-2, -1) / 8 ** 0.5, dim=-1)
        return (att @ v).sum(), att  # attention weights returned


class WrongDim(Attn):
    def forward(self, x, pad=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, self.dh).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        att = F.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-2)
        return att @ v


@pytest.mark.parametrize("model,args,reason", [
    (Weights(), (x_in(),), "used outside the attention"),
    (WrongDim(), (x_in(),), "softmax over dim -2"),
    (Stack(1, mask="causal_fill", fill=-1e9), (x_in(),), "instead of -inf"),
], ids=["returned-weights", "softmax-dim", "finite-fill"])
def test_not_rewritten_reports_reason_and_module(model, args, reason):
    p, q, res = rewrite(model, args)
    assert not res.changes
    assert any(reason in n and "not rewritten" in n for n in res.notes), res.notes
    name = "layers.0" if isinstance(model, Stack) else ""
    assert any(n.startswith(name or "<root>") for n in res.notes)
    assert str(q.graph) == str(p.graph)


def test_skip_patterns():
    p, q, res = rewrite(Stack(3), (x_in(),), opts=AttentionOptions(skip=["layers.1"], site_bytes=False))
    assert len(sdpa_nodes(q)) == 2
    assert any(n.startswith("layers.1: not rewritten: skipped") for n in res.notes)


def test_find_attention_api():
    p = fxmem.capture(Stack(2, mask="causal_fill", dropout=0.1), (x_in(),), dynamic=False, check=False)
    p.refresh()
    sites = find_attention(p)
    assert [s.module for s in sites] == ["layers.0", "layers.1"]
    s = sites[0]
    assert s.ok and s.causal and s.dropout_p == 0.1 and s.gqa_groups == 1
    assert s.scale_value == pytest.approx(1 / math.sqrt(8))
    assert s.query is not None and s.key is not None and s.value is not None and s.softmax in s.nodes


class ShapeScale(nn.Module):
    """The scale is computed from a dynamic dim at run time (a python scalar in the graph, not a constant)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, 2))
        return F.softmax((q @ k.transpose(-2, -1)) * (T ** -0.5), -1) @ v


def test_shape_derived_scale_stays_symbolic():
    x = torch.randn(2, 12, 32)
    p, q, res = rewrite(ShapeScale(), (x,), dynamic=True)
    (n,) = sdpa_nodes(q)
    assert isinstance(n.kwargs["scale"], torch.fx.Node)  # computed per call, not baked in
    assert res.changes[0].details["scale"] == pytest.approx(12 ** -0.5)
    assert_same(run_with_grads(p.module, (x,)), run_with_grads(q.module, (x,)))
    x2 = torch.randn(3, 20, 32)
    p.module.eval()
    q.module.eval()
    torch.testing.assert_close(q.module(x2), p.module(x2), atol=1e-5, rtol=1e-4)
