"""Gating insertion: exact at insertion, forced-open exactness, hard skips that really skip, the sparsity loss."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxmem
from fxmem.errors import FxmemError, PolicyError
from fxmem.nn.gating import gates, gating_loss, reset_skip_stats, skip_stats
from fxmem.pipeline import PassContext, load_passes, run_reference
from tests.conftest import OpCounter, example, example_module

load_passes()
from fxmem.passes.gating import GatingOptions, GatingPass, find_branches  # noqa: E402

aten = torch.ops.aten


class ResMLP(nn.Module):
    """x -> inp -> [x + fc2(relu(fc1(x)))] x2 -> head: two residual MLP branches."""

    def __init__(self, d=16, h=32, n=2):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d)) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for m in self.mlps:
            x = x + m(x)
        return self.head(x)



def _ctx(opts=None, mode="inference", calibration=None):
    return PassContext(policy=None, options=opts or GatingOptions(), mode=mode, optimizer="adamw", budget=None,
                       baseline=None, enabled=("gating",), calibration=calibration)


def _gate(model, args, kwargs=None, mode="inference", opts=None, calibration=None):
    p = fxmem.capture(model, args, kwargs or {}, mode=mode)
    p.refresh()
    r = GatingPass().run(p.snapshot(), _ctx(opts, mode, calibration))
    if r.modified:
        r.program.refresh()
    return p, r


# ---------------------------------------------------------------------------------------------- insertion
@pytest.mark.parametrize("name,build,n_gates", [
    ("gpt", dict(n_layer=2, d_model=32, n_head=2), 4),
    ("gnn_stan", dict(), 2),
])
def test_insertion_is_exact_outputs_and_gradients(name, build, n_gates):
    model, args, kwargs, loss_fn = example(name, **build)
    p, r = _gate(model, args, kwargs, mode="train")
    assert r.modified and len(r.changes) == n_gates
    ref = run_reference(p, "train", loss_fn)
    got = run_reference(r.program, "train", loss_fn)
    for a, b in zip(torch.utils._pytree.tree_leaves(ref.outputs), torch.utils._pytree.tree_leaves(got.outputs)):
        assert torch.equal(a, b)
    assert ref.grads.keys() <= got.grads.keys()
    for k in ref.grads:
        assert torch.equal(ref.grads[k], got.grads[k]), k
    assert len(gates(r.program.module)) == n_gates
    # gate parameters are new and trainable; state_dict names of the model are unchanged
    sd = r.program.module.state_dict()
    assert set(p.module.state_dict()) <= set(sd)


def test_targets_glob_and_auto_labels():
    model, args, kwargs, _ = example("gpt", n_layer=2, d_model=32, n_head=2)
    p = fxmem.capture(model, args, kwargs, mode="inference")
    p.refresh()
    assert [b.label for b in find_branches(p.module)] == ["h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp"]
    _, r = _gate(model, args, kwargs, opts=GatingOptions(targets=["h.*.mlp"]))
    assert [c.module for c in r.changes] == ["h.0.mlp", "h.1.mlp"]
    assert all(c.details["per_sample"] for c in r.changes)
    _, r = _gate(model, args, kwargs, opts=GatingOptions(targets=["nothing.*"]))
    assert not r.modified and "no residual branch matches" in r.notes[0]


def test_bad_options_name_the_field():
    model, args, kwargs, _ = example("gpt", n_layer=1, d_model=32, n_head=2)
    p = fxmem.capture(model, args, kwargs, mode="inference")
    p.refresh()
    for bad, field in ((dict(threshold=0.0), "threshold"), (dict(init_bias=-1.0), "init_bias"),
                       (dict(targets=[]), "targets"), (dict(reduction=0), "reduction")):
        with pytest.raises(PolicyError, match=f"passes.gating.{field}"):
            GatingPass().run(p.snapshot(), _ctx(GatingOptions(**bad)))


# ---------------------------------------------------------------------------------------------- forced open
def _randomize_gates(gm, seed=0, bias=-0.5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in gates(gm).values():
            for lin in (m.gate[0], m.gate[2]):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
            m.gate[2].bias.fill_(bias)


def test_forced_open_gates_reproduce_the_original_exactly():
    model, args, kwargs, _ = example("gpt", n_layer=2, d_model=32, n_head=2)
    p, r = _gate(model, args, kwargs)
    gm = r.program.module.eval()
    _randomize_gates(gm)  # "trained" gates: the gated model now differs from the original
    (x,) = example_module("gpt").calibration_data(n_batches=1)[0]
    with torch.no_grad():
        ref = p.module.eval()(x)
        soft = gm(x)
        assert not torch.equal(ref, soft)
        for m in gates(gm).values():
            m.force_open = True
        assert torch.equal(gm(x), ref)


# ---------------------------------------------------------------------------------------------- hard skip
def _resmlp_gated(per_sample=True):
    torch.manual_seed(0)
    model = ResMLP()
    p, r = _gate(model, (torch.randn(6, 8),), opts=GatingOptions(targets=["mlps.*"], per_sample=per_sample))
    assert [c.module for c in r.changes] == ["mlps.0", "mlps.1"]
    return model, p, r.program.module.eval()


def _close_rows_where_feature0_positive(gm, which: str):
    """Gate of `which`: u = -10 * relu(x[:, 0]) -> rows with x0 > 0.12 are closed (2*sigmoid(u) < 0.5)."""
    m = next(m for m in gates(gm).values() if m.label == which)
    with torch.no_grad():
        m.gate[0].weight.zero_()
        m.gate[0].bias.zero_()
        m.gate[0].weight[0, 0] = 1.0
        m.gate[2].weight.zero_()
        m.gate[2].weight[0, 0] = -10.0
        m.gate[2].bias.zero_()
    return m


def test_hard_skip_per_batch_runs_no_branch_ops():
    model, p, gm = _resmlp_gated()
    x = torch.randn(6, 8)
    with torch.no_grad(), OpCounter() as open_count:
        gm(x)
    m = next(m for m in gates(gm).values() if m.label == "mlps.1")
    with torch.no_grad():
        m.gate[2].bias.fill_(-10.0)  # every row closed
    reset_skip_stats(gm)
    with torch.no_grad(), OpCounter() as closed:
        y = gm(x)
    # the branch's two linears (and its relu) did not run; the gate's own small linears did
    assert closed.matmuls() == open_count.matmuls() - 2
    assert closed.ops.get("relu", 0) == open_count.ops.get("relu", 0) - 1
    st = skip_stats(gm)["mlps.1"]
    assert st["calls_skipped"] == 1 and st["rows_skipped"] == 6 and st["skip_rate"] == 1.0
    # what it computed: the branch contributes nothing
    with torch.no_grad():
        h = model.inp(x)
        g0 = gates(gm)["gate_mlps_0"]
        h = h + torch.clamp(g0.raw_gate(h), max=1).unsqueeze(-1) * model.mlps[0](h)
        torch.testing.assert_close(y, model.head(h), rtol=0, atol=1e-6)


@pytest.mark.parametrize("per_sample", [True, False])
def test_hard_skip_per_sample_computes_only_open_rows(per_sample):
    model, p, gm = _resmlp_gated(per_sample=per_sample)
    m = _close_rows_where_feature0_positive(gm, "mlps.0")
    x = torch.randn(8, 8)
    with torch.no_grad():
        h = model.inp(x)
    open_rows = (h[:, 0] <= 0.0).nonzero().squeeze(1)
    n_open = int(open_rows.numel())
    assert 0 < n_open < 8, "the test input should mix open and closed rows"
    reset_skip_stats(gm)
    with torch.no_grad(), OpCounter() as cnt:
        y = gm(x)
    # mm order: inp, [gate mlps.0 (2)], branch mlps.0 (2), gate mlps.1 (2), branch mlps.1 (2), head
    rows = cnt.mm_rows
    assert rows[0] == 8 and rows[1] == rows[2] == 8  # inp, gate of mlps.0 on all rows
    assert rows[3] == rows[4] == (n_open if per_sample else 8)
    st = skip_stats(gm)["mlps.0"]
    assert st["rows"] == 8 and st["rows_skipped"] == (8 - n_open if per_sample else 0)
    # numerics: open rows x + g*f(x), closed rows x
    with torch.no_grad():
        g = torch.clamp(m.raw_gate(h), max=1)
        open_ = g >= 0.5
        h1 = torch.where(open_.unsqueeze(-1), h + g.unsqueeze(-1) * model.mlps[0](h), h)
        g1 = gates(gm)["gate_mlps_1"]
        h2 = h1 + torch.clamp(g1.raw_gate(h1), max=1).unsqueeze(-1) * model.mlps[1](h1)
        torch.testing.assert_close(y, model.head(h2), rtol=1e-5, atol=1e-6)


def test_per_sample_on_a_transformer_branch_with_outside_mask():
    """GPT attention reads the causal mask and the sequence length from outside: the pass re-reads sizes from x
    and treats the (1, 1, T, T) mask as row-independent, so per-sample skipping works there too."""
    model, args, kwargs, _ = example("gpt", n_layer=1, d_model=32, n_head=2)
    p, r = _gate(model, args, kwargs)
    ch = {c.module: c for c in r.changes}
    assert ch["h.0.attn"].details["per_sample"] and ch["h.0.mlp"].details["per_sample"]
    gm = r.program.module.eval()
    m = next(m for m in gates(gm).values() if m.label == "h.0.attn")
    (x,) = example_module("gpt").calibration_data(n_batches=1, batch=4)[0]
    with torch.no_grad():
        ref_rows = p.module.eval()(x)
        m.gate[2].bias.fill_(-10.0)
        out_closed = gm(x)
        m.gate[2].bias.fill_(0.0)
        assert torch.equal(gm(x), ref_rows)  # open again: exactly the original
    assert out_closed.shape == ref_rows.shape and not torch.equal(out_closed, ref_rows)


# ---------------------------------------------------------------------------------------------- training
def test_gating_loss_trains_gates_towards_closing():
    model, p, gm = _resmlp_gated()
    gm.train()
    with pytest.raises(FxmemError, match="no gate has run"):
        gating_loss(gm)
    x = torch.randn(32, 8)
    opt = torch.optim.SGD([q for n, q in gm.named_parameters() if ".gate." in n], lr=1.0)
    first = None
    for _ in range(5):
        gm(x)
        loss = gating_loss(gm)
        first = float(loss) if first is None else first
        opt.zero_grad()
        loss.backward()
        assert all(m.gate[2].bias.grad is not None and m.gate[2].bias.grad.abs().item() > 0
                   for m in gates(gm).values())
        opt.step()
    gm(x)
    assert float(gating_loss(gm)) < first <= 1.0 + 1e-6
    with pytest.raises(FxmemError, match="no GatedResidual"):
        gating_loss(model)


def test_gated_program_estimates_and_runs_in_the_pass_manager():
    mod = example_module("gpt")
    model = mod.build_model(n_layer=2, d_model=32, n_head=2)
    res = fxmem.transform(model, mod.example_inputs(), policy="low", loss_fn=mod.loss_fn,
                          calibration=mod.calibration_data(n_batches=2), passes__gating__enabled=True,
                          passes__checkpoint__enabled=False, passes__attention__enabled=False)
    rec = {r.name: r for r in res.records}["gating"]
    assert rec.status == "applied" and rec.exact, rec.reason
    assert rec.grad_deviation and rec.grad_deviation["ok"]
    assert rec.metrics["gates"] == 4
    assert all(v == 0.0 for v in rec.metrics["skip_rate_calibration"].values())  # open at insertion
    est = fxmem.estimate(res.program, mode="train")
    assert est.peak > 0
    # the result is a normal trainable module
    out = res.module.train()(*mod.example_inputs())
    (mod.loss_fn(out, mod.example_inputs()) + 0.01 * fxmem.nn.gating.gating_loss(res.module)).backward()


def test_gated_module_deepcopies_after_a_training_forward():
    """fxmem.measure and users deep-copy modules: the last gate values (non-leaf tensors) are not copied."""
    import copy
    _, _, gm = _resmlp_gated()
    gm.train()
    x = torch.randn(4, 8)
    gm(x)
    twin = copy.deepcopy(gm)
    assert all(m._last_raw is None for m in gates(twin).values())
    twin.eval(), gm.eval()
    with torch.no_grad():
        assert torch.equal(twin(x), gm(x))
