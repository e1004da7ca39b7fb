"""Attention softmaxes as remat sites (`passes.checkpoint.remat_scores`): the copies matmul makes of strided q and
k written as graph nodes (`materialize_matmul_operands`), then the softmax chain (q @ k^T, scale, mask, softmax)
recomputed from them in backward, its dropout's output nested on it, instead of keeping the probabilities."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import fxmem
from fxmem.costmodel import estimate, estimate_from_trace
from fxmem.pipeline import PassContext, pass_module

from fxmem.passes.checkpoint import matmul_operands
from fxmem.passes.checkpoint.remat import held_matmul

from .conftest import example, grads
from . import zoo

ck = pass_module("checkpoint")


def _captured(name: str, zoo_model: bool = False):
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = zoo.BUILDERS[name]() if zoo_model else example(name)
    return model, fxmem.capture(copy.deepcopy(model), args, kwargs), args, kwargs, loss_fn


def _step(module, args, kwargs, loss_fn):
    module.train()
    torch.manual_seed(1)
    return grads(module, args, kwargs, loss_fn)


def _same_step(ref, module, args, kwargs, loss_fn) -> None:
    o1, g1 = _step(ref, args, kwargs, loss_fn)
    o2, g2 = _step(module, args, kwargs, loss_fn)
    leaves1, leaves2 = ([t for t in pytree.tree_leaves(o) if isinstance(t, torch.Tensor)] for o in (o1, o2))
    assert len(leaves1) == len(leaves2) and all(torch.equal(a, b) for a, b in zip(leaves1, leaves2))
    assert set(g1) == set(g2) and all(torch.equal(g1[k], g2[k]) for k in g1), \
        [k for k in g1 if not torch.equal(g1[k], g2[k])]


def test_matmul_operand_copies_as_nodes_change_no_byte_and_no_bit():
    """Each attention block's q @ k^T and att @ v get their strided operands' copies as nodes (3 per block: q, k^T,
    v); the estimate is the same to the byte and the training step the same to the bit."""
    model, program, args, kwargs, loss_fn = _captured("gpt")
    before = estimate(program, mode="train", loss_fn=loss_fn)
    rewritten = program.snapshot()
    names = matmul_operands.materialize_matmul_operands(rewritten.graph)
    rewritten.graph.lint()
    rewritten.module.recompile()
    blocks = len(model.h)
    assert len(names) == 2 * blocks
    assert sum(n.target is torch.ops.aten.contiguous.default for n in rewritten.graph.nodes) - \
        sum(n.target is torch.ops.aten.contiguous.default for n in program.graph.nodes) == 3 * blocks
    after = estimate(rewritten, mode="train", loss_fn=loss_fn)
    assert (after.peak, after.activations) == (before.peak, before.activations)
    _same_step(program.module, rewritten.module, args, kwargs, loss_fn)


def test_broadcast_and_contiguous_operands_are_left_alone():
    """A broadcast batch (its copy would be the expanded tensor) and contiguous operands get no copy node."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(1, 8, 8))

        def forward(self, x):  # x: (2, 3, 8, 8)
            return (x.transpose(-2, -1) @ self.w).sum() + (x @ x).sum()

    program = fxmem.capture(Net(), (torch.randn(2, 3, 8, 8),))
    assert matmul_operands.materialize_matmul_operands(program.graph) == []


def _all_sites_applied(program, loss_fn, scores: bool = True):
    """`program` as the pass's softmax variant builds it with every site applied: compact dropout masks, operand
    copies as nodes, remat sites with products and softmaxes; (the rewritten program, its traced estimate, per
    softmax site the matrix products in its chain)."""
    ctx = PassContext(policy=None, options=ck.CheckpointOptions(), mode="train", optimizer="adamw", budget=1,
                      baseline=None, enabled=("checkpoint",), loss_fn=loss_fn)
    prog = program.snapshot()
    ck.compact_dropout(prog)
    if scores:
        matmul_operands.materialize_matmul_operands(prog.graph)
    prog.graph.lint()
    prog.module.recompile()
    traced = ck.CheckpointPass._trace(prog, ctx)
    sites = ck.remat_sites(prog, traced, ck.default_balance(prog), products=True, scores=scores)
    # (softmax sites and their chains' products, named before the rewrite retargets their nodes)
    softmaxes = {s.node.name: [m.name for m in s.chain if held_matmul(m)] for s in sites if ck.softmax_site(s)}
    ck.apply_remat(prog, sites)
    prog.graph.lint()
    traced = ck.CheckpointPass._trace(prog, ctx)
    return prog, estimate_from_trace(prog, traced, mode="train", optimizer="adamw", loss_fn=loss_fn), softmaxes


