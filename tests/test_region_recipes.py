"""Checkpoint regions run as recipes (fxmem.nn.region_recipe): backward recomputes only what the region's saves
read, under no_grad, with the bytes, gradients and random numbers of torch's checkpoint; the cost model prices and
walks that closure; saved results keep the choice."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx

import fxmem
from fxmem.nn import region_graph, region_recipe
from fxmem.nn.checkpoint import CheckpointRegion
from fxmem.nn.dropout import bool_mask_dropout
from fxmem.nn.recast import install

from fxmem.step import compute_loss

from .conftest import OpCounter, gpt_at_activation_budget, step_difference

torch.fx.wrap("bool_mask_dropout")  # (a call in the bodies symbolic_trace makes below, as in a captured graph)


def _regions(module) -> list[CheckpointRegion]:
    return [m for m in module.modules() if isinstance(m, CheckpointRegion)]


def _backward_ops(module, args, kwargs, loss_fn) -> OpCounter:
    torch.manual_seed(1)
    loss = compute_loss(loss_fn, module(*args, **kwargs), args, kwargs)
    counter = OpCounter()
    with counter:
        loss.backward()
    return counter


def test_the_decoder_at_a_low_budget_runs_its_regions_as_recipes_exactly_and_as_estimated():
    """At 12% of its activations the example decoder needs regions: they run as recipes (the report says so), the
    step is exact, keeps what the plan said, and peaks where the static estimate said. Backward runs fewer matrix
    products than the same plan run as torch's checkpoint (an MLP's second linear, whose output no save reads, is
    not run again), which keeps the same bytes."""
    ref, res, args, kwargs, loss_fn, rec = gpt_at_activation_budget("12%")
    regions = _regions(res.module)
    assert rec.status == "applied", rec.reason
    assert regions and all(r.fxmem_region.as_recipes for r in regions)
    assert any(c.details.get("recipes") and "as recipes" in c.reason for c in rec.changes)
    assert step_difference(ref, res.module, args, kwargs, loss_fn) is None
    assert res.report.measured_after.activations == rec.metrics["estimated_activations"]
    assert abs(res.report.measured_after.peak - rec.metrics["estimated_peak"]) <= 1024
    as_checkpoint = copy.deepcopy(res.module)
    for region in _regions(as_checkpoint):
        region.fxmem_region.as_recipes = False
    measured = fxmem.measure(copy.deepcopy(as_checkpoint), args, kwargs, loss_fn=loss_fn)
    assert measured.activations == res.report.measured_after.activations
    recipes, replayed = (_backward_ops(m, args, kwargs, loss_fn) for m in (res.module, as_checkpoint))
    assert recipes.matmuls() < replayed.matmuls(), (recipes.ops, replayed.ops)


def test_region_recipes_off_runs_torch_checkpoint():
    """`region_recipes: false`: every region is torch's checkpoint, as before recipe regions."""
    ref, res, args, kwargs, loss_fn, rec = gpt_at_activation_budget("12%", region_recipes=False)
    assert _regions(res.module) and not any(r.fxmem_region.as_recipes for r in _regions(res.module))
    assert step_difference(ref, res.module, args, kwargs, loss_fn) is None


def test_a_gradient_penalty_through_recipe_regions_is_exact():
    """A backward with create_graph=True (a gradient penalty) differentiates through what the regions recompute:
    autograd gives the unpacked values their forward history, so the second-order gradients are the original's."""
    ref, res, args, kwargs, loss_fn, rec = gpt_at_activation_budget("12%")
    assert any(r.fxmem_region.as_recipes for r in _regions(res.module))

    def penalty(module):
        module.train()
        for p in module.parameters():
            p.grad = None
        torch.manual_seed(1)
        loss = compute_loss(loss_fn, module(*args, **kwargs), args, kwargs)
        weight = next(p for n, p in module.named_parameters() if n.endswith("lm_head.weight"))
        grad, = torch.autograd.grad(loss, weight, create_graph=True)
        grad.pow(2).sum().backward()
        return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    expected, got = penalty(ref), penalty(res.module)
    assert set(expected) == set(got)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


