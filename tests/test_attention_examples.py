"""Attention pass on the example models: every attention layer becomes one SDPA call, outputs and gradients equal;
the cost model knows the SDPA ops; the PassManager runs the pass as exact."""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem.pipeline import pass_module

from .conftest import example
from .test_attention import AttentionOptions, Stack, assert_same, rewrite, run_with_grads, sdpa_nodes


# ============================================================================================ examples

EXAMPLES = [
    ("gpt", dict(n_layer=2), 2),
    ("hf_gpt2", {}, None),
    ("hf_llama", {}, None),
    ("hf_bert", {}, None),
    ("vit", {}, None),
    ("gnn_stan", {}, 2),
]


def _n_layers(name, model):
    cfg = getattr(model, "config", None)
    if cfg is not None:
        return cfg.num_hidden_layers if hasattr(cfg, "num_hidden_layers") else cfg.n_layer
    if name == "vit":
        return len(model.blocks)
    raise AssertionError(name)


@pytest.mark.parametrize("name,build,layers", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_examples_every_attention_layer_rewritten_exactly(name, build, layers):
    model, args, kwargs, loss_fn = example(name, **build)
    layers = layers or _n_layers(name, model)
    p, q, res = rewrite(model, args, kwargs)
    assert len(sdpa_nodes(q)) == layers, res.notes
    assert_same(run_with_grads(p.module, args, kwargs), run_with_grads(q.module, args, kwargs))
    for c in res.changes:
        b = c.details["backend"]
        assert b["device"] == "cpu" and b["eval"] in ("flash", "math") and b["train"] in ("flash", "math")
        assert "SDPA backend on cpu" in c.reason


def test_cost_model_knows_sdpa_and_estimate_drops():
    # no attention dropout (the CPU flash kernel has none: with dropout, train mode runs the math kernel)
    model = Stack(2, mask="causal_fill", dropout=0.0)
    x = torch.randn(2, 64, 32)
    p, q, res = rewrite(model, (x,), opts=AttentionOptions())
    e0 = fxmem.estimate(p, mode="train")
    e1 = fxmem.estimate(q, mode="train")
    assert e1.unknown_ops == []
    assert e1.activations < e0.activations
    assert all(c.details["backend"]["train"] == "flash" for c in res.changes)
    assert all(c.bytes_saved > 0 for c in res.changes)


def test_pipeline_runs_the_pass_as_exact():
    model, args, kwargs, loss_fn = example("gpt", n_layer=2)
    pol = {"version": 1, "mode": "train", "optimizer": "adamw",
           "passes": {"attention": {"enabled": True}, "checkpoint": {"enabled": False}}}
    res = fxmem.transform(model, args, kwargs, policy=pol, loss_fn=loss_fn)
    (rec,) = [r for r in res.records if r.name == "attention"]
    assert rec.status == "applied" and rec.exact and len(rec.changes) == 2
    assert rec.metrics["rewritten"] == 2
    assert len(sdpa_nodes(res.program)) == 2


def test_options_validation():
    with pytest.raises(fxmem.PolicyError, match="rewrite"):
        fxmem.load_policy({"version": 1, "passes": {"attention": {"enabled": True, "rewrite": "flash"}}})
    with pytest.raises(fxmem.PolicyError, match="sparsity_ratio"):
        fxmem.load_policy({"version": 1, "passes": {"attention": {"enabled": True, "sparsity_ratio": 1.5}}})


def test_backend_probe_tries_the_dispatchers_choice_first():
    """The probe reports what SDPA's dispatcher runs: on Hopper GPUs torch 2.11 picks cuDNN before flash and
    memory-efficient, which a fixed order misreported (found on an H200). On CPU: flash, or math with dropout."""
    from fxmem.sdpa_backend import BACKEND_ORDER, dispatcher_choice, probe_order
    q = torch.randn(2, 4, 64, 32)
    assert dispatcher_choice(q, q, q, None, 0.0, False, None, False) == "FLASH_ATTENTION"
    assert dispatcher_choice(q, q, q, None, 0.1, False, None, False) == "MATH"
    assert probe_order("CUDNN_ATTENTION") == ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    assert probe_order(None) == probe_order("OVERRIDEABLE") == BACKEND_ORDER
