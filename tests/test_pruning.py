"""Structural pruning: dependency groups from the FX graph, physical slicing, the calibration guard."""
from __future__ import annotations


import pytest
import torch
from torch import nn
import torch.nn.functional as F

import fxmem
from fxmem.compare import deviation
from fxmem.depgroups import find_groups
from fxmem.errors import PolicyError
from fxmem.lossguard import Evaluator
from fxmem.pipeline import PassContext, load_passes
from tests.conftest import example, example_module, trained_digits_state

load_passes()
from fxmem.passes.pruning import PruningOptions, PruningPass, _fix_dims, _Masked  # noqa: E402


# --------------------------------------------------------------------------------------------- toy models
class SwiGLU(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.gate, self.up, self.down = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.inp(x)
        x = x + self.down(F.silu(self.gate(x)) * self.up(x))
        return self.head(x)


class ResMLP(nn.Module):
    def __init__(self, d=16, h=48):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.norm(self.inp(x))
        x = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(x)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(1, 12, 3, padding=1), nn.BatchNorm2d(12), nn.Conv2d(12, 2, 3, padding=1)

    def forward(self, x):
        return self.c2(F.max_pool2d(F.relu(self.bn(self.c1(x))), 2))


def trained_digits():
    model = example_module("mlp_digits").build_model(hidden=64)
    model.load_state_dict(trained_digits_state(64))
    return model


def _cap(model, args, kwargs=None, mode="inference"):
    p = fxmem.capture(model, args, kwargs or {}, mode=mode)
    p.refresh()
    return p


def _by_name(groups):
    return {g.name: g for g in groups}


# --------------------------------------------------------------------------------------------- groups
def test_group_swiglu_joins_gate_and_up():
    p = _cap(SwiGLU(), (torch.randn(5, 8),))
    g = _by_name(find_groups(p.module))
    sw = g["gate"]
    assert sw.ok and sw.kind == "swiglu" and sw.size == 32
    assert sorted(x.weight for x in sw.producers) == ["gate.weight", "up.weight"]
    assert [c.weight for c in sw.consumers] == ["down.weight"]
    assert "up" not in g  # joined, listed once
    # the residual stream x = inp(x) + down(...) has no norm in between: its width is one consistent group
    # (both producers' rows, every consumer's columns), as DepGraph prunes residual dims
    res = g["inp"]
    assert res.ok and res.kind == "residual" and "down" not in g
    assert sorted(x.weight for x in res.producers) == ["down.weight", "inp.weight"]
    assert sorted(c.weight for c in res.consumers) == ["gate.weight", "head.weight", "up.weight"]


def test_group_residual_mlp_and_conv_bn():
    g = _by_name(find_groups(_cap(ResMLP(), (torch.randn(4, 8),)).module))
    assert g["fc1"].ok and g["fc1"].kind == "mlp" and g["fc1"].consumers[0].weight == "fc2.weight"
    assert not g["fc2"].ok and "add" in g["fc2"].reason and "layer_norm" in g["fc2"].reason  # residual stream
    assert not g["inp"].ok and "layer_norm" in g["inp"].reason
    cb = _by_name(find_groups(_cap(ConvBN(), (torch.randn(2, 1, 8, 8),), mode="train").module))["c1"]
    assert cb.ok and cb.kind == "conv" and cb.size == 12
    assert sorted(t for t, _ in cb.params) == ["bn.bias", "bn.running_mean", "bn.running_var", "bn.weight"]


def test_group_gnn_layer_chain_and_rejections():
    model, args, kwargs, _ = example("gcn")
    g = _by_name(find_groups(_cap(model, args, kwargs).module))
    c0 = g["convs.0.lin"]
    assert c0.ok and c0.kind == "gnn" and c0.consumers[0].weight == "convs.1.lin.weight"
    assert ("convs.0.bias", 0) in c0.params and len(c0.literals) == 1  # the scatter accumulator's [N, C]
    assert not g["convs.2.lin"].ok and "output" in g["convs.2.lin"].reason
    model, args, kwargs, _ = example("gpt", n_layer=1, d_model=32, n_head=2)
    g = _by_name(find_groups(_cap(model, args, kwargs).module))
    assert g["h.0.mlp.c_fc"].ok
    assert not g["h.0.attn.c_attn"].ok and "split" in g["h.0.attn.c_attn"].reason  # heads: left alone


# --------------------------------------------------------------------------------------------- the pass
def _ctx(opts, calibration, evaluate=None, mode="inference"):
    return PassContext(policy=None, options=opts, mode=mode, optimizer="none", budget=None, baseline=None,
                       enabled=("pruning",), calibration=calibration, evaluate=evaluate)


def _run(p, opts, calibration, evaluate=None):
    r = PruningPass().run(p.snapshot(), _ctx(opts, calibration, evaluate, p.mode))
    if r.modified:
        r.program.refresh()  # lint + shapes at the example inputs
    return r


def _params(gm):
    return {n: t for n, t in list(gm.named_parameters()) + list(gm.named_buffers())}


def test_sliced_graph_equals_masked_simulation():
    """Slicing computes exactly what the guard simulates (pruned inputs replaced by their mean)."""
    mod = example_module("mlp_digits")
    model, args, kwargs, _ = example("mlp_digits", hidden=64)
    p = _cap(model, args, kwargs)
    cal = mod.calibration_data(n_batches=4)
    # skip net.4: the net.2 group (net.2 rows, net.4 columns) stays, so net.2's kept columns are original columns
    opts = PruningOptions(fraction=0.5, min_keep=2, metric_tolerance=None, tolerance=10.0, skip=["net.4"])
    r = _run(p, opts, cal)
    assert [c.module for c in r.changes] == ["net.0"]
    from fxmem.calibrate import calibrate
    stats = calibrate(p, cal[:3], max_batches=None, eps=opts.eps, progress=False)
    masks = {}
    sliced = _params(r.program.module)
    for ch in r.changes:
        g = next(g for g in find_groups(p.module) if g.name == ch.module)
        c = g.consumers[0]
        kept_cols = sliced[c.weight]
        orig = _params(p.module)[c.weight]
        # the kept units are the columns of the original consumer weight that survive
        keep = [j for j in range(orig.shape[1]) if any(torch.equal(orig[:, j], kept_cols[:, i])
                                                      for i in range(kept_cols.shape[1]))]
        assert len(keep) == ch.details["units_after"]
        pruned = torch.tensor(sorted(set(range(orig.shape[1])) - set(keep)))
        masks[c.probe] = (1, pruned, stats.by_node[c.probe].mean[pruned])
    for (x,) in cal[3:]:
        with torch.no_grad():
            sim = _Masked(p.module.eval(), _fix_dims(p.module, masks)).run(x, enable_io_processing=False)[0]
            got = r.program.module.eval()(x)
        torch.testing.assert_close(got, sim, atol=1e-5, rtol=1e-5)


def test_fraction_zero_changes_nothing_and_guard_backs_off():
    mod = example_module("mlp_digits")
    model, args, kwargs, _ = example("mlp_digits", hidden=64)
    p = _cap(model, args, kwargs)
    cal = mod.calibration_data(n_batches=4)
    r0 = _run(p, PruningOptions(fraction=0.0), cal)
    assert not r0.modified and "nothing to prune" in r0.notes[0]
    # a strict tolerance forces back-off; the result respects it on the held-out item
    r = _run(p, PruningOptions(fraction=0.6, min_keep=2, tolerance=0.02, metric_tolerance=None), cal)
    assert r.metrics["backoff"], "expected the guard to back off"
    if r.modified:
        assert r.metrics["guard_deviation"] <= 0.02 + 1e-6
        x = cal[-1][0]
        with torch.no_grad():
            assert deviation(p.module.eval()(x), r.program.module.eval()(x)).rel <= 0.02 + 1e-6


def test_threshold_skip_and_min_keep():
    mod = example_module("mlp_digits")
    p = _cap(trained_digits(), example_module("mlp_digits").example_inputs())
    cal = mod.calibration_data(n_batches=4)
    r = _run(p, PruningOptions(threshold=0.05, min_keep=0.5, tolerance=10.0, metric_tolerance=None, eps=0.0), cal)
    assert r.modified
    for ch in r.changes:
        assert ch.details["units_after"] >= 32  # min_keep as a share
    # a skipped module is never touched: both groups that slice net.2 (as consumer, as producer) are skipped
    r = _run(p, PruningOptions(fraction=0.5, skip=["net.2"], tolerance=10.0, metric_tolerance=None), cal)
    assert not r.modified
    rows = {g["group"]: g for g in r.metrics["groups"]}
    assert "skip" in rows["net.0"]["reason"] and "skip" in rows["net.2"]["reason"]
    r = _run(p, PruningOptions(fraction=0.5, skip=["net.4"], tolerance=10.0, metric_tolerance=None), cal)
    assert [c.module for c in r.changes] == ["net.0"]


def test_task_metric_guard_on_trained_digits():
    """With an evaluate function: the held-out accuracy drop stays within metric_tolerance, and it alone decides."""
    mod = example_module("mlp_digits")
    p = _cap(trained_digits(), mod.example_inputs())
    r = _run(p, PruningOptions(fraction=0.3, metric_tolerance=0.005), mod.calibration_data(n_batches=8),
             Evaluator(mod.evaluate, "max"))
    assert r.modified
    m = r.metrics["metric"]
    assert m["drop"] <= 0.005 and m["tolerance"] == 0.005
    assert list(r.verdicts[0].limits) == ["metric_drop"]
    assert abs(mod.evaluate(r.program.module) - m["after"]) < 1e-9
    assert r.metrics["params_removed_share"] >= 0.15


def test_no_calibration_and_bad_options():
    model, args, kwargs, _ = example("mlp_digits", hidden=32)
    p = _cap(model, args, kwargs)
    r = PruningPass().run(p.snapshot(), _ctx(PruningOptions(), None))
    assert not r.modified and "no calibration data" in r.notes[0]
    r = _run(p, PruningOptions(require_calibration=False, fraction=0.25, min_keep=2, tolerance=10.0,
                               metric_tolerance=None), None)
    assert r.modified and any("example inputs" in n for n in r.notes)
    for bad, field in ((dict(fraction=1.5), "fraction"), (dict(backoff=1.0), "backoff"),
                       (dict(heads=True), "heads"), (dict(threshold=2.0), "threshold")):
        with pytest.raises(PolicyError, match=f"passes.pruning.{field}"):
            PruningPass().run(p.snapshot(), _ctx(PruningOptions(**bad), [args]))


def test_through_transform_with_report():
    mod = example_module("mlp_digits")
    model = trained_digits()
    res = fxmem.transform(model, mod.example_inputs(), policy="inference", calibration=mod.calibration_data(),
                          model_file=mod, passes__precision__enabled=False, passes__attention__enabled=False)
    rec = {r.name: r for r in res.records}["pruning"]
    assert rec.status == "applied", (rec.reason, rec.notes)
    assert rec.metrics["histograms"]["net.2"] and len(rec.metrics["histograms"]["bin_edges"]) == 11
    md = res.report.to_markdown()
    assert "prune" in md and "histograms" in md
    assert res.module.get_submodule("net.0").weight.shape[0] < 64
