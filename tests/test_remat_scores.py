"""Attention softmaxes as remat sites (`passes.checkpoint.remat_scores`): the copies matmul makes of strided q and
k written as graph nodes (`materialize_matmul_operands`), then the softmax chain (q @ k^T, scale, mask, softmax)
recomputed from them in backward, its dropout's output nested on it, instead of keeping the probabilities."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.costmodel import estimate, estimate_from_trace
from fxmem.pipeline import pass_module

from fxmem import matmul_operands
from fxmem.passes.checkpoint import remat
from fxmem.passes.checkpoint.remat import held_matmul, softmax_op

from .conftest import example, gpt_at_activation_budget, step_difference
from . import zoo
from .remat_variant import pass_context, prepared

ck = pass_module("checkpoint")


# zoo models beyond zoo.BUILDERS: T5 with eager attention, at a batch where its position bias (one per layer, no
# batch dim) is at most REMAT_KEPT_SHARE of what the softmax frees
ZOO_MORE = {"t5_eager": lambda: zoo.t5(batch=4, eager=True)}


def _captured(name: str, zoo_model: bool = False):
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = (ZOO_MORE.get(name) or zoo.BUILDERS[name])() if zoo_model else example(name)
    return model, fxmem.capture(copy.deepcopy(model), args, kwargs), args, kwargs, loss_fn


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
    assert step_difference(program.module, rewritten.module, args, kwargs, loss_fn) is None


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
    softmax site the matrix products in its chain). The planner's estimate of it (`as_planned`, the tensors its
    recipes keep counted too) is the traced one."""
    prog, ctx, traced = prepared(program, loss_fn, scores)
    sites = ck.remat_sites(prog, traced, ck.default_balance(prog), products=True, scores=scores)
    # (softmax sites and their chains' products, named before the rewrite retargets their nodes)
    softmaxes = {s.node.name: [m.name for m in s.chain if held_matmul(m)] for s in sites if ck.softmax_site(s)}
    planned = estimate_from_trace(prog, ck.as_planned(traced, sites), mode="train", optimizer="adamw",
                                  loss_fn=loss_fn)
    ck.apply_remat(prog, sites)
    prog.graph.lint()
    traced = ck.CheckpointPass._trace(prog, ctx)
    est = estimate_from_trace(prog, traced, mode="train", optimizer="adamw", loss_fn=loss_fn)
    assert (planned.activations, planned.peak) == (est.activations, est.peak)
    return prog, est, softmaxes


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
    assert step_difference(program.module, prog.module, args, kwargs, loss_fn) is None


@pytest.mark.parametrize("name", ["qwen2_left_padded", "t5_eager", "vit", "whisper"])
def test_every_site_with_softmaxes_on_zoo_models(name):
    """The same on models written by others (Hugging Face's eager attention: grouped-query heads on a left-padded
    batch, T5's position bias made from an embedding and added to the scores, ViT, Whisper's encoder and decoder):
    every attention softmax is a site, its recipe keeping the mask (or bias) the graph builds and nobody saves; the
    step exact, and estimated, as planned, as exactly as without softmax sites."""
    model, program, args, kwargs, loss_fn = _captured(name, zoo_model=True)
    prog, softmaxes = _estimated_as_measured(program, loss_fn, args, kwargs)
    graph_softmaxes = [n for n in program.graph.nodes if softmax_op(n)]
    assert graph_softmaxes and len(softmaxes) == len(graph_softmaxes), (graph_softmaxes, softmaxes)
    assert step_difference(program.module, prog.module, args, kwargs, loss_fn) is None


def _sites_with_softmaxes(name: str, products: bool = True):
    """Bundled example `name` as the pass's softmax variant sees it (refreshed as the pipeline leaves it, compact
    dropout masks, operand copies as nodes): every remat site found with softmaxes (and `products`), and the
    trace's storage sizes."""
    _, program, _, _, loss_fn = _captured(name)
    program.refresh()  # (a no-op cast's example value, by which its storage is found: GPT-2's before dropout)
    prog, _, traced = prepared(program, loss_fn, scores=True)
    sites = ck.remat_sites(prog, traced, ck.default_balance(prog), products=products, scores=True)
    return sites, traced.recorder.storage_bytes


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert", "hf_llama"])
def test_one_mask_kept_for_every_layer(name):
    """Hugging Face builds the attention mask once and adds it in every layer: each layer's softmax site keeps
    that one tensor (its bytes paid once), a fraction of what the site frees."""
    sites, sizes = _sites_with_softmaxes(name)
    sites = [s for s in sites if ck.softmax_site(s)]
    assert len(sites) == 2, [s.node.name for s in sites]  # the examples' two layers
    kept = {s.kept for s in sites}
    assert len(kept) == 1 and len(next(iter(kept))) == 1, kept
    (key,) = next(iter(kept))
    assert all(sizes[key] <= remat.REMAT_KEPT_SHARE * s.bytes for s in sites)


