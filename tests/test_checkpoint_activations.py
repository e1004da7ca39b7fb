"""Checkpoint pass under an activation budget (`passes.checkpoint.activation_budget`): the bytes autograd keeps at the
end of forward, what torch.compile's activation_memory_budget bounds, planned, estimated and measured."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import fxmem
from fxmem.costmodel import CandidateRegion, RegionModel, estimate
from fxmem.errors import BudgetError, PolicyError
from fxmem.pipeline import PassContext, pass_module
from fxmem.units import Budget, parse_budget

from .conftest import grads

ck = pass_module("checkpoint")

import examples.gpt as gpt  # noqa: E402
import examples.unet as unet  # noqa: E402


def _capture(ex, model_kw, input_kw):
    m = ex.build_model(**model_kw)
    x = ex.example_inputs(**input_kw)
    p = fxmem.capture(m, x)
    p.refresh()
    return p, x, ex.loss_fn, estimate(p, mode="train", loss_fn=ex.loss_fn)


@pytest.fixture(scope="module")
def unet_prog():
    return _capture(unet, {}, {})


@pytest.fixture(scope="module")
def gpt_prog():
    return _capture(gpt, dict(n_layer=3, d_model=64, n_head=4, block_size=64), dict(batch=4, seq_len=64))


def _run(prog, act_budget, budget=None, enabled=("checkpoint",), strict=True, **opts):
    p, x, loss_fn, base = prog
    options = ck.CheckpointOptions(activation_budget=parse_budget(act_budget) if isinstance(act_budget, str)
                                   else None if act_budget is None else Budget(bytes=act_budget), **opts)
    ctx = PassContext(policy=None, options=options, mode="train", optimizer="adamw", budget=budget, baseline=base,
                      enabled=enabled, loss_fn=loss_fn, budget_strict=strict)
    return ck.CheckpointPass().run(p.snapshot(), ctx)


def _step(mod, x, loss_fn):
    mod.train()
    torch.manual_seed(3)  # the same dropout masks in both steps
    out, g = grads(mod, x, {}, loss_fn)
    return out.detach(), g


@pytest.mark.parametrize("name", ["unet", "gpt"])
def test_measured_activations_within_the_budget_exact_and_monotone(name, unet_prog, gpt_prog):
    prog = {"unet": unet_prog, "gpt": gpt_prog}[name]
    p, x, loss_fn, base = prog
    measured, costs = [], []
    for frac in (0.7, 0.5, 0.35):
        res = _run(prog, f"{int(frac * 100)}%")
        assert res.modified, frac
        limit = int(frac * base.activations)
        m = res.metrics
        assert m["activation_budget"] == limit and m["budget"] is None
        assert m["estimated_activations"] <= limit, (frac, m)
        prof = fxmem.measure(copy.deepcopy(res.program.module), x, loss_fn=loss_fn)
        # the static estimate is the measured count (the cost model's claim the budget rests on)
        assert prof.activations == pytest.approx(m["estimated_activations"], rel=0.005), frac
        assert prof.activations <= limit * (1 + m["slack"]), (frac, prof.activations, limit)
        measured.append(prof.activations)
        costs.append(sum(c.details.get("recompute_cost", 0.0) for c in res.changes))
        o1, g1 = _step(copy.deepcopy(p.module), x, loss_fn)
        o2, g2 = _step(copy.deepcopy(res.program.module), x, loss_fn)
        torch.testing.assert_close(o2, o1, rtol=0, atol=0)
        assert set(g1) == set(g2)
        for k in g1:
            torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-6, msg=lambda s: f"{k}: {s}")
    assert all(a >= b for a, b in zip(measured, measured[1:])), measured


def test_regions_planned_on_remat_count_a_nested_recipe_they_make_plain(unet_prog):
    # the U-Net's decoder cat recipe holds its upsampling convolution's output as a nested recipe; a region that
    # recomputes the upsampling makes that output plain, held by the cat's recipe: the memory model must count it
    # (planned activations = the estimate's). (With convolutions as sites, remat alone reaches this budget.)
    res = _run(unet_prog, "30%", refine=0, remat_products=False)
    m = res.metrics
    assert "remat" in m and any(c != "keep" for c in m["plan"].values()), m
    assert m["planned_activations"] == pytest.approx(m["estimated_activations"], rel=0.005), m["plan"]


def test_both_budgets_are_met(unet_prog):
    p, x, loss_fn, base = unet_prog
    # a peak budget between the lowest reachable peak and the peak of the plan for the activation budget alone:
    # both bind
    alone = _run(unet_prog, "40%").metrics["estimated_peak"]
    lowest = _run(unet_prog, None, budget=1, strict=False).metrics["estimated_peak"]
    assert lowest < alone
    peak = (lowest + alone) // 2
    res = _run(unet_prog, "40%", budget=peak)
    m = res.metrics
    assert m["best_effort"] is None
    assert m["estimated_peak"] <= peak and m["estimated_activations"] <= int(0.4 * base.activations), m
    prof = fxmem.measure(copy.deepcopy(res.program.module), x, loss_fn=loss_fn)
    assert prof.peak <= peak * 1.05 and prof.activations <= int(0.4 * base.activations) * 1.05


def test_unreachable_activation_budget(unet_prog):
    with pytest.raises(BudgetError) as ei:
        _run(unet_prog, "1%")
    msg = str(ei.value)
    assert "activation budget" in msg and "lowest activations" in msg
    # the offload pass plans against the peak budget: enabling it does not make an activation budget a target
    with pytest.raises(BudgetError):
        _run(unet_prog, "1%", enabled=("checkpoint", "offload"))
    # a policy whose budgets are targets (budget_strict: false): best effort, as low as checkpointing goes, which
    # is what the message said
    res = _run(unet_prog, "1%", strict=False)
    assert res.modified and any("lowest activations" in n and "budget_strict: false" in n for n in res.notes)
    assert res.metrics["best_effort"] == "activations"
    lowest = float(msg.split("reaches, about ")[1].split(" ")[0])
    assert res.metrics["estimated_activations"] / 2 ** 10 == pytest.approx(lowest, rel=0.01)


def test_activation_budget_already_met_changes_nothing(unet_prog):
    res = _run(unet_prog, "100%")
    assert not res.modified and "already fits" in res.notes[0]


def test_policy_key_and_transform(unet_prog):
    p, x, loss_fn, base = unet_prog
    model = unet.build_model()
    res = fxmem.transform(model, x, policy={"version": 1, "budget": None, "passes": {
        "checkpoint": {"activation_budget": "45%"}}}, loss_fn=loss_fn)
    rec = next(r for r in res.report.passes if r.name == "checkpoint")
    assert rec.status == "applied", rec
    assert rec.metrics["estimated_activations"] <= int(0.45 * base.activations)
    # the report states the activation budget and whether the result fits it
    line = res.report.activation_budget_line()
    assert line.startswith("activation budget ") and "fits" in line and "OVER" not in line
    assert res.report.activation_budget() == rec.metrics["activation_budget"]
    with pytest.raises(PolicyError) as ei:
        fxmem.transform(model, x, policy={"version": 1, "passes": {"checkpoint": {"activation_budget": "150%"}}},
                        loss_fn=loss_fn)
    assert "passes.checkpoint.activation_budget" in str(ei.value)


def _synthetic(act_need):
    regs = []
    for i in range(5):
        r = CandidateRegion(f"b{i}", [])
        r.saved, r.kept, r.held, r.flops, r.flops_sel = 100 + 17 * i, 30 + 5 * i, 0, 40.0 + 3 * i, 9.0 + 2 * i
        regs.append(r)
    choices = [("keep", "selective", "full")] * 5
    live = [1000, 1180, 1250, 1220, 1200, 1150]
    return RegionModel(regs, live, 0, "", choices, act_need=act_need)


@pytest.mark.parametrize("act_need", [0, 150, 320, 480])
def test_solvers_meet_the_activation_need_at_the_optimum(act_need):
    model = _synthetic(act_need)
    budget = 1150
    best = None
    for plan in itertools.product(*model.choices):
        plan = list(plan)
        if model.fits(plan, budget) and (best is None or model.cost(plan) < best):
            best = model.cost(plan)
    assert best is not None
    for solver in ("dp", "milp", "greedy"):
        sol = ck.solve(model, budget, solver, 5.0, chain=True)
        assert sol is not None and model.freed(sol.plan) >= act_need and sol.peak <= budget, solver
        if solver != "greedy":
            assert sol.cost == pytest.approx(best), solver
    # above what every region frees together: no plan
    too_much = _synthetic(model.max_freed() + 1)
    assert all(ck.solve(too_much, budget, s, 5.0, chain=True) is None for s in ("dp", "milp", "greedy"))


def test_last_remat_site_is_the_cheapest_that_completes_the_prefix(unet_prog):
    """Sites are taken cheapest per byte first; the one that completes the prefix is the cheapest site that makes
    the estimate meet the limit, not necessarily the next in line (a small pooling instead of a large
    concatenation): same number of sites, less recompute, the budget still met (and measured so)."""
    from fxmem.costmodel import trace_forward
    p, x, loss_fn, base = unet_prog
    sites = ck.remat_sites(p, trace_forward(p, p.example_args, p.example_kwargs, "train", loss_fn),
                           ck.default_balance(p))
    cost = {s.node.name: s.cost for s in sites}
    order = [s.node.name for s in sites]
    swapped = 0
    for pct in (50, 60, 70, 80):
        res = _run(unet_prog, f"{pct}%")
        m = res.metrics
        names = [c.nodes_before[-1] for c in res.changes if c.kind == "checkpoint_remat"]
        assert m["estimated_activations"] <= int(pct / 100 * base.activations), pct
        prefix = order[:len(names)]
        if set(names) != set(prefix):
            swapped += 1
            assert set(names) - set(prefix) and len(set(names) - set(prefix)) == 1, (names, prefix)
            assert sum(cost[n] for n in names) < sum(cost[n] for n in prefix), pct
            prof = fxmem.measure(copy.deepcopy(res.program.module), x, loss_fn=loss_fn)
            assert prof.activations == pytest.approx(m["estimated_activations"], rel=0.005), pct
    assert swapped >= 2


def test_a_block_takes_the_glue_after_it_where_that_frees_more(unet_prog, monkeypatch):
    """The U-Net's 1x1 output convolution saves the last decoder block's whole output; once remat made the poolings
    and up-convolutions recipes, those regions save nothing of their own. `dec1+out` (the block with its glue)
    recomputes that output instead: it frees more than `dec1`, and the lowest activations the pass reaches are
    lower than with block regions alone. Exact, and measured = estimated. (Without convolutions as remat sites,
    which reach lower still, and not through the glue: the lowest plan then has block regions alone.)"""
    p, x, loss_fn, base = unet_prog
    lowest = _run(unet_prog, "1%", strict=False, remat_products=False)
    m = lowest.metrics
    assert m["granularity"] == "block+glue"
    assert "dec1+out" in m["plan"] and m["plan"]["dec1+out"] != "keep", m["plan"]
    prof = fxmem.measure(copy.deepcopy(lowest.program.module), x, loss_fn=loss_fn)
    assert prof.activations == m["estimated_activations"]
    o1, g1 = _step(copy.deepcopy(p.module), x, loss_fn)
    o2, g2 = _step(copy.deepcopy(lowest.program.module), x, loss_fn)
    torch.testing.assert_close(o2, o1, rtol=0, atol=0)
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-6, msg=lambda s: f"{k}: {s}")
    # without merges the pass reaches less
    monkeypatch.setattr(ck, "glue_regions", lambda program, regions, measure: [])
    without = _run(unet_prog, "1%", strict=False, remat_products=False).metrics
    assert without["granularity"] != "block+glue"
    assert m["estimated_activations"] < without["estimated_activations"], (m, without)


@pytest.mark.parametrize("name", ["unet", "gpt"])
def test_saved_bytes_sees_what_an_fxmem_module_keeps(name, unet_prog, gpt_prog):
    """fxmem.measure.saved_bytes (saved-tensor hooks) on a transformed eager module counts what its recipes,
    regions, selective caches and dropout tapes keep: the measured activations less what the measurement counts
    beyond the hooks on the captured program (the loss's tensors), exactly. Before, the module's own hooks (the
    innermost) hid every save from the counting hook: 0 bytes."""
    from fxmem.measure import saved_tensors

    class Out(torch.nn.Module):  # keeps the module's output, to tell a save of it apart
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *a):
            self.out = self.m(*a)
            return self.out

    def saved_bytes(mod, x):
        # a save of the output itself (a selective region caching the head's mm output, the logits) is not beyond
        # what the measurement counts: it holds the output, which is live at the end of forward anyway
        w = Out(mod)
        ts = saved_tensors(w, x)
        out = w.out.untyped_storage().data_ptr()
        return sum(t.untyped_storage().nbytes() for t in ts if t.untyped_storage().data_ptr() != out)
    prog = unet_prog if name == "unet" else gpt_prog
    p, x, loss_fn, base = prog
    cap = p.snapshot().module
    beyond = fxmem.measure(copy.deepcopy(cap), x, loss_fn=loss_fn).activations - saved_bytes(copy.deepcopy(cap), x)
    kinds = set()
    # (with and without convolutions and linears as remat sites: with them, remat alone takes the U-Net's budgets)
    for act, products in itertools.product(("70%", "40%", "15%"), (True, False)):
        res = _run(prog, act, strict=False, remat_products=products)
        mod = res.program.module
        kinds |= set(res.metrics.get("plan", {}).values()) | ({"remat"} if res.metrics.get("remat") else set())
        torch.manual_seed(0)
        measured = fxmem.measure(copy.deepcopy(mod), x, loss_fn=loss_fn).activations
        torch.manual_seed(0)
        assert saved_bytes(copy.deepcopy(mod), x) == measured - beyond, (act, res.metrics.get("plan"))
    assert {"remat", "full"} <= kinds
