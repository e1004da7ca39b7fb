"""Approximate attention (opt-in): HybridAttention (chunked top-k) and SemiseparableAttention (band + low-rank).

Module level: exact limits, error falling as top_k / rank grow, gradients, memory saved for backward linear in N
(measured with fxmem.measure at two sizes). Pass level: `rewrite: hab | semiseparable` swaps the modules in, reports
each site's error (which orders the guard's back-off to exact SDPA); the guard of lossy changes judges the model
end to end, and the PassManager verifies it as lossy."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxmem
from fxmem.nn.attention import HybridAttention, SemiseparableAttention

from .test_attention import AttentionOptions, Stack, rewrite_attention, sdpa_nodes


def qkv(N, E=16, H=2, sharp=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, N, E, generator=g, dtype=torch.float64) * s).to(dtype)
            for s in (sharp, sharp, 1.0)]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ============================================================================================ HybridAttention

@pytest.mark.parametrize("causal", [False, True])
def test_hab_exact_when_top_k_covers_all_keys(causal):
    q, k, v = (t.requires_grad_() for t in qkv(50))
    mask = torch.zeros(1, 1, 1, 50)
    mask[..., -5:] = -1e4
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, scale=0.3) if not causal else \
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    out = HybridAttention(0.3, causal, top_k=50, chunk_size=16)(q, k, v, None if causal else mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_hab_gradients_match_autograd_of_the_same_sparse_function():
    q, k, v = (t.double().requires_grad_() for t in qkv(9, E=2, H=1))
    mask = torch.randn(1, 1, 9, 9, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b, c: HybridAttention(0.5, False, 4, 4)(a, b, c, mask), (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: HybridAttention(0.5, True, 4, 4)(a, b, c), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_hab_error_falls_as_top_k_grows(causal):
    q, k, v = qkv(256, sharp=2.0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25)
    errs = [rel(HybridAttention(0.25, causal, top_k=kk, chunk_size=64)(q, k, v), ref) for kk in (4, 16, 64, 256)]
    assert errs[0] > errs[1] > errs[2] > errs[3] and errs[3] < 1e-5, errs


# ============================================================================================ Semiseparable

@pytest.mark.parametrize("causal", [False, True])
def test_semiseparable_exact_when_the_band_covers_everything(causal):
    q, k, v = qkv(64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25)
    out = SemiseparableAttention(0.25, causal, rank=3, band=32, head_dim=16)(q, k, v)
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_semiseparable_error_falls_as_rank_grows(causal):
    # positive random features estimate exp(q.k) without bias; the variance grows with |q|^2 + |k|^2, so this is
    # the small-norm regime where the low-rank far field is accurate (the guard backs the rest off to exact SDPA)
    q, k, v = qkv(256, sharp=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25)
    errs = [rel(SemiseparableAttention(0.25, causal, rank=r, band=32, head_dim=16)(q, k, v), ref)
            for r in (2, 32, 512)]
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 0.05


def test_semiseparable_options_hierarchical_lowrank_dtype_mask_grad():
    q, k, v = qkv(200, sharp=0.3)
    mask = torch.zeros(1, 1, 1, 200)
    mask[..., -20:] = float("-inf")
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    base = rel(SemiseparableAttention(0.25, False, rank=8, band=32, head_dim=16)(q, k, v, mask), ref)
    hier = rel(SemiseparableAttention(0.25, False, rank=8, band=32, hierarchical=True, head_dim=16)(q, k, v, mask), ref)
    bf16 = rel(SemiseparableAttention(0.25, False, rank=8, band=32, lowrank_dtype="bf16", head_dim=16)(q, k, v, mask),
               ref)
    assert base < 0.5 and hier < 0.5 and abs(bf16 - base) < 0.02, (base, hier, bf16)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = SemiseparableAttention(0.25, True, rank=8, band=32, head_dim=16)(qg, kg, vg)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (qg, kg, vg))
    with pytest.raises(ValueError, match="key-padding"):
        SemiseparableAttention(0.25, False, rank=8, band=32, head_dim=16)(q, k, v, torch.zeros(1, 1, 200, 200))


# ============================================================================================ memory linear in N

class Block(nn.Module):
    def __init__(self, attn, d=32, h=2):
        super().__init__()
        self.h, self.dh = h, d // h
        self.qkv = nn.Linear(d, 3 * d)
        self.attn = attn

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, self.dh).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        if self.attn is None:  # manual attention, the quadratic reference
            return (F.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v).sum()
        return self.attn(q, k, v).sum()


def _saved(attn, N):
    torch.manual_seed(0)
    prof = fxmem.measure(Block(attn), (torch.randn(1, N, 32),), mode="train", optimizer="sgd",
                         loss_fn=lambda out, inputs: out)
    return prof.activations


@pytest.mark.parametrize("make", [lambda: HybridAttention(0.25, True, top_k=16, chunk_size=64),
                                  lambda: SemiseparableAttention(0.25, True, rank=8, band=32, head_dim=16)],
                         ids=["hab", "semiseparable"])
def test_saved_memory_is_linear_in_n(make):
    a1, a2 = _saved(make(), 512), _saved(make(), 1024)
    m1, m2 = _saved(None, 512), _saved(None, 1024)
    assert m2 / m1 > 3.5  # manual attention: quadratic
    assert a2 / a1 < 2.3, (a1, a2)  # approximations: linear
    assert a2 < m2 / 4


# ============================================================================================ the pass

def test_pass_swaps_in_hab_and_reports_the_error():
    torch.manual_seed(0)
    model = Stack(2, mask="causal_fill", n_ctx=64)
    x = torch.randn(2, 48, 32)
    p = fxmem.capture(model, (x,), dynamic=False, check=False)
    p.refresh()
    q = p.snapshot()
    res = rewrite_attention(q, AttentionOptions(rewrite="hab", top_k=48, chunk_size=16, site_bytes=False))
    q.refresh()
    assert [c.kind for c in res.changes] == ["attention.hab", "attention.hab"]
    for c in res.changes:
        assert c.details["rel_error"] < 1e-5 and c.details["top_k"] == 48 and c.details["is_causal"]
    mods = [m for m in q.module.modules() if isinstance(m, HybridAttention)]
    assert len(mods) == 2
    model.eval()
    q.module.eval()
    torch.testing.assert_close(q.module(x), model(x), atol=1e-5, rtol=1e-4)  # top_k = N: exact
    q.module(x).sum().backward()
    assert all(p_.grad is not None for p_ in q.module.parameters())


def test_guard_refusing_the_approximation_keeps_exact_sdpa_and_says_so():
    """A relative-error limit the approximation cannot meet: the guard refuses it end to end, every site is exact
    SDPA instead, and the report's first warning says what was asked, what was done and which setting to change."""
    model = Stack(1, n_ctx=64)
    x = torch.randn(2, 48, 32)
    pol = {"version": 1, "mode": "train", "optimizer": "adamw",
           "passes": {"attention": {"enabled": True, "rewrite": "semiseparable", "rank": 2, "band": 8,
                                    "tolerance": 1e-6, "site_bytes": False}}}
    res = fxmem.transform(model, (x,), policy=pol)
    (rec,) = [r for r in res.records if r.name == "attention"]
    assert rec.status == "applied" and [c.kind for c in rec.changes] == ["attention.sdpa"]
    assert "backed off here by the guard" in rec.changes[0].reason
    assert len(sdpa_nodes(res.program)) == 1
    (line,) = res.report.shortfalls()
    assert line.startswith("attention: asked semiseparable at 1 attention site(s), semiseparable at 0 of 1 (the rest "
                           "exact SDPA): the guard (relative output error ")
    assert "raise passes.attention.tolerance (now 1e-06)" in line
    assert line.endswith("give evaluate (the task metric then decides)")
    assert res.report.to_markdown().count(line) == 2  # the warnings at the top, and the pass's section