_SCALE = float(torch.ones((), dtype=torch.float32) / 0.7)  # (the scale a captured graph hands a dropout)


class _Body(torch.nn.Module):
    """An MLP with dropout: what a region's body looks like (parameters passed in)."""

    def forward(self, x, w1, b1, w2, b2):
        h = torch.ops.aten.gelu.default(torch.ops.aten.linear.default(x, w1, b1))
        y = torch.ops.aten.linear.default(h, w2, b2)
        return torch.ops.aten.add.Tensor(bool_mask_dropout(y, 0.3, True, _SCALE, torch.float32), x)


class _Outer(torch.nn.Module):
    def __init__(self, region):
        super().__init__()
        self.region = region
        self.w1, self.b1 = torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(32))
        self.w2, self.b2 = torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.randn(16))

    def forward(self, x):
        return self.region(x, self.w1, self.b1, self.w2, self.b2)


def _outer(keep_ops, recipes: bool, body=None):
    torch.manual_seed(0)
    body = body if body is not None else fx.symbolic_trace(_Body())
    outer = _Outer(CheckpointRegion(body, keep_ops, label="mlp", recipes=recipes))
    install(outer)
    return outer


@pytest.mark.parametrize("keep_ops", [frozenset({"bernoulli"}), frozenset()], ids=["masks kept", "masks redrawn"])
def test_recipe_region_equals_the_checkpoint_masks_and_generator_included(keep_ops):
    """The same region as recipes and as torch's checkpoint, from the same generator state: the same output and
    gradients (the same dropout masks, kept or drawn again from the generator's state before the forward), and the
    generator left where the checkpoint leaves it. Backward runs one matrix product fewer (the second linear)."""
    x = torch.randn(8, 16, requires_grad=True)
    results = []
    for recipes in (True, False):
        outer = _outer(keep_ops, recipes)
        torch.manual_seed(5)
        out = outer(x)
        counter = OpCounter()
        with counter:
            out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in outer.named_parameters()}, x.grad.clone(),
                        torch.get_rng_state(), counter.matmuls()))
        x.grad = None
    (o1, g1, x1, rng1, mm1), (o2, g2, x2, rng2, mm2) = results
    assert torch.equal(o1, o2) and torch.equal(x1, x2) and torch.equal(rng1, rng2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    assert mm1 == mm2 - 1, (mm1, mm2)


def test_recipe_region_keeps_what_the_checkpoint_keeps_and_peaks_no_higher():
    """Saved bytes (fxmem.measure's count) equal the checkpoint's, the peak is no higher (the estimate's walk of the
    closure is held to the measured peak on the pass's own plans: the decoder test above)."""
    x = torch.randn(64, 16)
    recipes, replayed = _outer(frozenset(), True), _outer(frozenset(), False)
    m1 = fxmem.measure(copy.deepcopy(recipes), (x,), loss_fn=lambda out, *a: out.square().sum())
    m2 = fxmem.measure(copy.deepcopy(replayed), (x,), loss_fn=lambda out, *a: out.square().sum())
    assert m1.activations == m2.activations
    assert m1.peak <= m2.peak


def test_a_dropout_it_cannot_replay_keeps_the_saves_and_the_region_checkpoints_after():
    """A dropout of a strided input draws through aten.dropout, which no tape replays: that call keeps its saves as
    they are (exact, more bytes) and the region runs as torch's checkpoint from then on."""
    class Strided(torch.nn.Module):
        def forward(self, x, w1, b1, w2, b2):
            y = torch.ops.aten.linear.default(x, w1, b1)
            strided = torch.ops.aten.slice.Tensor(y, 1, 0, None, 2)
            kept = torch.ops.aten.sum.dim_IntList(bool_mask_dropout(strided, 0.3, True, _SCALE, torch.float32), [1],
                                                  True)
            return torch.ops.aten.mul.Tensor(kept, torch.ops.aten.gelu.default(y))
    outer = _outer(frozenset(), True, fx.symbolic_trace(Strided()))
    reference = _outer(frozenset(), False, fx.symbolic_trace(Strided()))
    x = torch.randn(8, 16, requires_grad=True)
    for module in (outer, reference):
        torch.manual_seed(5)
        module(x).square().sum().backward()
    assert all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
               for p, q in zip(outer.parameters(), reference.parameters()))
    assert not region_recipe._PLANS[outer.region].applicable


