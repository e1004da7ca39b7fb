"""Checkpoint pass on every example model: outputs and gradients equal to the captured model (train mode, dropout
on, same seed: recomputation reproduces the masks), buffers updated once, and the cost model's estimate drops."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import fxmem
from fxmem.costmodel import estimate
from fxmem.pipeline import PassContext
from fxmem.step import compute_loss

from .conftest import EXAMPLE_NAMES, example, force_remat_and_regions
from .test_checkpoint import ck

SMALL = {"gpt": dict(n_layer=2)}
# examples where the pass may find nothing worth recomputing at this (unreachable) budget: graph models whose peak
# sits where recomputation cannot reach (gat, gcn), and gnn_stan, whose best-effort plan the cost model estimates
# above the baseline peak (recomputation transient at its attention matmul's backward); mlp_digits needed segments
# of consecutive layers (it is checkpointed now, kept here as allowed). The test checks the pass says why.
NOT_CHECKPOINTABLE = {"mlp_digits", "gat", "gcn", "gnn_stan"}


def _step(mod, args, kwargs, loss_fn, seed=5):
    mod.train()
    for q in mod.parameters():
        q.grad = None
    torch.manual_seed(seed)
    out = mod(*args, **kwargs)
    compute_loss(loss_fn, out, args, kwargs).backward()
    leaves = [t.detach() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    grads = {n: q.grad.detach().clone() for n, q in mod.named_parameters() if q.grad is not None}
    return leaves, grads


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_checkpoint_exact_on_example(name):
    model, args, kwargs, loss_fn = example(name, **SMALL.get(name, {}))
    p = fxmem.capture(model, args, kwargs)
    p.refresh()
    base = estimate(p, mode="train", loss_fn=loss_fn)
    budget = int(base.peak - 0.5 * base.activations)
    # offload "enabled": the pass does its best instead of raising when the budget is out of reach
    ctx = PassContext(policy=None, options=ck.CheckpointOptions(), mode="train", optimizer="adamw",
                      budget=budget, baseline=base, enabled=("checkpoint", "offload"), loss_fn=loss_fn)
    res = ck.CheckpointPass().run(p.snapshot(), ctx)
    if not res.modified:
        # allowed only with a reason: no candidate saves anything, or no plan lowers the estimate
        assert any("no candidate region" in n or "would not lower" in n for n in res.notes), (name, res.notes)
        assert name in NOT_CHECKPOINTABLE, (name, res.notes)
        return
    q = res.program
    q.refresh()
    assert set(q.module.state_dict()) == set(p.module.state_dict())
    ref_mod, new_mod = copy.deepcopy(p.module), copy.deepcopy(q.module)
    o1, g1 = _step(ref_mod, args, kwargs, loss_fn)
    o2, g2 = _step(new_mod, args, kwargs, loss_fn)
    assert len(o1) == len(o2)
    for a, b in zip(o1, o2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert set(g1) == set(g2)
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
    rb, nb = dict(ref_mod.named_buffers()), dict(new_mod.named_buffers())
    for k in rb:
        torch.testing.assert_close(nb[k], rb[k], msg=lambda m: f"{name} buffer {k}: {m}")
    after = estimate(q, mode="train", loss_fn=loss_fn)
    assert after.peak == res.metrics["estimated_peak"]
    # the peak may sit where checkpointing cannot reach (optimizer step, last region): the step's memory must
    # still drop somewhere: a lower peak or fewer activation bytes held after forward
    assert after.peak < base.peak or after.activations < base.activations, (name, after.peak, base.peak)
    assert after.peak <= base.peak, (name, after.peak, base.peak)
    # the cost model's view of recomputation (recomputed tensors freed as the region's backward goes) holds:
    # its estimate of the checkpointed step is close to the measured one
    meas = fxmem.measure(copy.deepcopy(q.module), args, kwargs, loss_fn=loss_fn)
    assert abs(after.peak - meas.peak) <= 0.05 * meas.peak, (name, after.peak, meas.peak)


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_static_estimate_of_the_lowest_plan_is_the_measured_peak(name):
    """At the lowest budget every block is a region: the static estimate must find the step's peak where the real
    step has it. gpt's peak is inside an attention region's recomputation, where a temporary it drops (the
    attention output, v's copy for the matmul) is live at once with what it keeps; vit's regions replay their
    dropout masks from a draw tape, which holds them until the region's whole backward is done, not only until
    the backward of the op saving each. Both were under-estimated before (0.40% and 0.27%)."""
    model, args, kwargs, loss_fn = example(name, **SMALL.get(name, {}))
    p = fxmem.capture(model, args, kwargs)
    p.refresh()
    base = estimate(p, mode="train", loss_fn=loss_fn)
    ctx = PassContext(policy=None, options=ck.CheckpointOptions(), mode="train", optimizer="adamw",
                      budget=int(base.peak - 0.9 * base.activations), baseline=base,
                      enabled=("checkpoint", "offload"), loss_fn=loss_fn)
    ctx.budget_strict = False  # as low as checkpointing goes
    res = ck.CheckpointPass().run(p.snapshot(), ctx)
    assert res.modified
    q = res.program
    q.refresh()
    regions = [m for m in q.module.modules() if getattr(m, "fxmem_region", None) is not None]
    assert len(regions) >= 2
    if name == "vit":
        assert any(m.fxmem_region.held_ops for m in regions)  # the taped masks are what this case checks
    static = estimate(q, mode="train", loss_fn=loss_fn)
    traced = estimate(q, mode="train", loss_fn=loss_fn, method="traced")
    meas = fxmem.measure(copy.deepcopy(q.module), args, kwargs, loss_fn=loss_fn)
    assert traced.peak == meas.peak
    # within a parameter gradient's worth of bytes (a bias gradient's accumulation: 256 bytes here)
    assert abs(static.peak - meas.peak) <= 1024, (name, static.peak, meas.peak, static.peak_at, meas.peak_at)


@pytest.mark.parametrize("scale_last", [False, True])
def test_static_estimate_of_a_redraw_region_over_the_remat_program(monkeypatch, scale_last):
    """A plan the planner chose at a0ce527 for the gpt example's lowest budget, forced here (the planner's own
    choice moves with its model): remat, then h.0.attn redrawn, h.0.mlp and h.1.attn recomputed in full. The peak is
    h.0.attn's recomputation, which runs in the backward of the region's last op that saves a tensor. When the
    residual dropout scaled in place after its mask multiply, that was not the region's last op: the scaling saves
    nothing, and its gradient, one (B, T, C) tensor, was live while the recomputation ran. The static estimate put
    the recomputation before that gradient (37,892 bytes, 0.39%, under). The dropout now scales first and masks
    last (the mask multiply is the first op of the backward, the peak 38,400 bytes lower), and the static estimate
    places a recomputation where it runs either way: `scale_last` puts the old order back, which keeps that case
    (a region whose last op saves nothing and makes a gradient before the recomputation) covered."""
    want = {"h.0.attn": "redraw", "h.0.mlp": "full", "h.1.attn": "full", "h.1.mlp": "keep"}
    if scale_last:
        import fxmem.nn.dropout as dropout
        # (masked by the packed mask with a scale of 1, exact, then scaled in place: saves nothing)
        monkeypatch.setattr(dropout, "remake", lambda x, packed, s: dropout.masked_scale(x, packed, 1.0).mul_(s))

    def forced(model, budget, solver, time_limit, chain, tiebreak=True):
        plan = [want.get(r.path) for r in model.regions]
        if None in plan or not all(c in ch for c, ch in zip(plan, model.choices)):
            return None
        return ck.Solution(plan, model.cost(plan), model.peak(plan), "forced", True)
    monkeypatch.setattr(ck, "solve", forced)
    force_remat_and_regions(monkeypatch)
    model, args, kwargs, loss_fn = example("gpt", **SMALL["gpt"])
    p = fxmem.capture(model, args, kwargs)
    p.refresh()
    base = estimate(p, mode="train", loss_fn=loss_fn)
    ctx = PassContext(policy=None, options=ck.CheckpointOptions(granularity="sub-block", refine=0), mode="train",
                      optimizer="adamw", budget=int(base.peak - 0.5 * base.activations), baseline=base,
                      enabled=("checkpoint",), loss_fn=loss_fn)
    res = ck.CheckpointPass().run(p.snapshot(), ctx)
    assert "remat" in res.metrics and res.metrics["plan"] == want
    q = res.program
    q.refresh()
    static = estimate(q, mode="train", loss_fn=loss_fn)
    meas = fxmem.measure(copy.deepcopy(q.module), args, kwargs, loss_fn=loss_fn)
    assert abs(static.peak - meas.peak) <= 1024, (static.peak, meas.peak, static.peak_at, meas.peak_at)