def test_pipeline_verifies_approximations_as_lossy():
    model = Stack(2, mask="causal_fill", n_ctx=64)
    x = torch.randn(2, 48, 32)
    pol = {"version": 1, "mode": "train", "optimizer": "adamw",
           "verify": {"lossy_tolerance": 0.5, "top1_agreement": 0.0},
           "passes": {"attention": {"enabled": True, "rewrite": "hab", "top_k": 24, "chunk_size": 16}}}
    res = fxmem.transform(model, (x,), policy=pol)
    (rec,) = [r for r in res.records if r.name == "attention"]
    assert rec.exact is False and rec.status == "applied"
    assert all(c.kind == "attention.hab" and 0 < c.details["rel_error"] <= 0.5 for c in rec.changes)
    assert rec.deviation["vs_original"]["rel"] <= 0.5
    (verdict,) = rec.metrics["guard"]
    assert verdict["kind"] == "attention" and verdict["accepted"] and verdict["measures"]["rel_error"] <= 0.5


def test_hab_low_rank_projections_from_svd_of_the_weights():
    torch.manual_seed(0)
    model = Stack(1, mask="causal_fill", n_ctx=64)
    x = torch.randn(2, 48, 32)
    errs = []
    for ratio in (0.25, 0.5, 1.0):
        p = fxmem.capture(model, (x,), dynamic=False, check=False)
        p.refresh()
        res = rewrite_attention(p, AttentionOptions(rewrite="hab", top_k=48, rank_ratio=ratio, tolerance=10.0,
                                                    site_bytes=False))
        (c,) = res.changes
        assert c.kind == "attention.hab" and c.details["rank"] == max(1, math.ceil(ratio * 8))
        errs.append(c.details["rel_error"])
        p.refresh()
        (mod,) = [m for m in p.module.modules() if isinstance(m, HybridAttention)]
        assert mod.q_proj.weight.shape == (4 * c.details["rank"], 32)  # new trainable low-rank projections
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-5, errs  # full rank (and top_k = N) is exact
    p.module.eval()
    p.module(x).sum().backward()
    assert mod.q_proj.weight.grad is not None and mod.k_proj.weight.grad.abs().sum() > 0