def test_a_save_no_recipe_can_make_is_kept_said_and_the_region_checkpoints_after():
    """A region the pass would not admit (a group norm, whose statistics are made inside the composite op and no
    graph value) forced to run as recipes: the statistics are kept as they are (exact), a warning names the region,
    and it runs as torch's checkpoint from the next step, as its planned bytes assume."""
    class Norm(torch.nn.Module):
        def forward(self, x, w1, b1, w2, b2):
            y = torch.ops.aten.linear.default(x, w1, b1)
            return torch.ops.aten.linear.default(torch.ops.aten.group_norm.default(y, 4), w2, b2)
    outer = _outer(frozenset(), True, fx.symbolic_trace(Norm()))
    reference = _outer(frozenset(), False, fx.symbolic_trace(Norm()))
    x = torch.randn(8, 16)
    with pytest.warns(RuntimeWarning, match="'mlp' saved 2 tensor"):
        outer(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(outer.parameters(), reference.parameters()))
    assert not region_recipe._PLANS[outer.region].applicable


def test_a_region_marked_as_recipes_that_draws_runs_as_the_checkpoint():
    """`recipes=True` from a saved file or by hand on a body the pass would not admit (a random op other than
    dropout's draw, which a closure run in backward would draw anew): a warning names the region and why, and it
    runs as torch's checkpoint (which restores the generator): exact."""
    class Draws(torch.nn.Module):
        def forward(self, x, w1, b1, w2, b2):
            y = torch.ops.aten.linear.default(x, w1, b1)
            noisy = torch.ops.aten.mul.Tensor(y, torch.ops.aten.rand_like.default(y))
            return torch.ops.aten.linear.default(torch.ops.aten.gelu.default(noisy), w2, b2)
    outer = _outer(frozenset(), True, fx.symbolic_trace(Draws()))
    reference = _outer(frozenset(), False, fx.symbolic_trace(Draws()))
    x = torch.randn(8, 16)
    with pytest.warns(RuntimeWarning, match="'mlp' is marked to run as recipes, but .* draws random numbers"):
        torch.manual_seed(3)
        outer(x).square().sum().backward()
    torch.manual_seed(3)
    reference(x).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(outer.parameters(), reference.parameters()))


@pytest.mark.parametrize("source, reason", [
    ("torch.ops.aten.batch_norm.default(x, None, None, m, v, True, 0.1, 1e-5, False)", "running statistics"),
    ("x + torch.ops.aten.rand_like.default(x)", "random"),
    ("torch.ops.aten.group_norm.default(x, 2)", "of its own making"),
    ("torch.ops.aten.add_.Tensor(x, 1)", "input in place"),
])
def test_what_cannot_run_as_recipes_says_why(source, reason):
    namespace = {"torch": torch}
    exec(f"def f(x, m, v):\n    return {source}\n", namespace)
    graph = fx.symbolic_trace(namespace["f"]).graph
    calls = [n for n in graph.nodes if n.op.startswith("call")]
    assert reason in region_graph.recipe_compatible(calls, frozenset(), False)
    assert region_graph.recipe_compatible(calls, frozenset({"mm"}), False) == "selective recomputation"


def test_saved_results_keep_their_recipe_regions(tmp_path):
    """A result saved and loaded runs its regions as it was planned to: as recipes (module.json records it), the
    step as exact as before saving."""
    ref, res, args, kwargs, loss_fn, rec = gpt_at_activation_budget("12%")
    module = fxmem.load(res.save(tmp_path / "out"))
    assert _regions(module) and all(r.fxmem_region.as_recipes for r in _regions(module))
    assert step_difference(ref, module, args, kwargs, loss_fn) is None