def test_a_mask_as_large_as_the_scores_is_not_kept():
    """A softmax whose recipe would keep a mask as large as the probabilities it frees (one head, a mask per sample
    and query built in the graph) is no site; with four heads sharing the mask it is one."""
    class Attention(torch.nn.Module):
        def __init__(self, heads: int):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(16, 48)
            self.out = torch.nn.Linear(16, 16)

        def forward(self, x, keep):  # x: (b, s, 16); keep: (b, s) of 0/1
            b, s, _ = x.shape
            q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            mask = torch.zeros(b, 1, s, s).masked_fill(keep[:, None, None, :] == 0, float("-inf"))
            mask = mask + torch.zeros(s, s).masked_fill(torch.ones(s, s).triu(1) == 1, float("-inf"))
            probs = torch.softmax(q @ k.transpose(-2, -1) + mask, dim=-1)
            return self.out((probs @ v).transpose(1, 2).reshape(b, s, -1))

    x, keep = torch.randn(2, 8, 16), torch.ones(2, 8, dtype=torch.long)
    keep[1, -2:] = 0
    found = {}
    for heads in (1, 4):
        program = fxmem.capture(Attention(heads), (x, keep))
        matmul_operands.materialize_matmul_operands(program.graph)
        program.module.recompile()
        traced = ck.CheckpointPass._trace(program, pass_context(None))
        sites = ck.remat_sites(program, traced, ck.default_balance(program), products=True, scores=True)
        found[heads] = [s for s in sites if ck.softmax_site(s)]
    assert found[1] == [] and len(found[4]) == 1 and found[4][0].kept, found


def test_softmax_sites_alone_reach_an_activation_budget_exactly():
    """On the example decoder at 40% of its activations, remat with a softmax among its sites (recomputed from the
    copies of q and k, the probabilities' dropout output nested on it) reaches the budget without a region: the
    pass emits it and says so; the step is exact and keeps the bytes it planned. `remat_scores: false`: no softmax
    is recomputed."""
    ref, res, args, kwargs, loss_fn, rec = gpt_at_activation_budget("40%")
    assert rec.status == "applied", rec.reason
    assert rec.metrics["remat"]["softmaxes"] >= 1 and "plan" not in rec.metrics
    assert "remat_call('aten.softmax.int'" in res.module.code and "remat_call('aten.matmul.default'" in res.module.code
    assert any("attention softmax" in n for n in rec.notes), rec.notes
    assert res.report.measured_after.activations == rec.metrics["estimated_activations"] <= \
        0.4 * res.report.measured_before.activations
    assert step_difference(ref, res.module, args, kwargs, loss_fn) is None
    *_, off = gpt_at_activation_budget("40%", remat_scores=False)
    assert "softmaxes" not in off.metrics["remat"]


def test_regions_over_softmax_sites_exact_and_as_planned():
    """At 24%, regions planned over remat with softmax sites (regions over blocks whose softmaxes are recipes, run
    as recipes) win by the cost model: the step is exact and keeps what the plan said. (With torch's checkpoint for
    regions, `region_recipes: false`, regions over matrix-product sites alone win from 20% to 28% since masks are
    packed.)"""
    ref, res, args, kwargs, loss_fn, rec = gpt_at_activation_budget("24%")
    assert rec.status == "applied", rec.reason
    assert rec.metrics["remat"]["softmaxes"] >= 1 and any(c != "keep" for c in rec.metrics["plan"].values())
    assert any("and attention scores" in n for n in rec.notes), rec.notes
    assert res.report.measured_after.activations == rec.metrics["estimated_activations"]
    assert step_difference(ref, res.module, args, kwargs, loss_fn) is None


def test_dropout_over_a_no_op_cast_of_the_softmax_holds_it_nested():
    """Hugging Face's GPT-2 casts its attention probabilities to the value's dtype (`aten.to`, a no-op here) before
    dropout: the dropout site still holds the softmax site nested (the cast hands on the softmax's own tensor), so
    the probabilities are not kept through it."""
    sites, _ = _sites_with_softmaxes("hf_gpt2", products=False)
    softmaxes = {s.node.name for s in sites if ck.softmax_site(s)}
    dropouts = [s for s in sites if "dropout" in s.node.name and s.node.args[0].target is torch.ops.aten.to.dtype
                and s.node.args[0].args[0].name in softmaxes]
    assert len(softmaxes) == 2 and len(dropouts) == 2, (softmaxes, [s.node.name for s in sites])
    assert all(s.holds == (s.node.args[0].args[0].name,) for s in dropouts), [s.holds for s in dropouts]


def test_softmax_sites_without_matrix_product_sites_win_on_hugging_face_gpt2():
    """Softmaxes (with the cheap sites) are sites in a plan without any linear being one: on Hugging Face's GPT-2 (3
    layers, 4 x 128 tokens; its mask kept, its probabilities' cast looked through), whose Conv1D linears are dear
    sites, regions over that remat are the cheapest plan at 22% of the activations: the pass says so, and the
    step is exact and keeps the bytes it planned."""
    import examples.hf_gpt2 as gpt2
    from fxmem.modelfile import split_inputs
    torch.manual_seed(0)
    model, _, _, loss_fn = example("hf_gpt2", n_layer=3)
    args, kwargs = split_inputs(gpt2.example_inputs(batch=4, seq_len=128))
    ref = copy.deepcopy(model)
    res = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, measure=True, policy={
        "version": 1, "passes": {"checkpoint": {"activation_budget": "22%"}}})
    rec = next(r for r in res.report.passes if r.name == "checkpoint")
    assert rec.status == "applied", rec.reason
    assert any("regions over remat with attention scores among its sites" in n for n in rec.notes), rec.notes
    assert rec.metrics["remat"]["softmaxes"] == 3 and "products" not in rec.metrics["remat"], rec.metrics["remat"]
    assert "remat_call('aten.softmax.int'" in res.module.code and "'aten.addmm.default'" not in res.module.code
    assert res.report.measured_after.activations == rec.metrics["estimated_activations"] <= \
        0.22 * res.report.measured_before.activations
    assert step_difference(ref, res.module, args, kwargs, loss_fn) is None