def _estimated_as_measured(program, loss_fn, args, kwargs) -> tuple:
    """With every site applied, softmaxes among them: the activations estimated to the byte, and the peak estimate's
    error that of the same program without softmax sites (the static estimate of a program with every product
    site applied is a bias gradient high at the first backward linear, 512 B on the example decoder, with or
    without them). (the rewritten program, per softmax site its chain's products)"""
    errors = []
    for scores in (True, False):
        prog, est, softmaxes = _all_sites_applied(program, loss_fn, scores)
        measured = fxmem.measure(copy.deepcopy(prog.module), args, kwargs, loss_fn=loss_fn)
        assert est.activations == measured.activations
        errors.append(est.peak - measured.peak)
        if scores:
            result = prog, softmaxes
    assert 0 <= errors[0] == errors[1], errors
    return result


def test_every_site_with_softmaxes_is_exact_and_estimated_to_the_byte():
    """With every site applied on the example decoder, each attention's softmax among them (its chain back to
    q @ k^T), the step is bit-identical to the original and the estimate is as exact as without softmax sites."""
    model, program, args, kwargs, loss_fn = _captured("gpt")
    prog, softmaxes = _estimated_as_measured(program, loss_fn, args, kwargs)
    assert len(softmaxes) == len(model.h) and all(softmaxes.values()), softmaxes
    assert "remat_call('aten.softmax.int'" in prog.module.code
    _same_step(program.module, prog.module, args, kwargs, loss_fn)


@pytest.mark.parametrize("name", ["qwen2_left_padded", "t5", "vit", "whisper"])
def test_every_site_with_softmaxes_on_zoo_models(name):
    """The same on models written by others (Hugging Face's eager attention: grouped-query heads on a left-padded
    batch, T5's position bias added to the scores, ViT, Whisper's encoder and decoder): exact, and estimated as
    exactly as without softmax sites."""
    model, program, args, kwargs, loss_fn = _captured(name, zoo_model=True)
    prog, softmaxes = _estimated_as_measured(program, loss_fn, args, kwargs)
    # (Hugging Face's eager attention adds a mask or position bias built in the graph and kept by nobody: the chain
    # stops there, so only Whisper's unmasked attention has softmax sites yet; docs/design/checkpoint.md)
    assert bool(softmaxes) == (name == "whisper"), softmaxes
    _same_step(program.module, prog.module, args, kwargs, loss_fn)


def _transform(budget: str, **options):
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = example("gpt")
    ref = copy.deepcopy(model)
    res = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, measure=True, policy={
        "version": 1, "passes": {"checkpoint": {"activation_budget": budget, **options}}})
    return ref, res, args, kwargs, loss_fn, next(r for r in res.report.passes if r.name == "checkpoint")


def test_softmax_sites_alone_reach_an_activation_budget_exactly():
    """On the example decoder at 40% of its activations, remat with a softmax among its sites (recomputed from the
    copies of q and k, the probabilities' dropout output nested on it) reaches the budget without a region: the
    pass emits it and says so; the step is exact and keeps the bytes it planned. `remat_scores: false`: no softmax
    is recomputed."""
    ref, res, args, kwargs, loss_fn, rec = _transform("40%")
    assert rec.status == "applied", rec.reason
    assert rec.metrics["remat"]["softmaxes"] >= 1 and "plan" not in rec.metrics
    assert "remat_call('aten.softmax.int'" in res.module.code and "remat_call('aten.matmul.default'" in res.module.code
    assert any("attention softmax" in n for n in rec.notes), rec.notes
    assert res.report.measured_after.activations == rec.metrics["estimated_activations"] <= \
        0.4 * res.report.measured_before.activations
    _same_step(ref, res.module, args, kwargs, loss_fn)
    *_, off = _transform("40%", remat_scores=False)
    assert "softmaxes" not in off.metrics["remat"]


def test_regions_over_softmax_sites_exact_and_as_planned():
    """At 30%, regions planned over remat with softmax sites (an attention region over blocks whose softmaxes are
    recipes) win by the cost model: the step is exact and keeps what the plan said."""
    ref, res, args, kwargs, loss_fn, rec = _transform("30%")
    assert rec.status == "applied", rec.reason
    assert rec.metrics["remat"]["softmaxes"] >= 1 and any(c != "keep" for c in rec.metrics["plan"].values())
    assert any("and attention scores" in n for n in rec.notes), rec.notes
    assert res.report.measured_after.activations == rec.metrics["estimated_activations"]
    _same_step(ref, res.module, args, kwargs, loss_fn)
