"""Checkpoint pass, compact dropout: CPU dropout masks drawn as bool (bit-identical outputs and gradients, a quarter
of the bytes saved for backward), kept by recompute regions instead of drawn again."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.costmodel import estimate
from fxmem.nn.dropout import bool_mask_dropout, scale_number
from fxmem.pipeline import PassContext

from tests.conftest import OpCounter

from .test_checkpoint import _assert_same_step, _baseline, _gpt, _run_pass, _train_step, ck


def _draws(counter: OpCounter) -> int:
    """Random draws (bernoulli, in place or not, or the packed draw) the counter saw."""
    return sum(n for op, n in counter.ops.items() if op.startswith(("bernoulli", "packed_bernoulli")))


def _exact_and_draws_in_backward(ref, mod, x, loss_fn) -> int:
    """Asserts `mod` gives `ref`'s outputs and gradients bit for bit (same seed); returns how many random draws
    its backward made (recomputation)."""
    o1, g1 = _train_step(copy.deepcopy(ref), x, loss_fn)
    o2, g2 = _train_step(copy.deepcopy(mod), x, loss_fn)
    assert torch.equal(o1, o2) and set(g1) == set(g2) and all(torch.equal(g1[k], g2[k]) for k in g1)
    mod.train()
    torch.manual_seed(3)
    loss = loss_fn(mod(*x), x)
    counter = OpCounter()
    with counter:
        loss.backward()
    return _draws(counter)


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_bool_mask_dropout_bit_identical(dtype, p, contiguous):
    x = torch.randn(4, 3, 17, 9, dtype=dtype).transpose(1, 2)  # strided: the mask is drawn in memory order
    if contiguous:
        x = x.contiguous()
    g = torch.randn(4, 17, 3, 9, dtype=dtype)
    a = x.clone().requires_grad_()
    torch.manual_seed(11)
    ya = torch.ops.aten.dropout(a, p, True)
    ya.backward(g)
    b = x.clone().requires_grad_()
    torch.manual_seed(11)
    yb = bool_mask_dropout(b, p, True)
    yb.backward(g)
    assert torch.equal(ya, yb)
    assert torch.equal(a.grad, b.grad)
    # the random stream advanced by the same amount
    torch.manual_seed(11)
    torch.ops.aten.dropout(x, p, True)
    after_a = torch.rand(4)
    torch.manual_seed(11)
    bool_mask_dropout(x, p, True)
    assert torch.equal(after_a, torch.rand(4))


def test_bool_mask_dropout_draws_a_bool_mask_for_any_dense_layout():
    """A transposed or permuted input (dense, not contiguous) draws its bool mask in its memory order, as
    aten.dropout fills its float mask: the same values; only an input with gaps runs the original dropout."""
    for x in (torch.randn(4, 16, 8).transpose(1, 2), torch.randn(2, 3, 8, 8).permute(0, 2, 3, 1),
              torch.randn(2, 1, 5, 7).permute(3, 1, 0, 2)):
        torch.manual_seed(5)
        ref = torch.ops.aten.dropout(x, 0.3, True)
        counter = OpCounter()
        torch.manual_seed(5)
        with counter:
            out = bool_mask_dropout(x, 0.3, True)
        assert torch.equal(ref, out) and "packed_bernoulli" in counter.ops and "bernoulli_" not in counter.ops
    gapped = torch.randn(8, 8)[:, ::2]
    counter = OpCounter()
    with counter:
        bool_mask_dropout(gapped, 0.3, True)
    assert "bernoulli_" in counter.ops  # aten.dropout's float mask


class _NormOnTokens(torch.nn.Module):
    """linear -> batch norm over channels of a (B, T, C) sequence (through transposes) -> dropout -> head."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16)
        self.drop, self.head = torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.drop(self.norm(self.fc(x).transpose(1, 2)).transpose(1, 2)))


def test_compact_dropout_after_a_transposed_batch_norm_is_what_the_estimate_plans():
    """The CPU batch norm returns its output in its input's layout (transposed back: not contiguous) where the fake
    trace's is contiguous: bool_mask_dropout, deciding on contiguity, drew a bool mask in the cost model's trace
    and ran aten.dropout's float mask for real (the estimate 1536 bytes, 3.7% of a random model's step, low)."""
    torch.manual_seed(0)
    model, x = _NormOnTokens(), (torch.randn(2, 32, 12),)
    p = fxmem.capture(copy.deepcopy(model), x)
    p.refresh()
    assert ck.compact_dropout(p)
    p.refresh()
    est = estimate(p, mode="train")
    meas = fxmem.measure(copy.deepcopy(p.module), x)
    assert est.peak == meas.peak and est.activations == meas.activations, (est.peak, meas.peak)
    _assert_same_step(copy.deepcopy(model), copy.deepcopy(p.module), x, lambda out, inputs: out.mean())


def test_bool_mask_dropout_eval_and_edges():
    x = torch.randn(5, 6)
    assert bool_mask_dropout(x, 0.3, False) is x
    assert bool_mask_dropout(x, 0.0, True) is x
    assert torch.equal(bool_mask_dropout(x, 1.0, True), torch.ops.aten.dropout(x, 1.0, True))
    assert scale_number(x.dtype, 0.1) == float(torch.ones(()).div_(0.9))
    assert scale_number(torch.float64, 0.1) == 1 / 0.9


def test_bool_mask_dropout_saves_a_packed_mask():
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    x = torch.randn(64, 64, requires_grad=True)
    scale = float(torch.ones(()).div_(0.8))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        bool_mask_dropout(x, 0.2, True, scale, torch.float32)  # as the pass writes it: the scale a literal
    assert saved == [(torch.uint8, 64 * 64 // 8)]  # the bool mask packed, a bit per element
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        bool_mask_dropout(x.double(), 0.2, True, scale, torch.float32)  # another dtype: its own scale, a number
    assert saved == [(torch.uint8, 64 * 64 // 8)]


def test_draw_tape_replays_the_forward_masks():
    from fxmem.nn.dropout import DrawTape

    def body(x):
        return bool_mask_dropout(bool_mask_dropout(x, 0.3, True) * 2, 0.5, True)

    x = torch.randn(32, 32)
    tape = DrawTape(body)
    torch.manual_seed(1)
    first = tape(x)
    state = torch.get_rng_state()
    counter = OpCounter()
    with counter:
        again = tape(x)  # the recomputation: no draw, the same masks, the generator untouched
    assert _draws(counter) == 0 and torch.equal(first, again) and torch.equal(state, torch.get_rng_state())
    assert [(m.dtype, m.numel()) for m in tape.masks] == [(torch.uint8, 32 * 32 // 8)] * 2  # packed
    torch.manual_seed(1)
    assert torch.equal(first, body(x))  # and the same as drawing without a tape


@pytest.fixture(scope="module")
def small_gpt():
    return _gpt()


def test_pass_compacts_dropout_exactly_and_keeps_draws(small_gpt):
    p, x, loss_fn = small_gpt
    base = _baseline(p, loss_fn)
    res, _ = _run_pass(p, loss_fn, "60%", remat_scores=False)  # (regions: softmax sites reach 60% alone)
    kinds = [c.kind for c in res.changes]
    n_dropout = sum(1 for n in p.graph.nodes if n.target is torch.ops.aten.dropout.default)
    assert kinds.count("checkpoint_compact_dropout") == n_dropout > 0
    assert any(k in ("checkpoint_full", "checkpoint_selective") for k in kinds)
    q = res.program
    code = q.module.code
    assert "bool_mask_dropout(" in code and "aten.dropout" not in code
    # every region with a draw keeps it (a DrawTape), `full` ones without the selective-checkpoint dispatch mode
    regions = [m for n, m in q.module.named_children() if n.startswith("ckpt_")]
    assert regions and all("packed_bernoulli" in r.keep_ops and "packed_bernoulli" not in r.sac_ops for r in regions)
    # bit-identical to the captured model (same seed), outputs and gradients; recomputation draws nothing
    mod = copy.deepcopy(q.module)
    assert _exact_and_draws_in_backward(p.module, mod, x, loss_fn) == 0
    # .eval() still switches dropout off
    mod.eval()
    ref = copy.deepcopy(p.module).eval()
    with torch.no_grad():
        assert torch.equal(mod(*x), ref(*x))
    # the estimate knows the bool masks, and matches the measured step
    est = estimate(q, mode="train", loss_fn=loss_fn)
    meas = fxmem.measure(copy.deepcopy(q.module), x, loss_fn=loss_fn)
    assert est.peak < base.peak
    assert abs(est.peak - meas.peak) <= 0.05 * meas.peak  # the bound test_checkpoint_examples holds every example to
    assert res.metrics["compact_dropout"]["activations_saved"] > 0


def test_compact_alone_keeps_a_bit_of_each_mask_element(small_gpt):
    p, x, loss_fn = small_gpt
    q = p.snapshot()
    changes = ck.compact_dropout(q)
    q.refresh()
    masks = sum(c.details["elements"] for c in changes)
    a = fxmem.measure(copy.deepcopy(p.module), x, loss_fn=loss_fn)
    b = fxmem.measure(copy.deepcopy(q.module), x, loss_fn=loss_fn)
    # fp32 mask -> packed bool mask, every site (each mask's elements a multiple of 8 here)
    assert a.activations - b.activations == 4 * masks - masks // 8
    assert sum(c.bytes_saved for c in changes) == 4 * masks - masks // 8
    _assert_same_step(p.module, q.module, x, loss_fn)


def test_compact_dropout_option_off_and_budget_fits(small_gpt):
    p, x, loss_fn = small_gpt
    res, _ = _run_pass(p, loss_fn, "60%", compact_dropout=False)
    assert not any(c.kind == "checkpoint_compact_dropout" for c in res.changes)
    assert "aten.dropout" in res.program.module.code
    res, _ = _run_pass(p, loss_fn, "100%")
    assert not res.modified  # nothing to do: no surgery at all


def test_region_with_other_draws_recomputes_all_of_them():
    """A region with a draw it cannot keep (randn) keeps none: recomputation replays every draw in order."""

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 32)
            self.b = torch.nn.Linear(32, 32)
            self.drop = torch.nn.Dropout(0.2)

        def forward(self, x):
            h = self.drop(torch.relu(self.a(x)))
            h = h + 0.01 * torch.randn_like(h)
            return self.b(h)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.Sequential(*[Noisy() for _ in range(3)])
            self.head = torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.blocks(x))

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(64, 32)
    p = fxmem.capture(model, (x,))
    p.refresh()

    def loss_fn(out, args):
        return out.square().mean()

    base = estimate(p, mode="train", loss_fn=loss_fn)
    ctx = PassContext(policy=None, options=ck.CheckpointOptions(), mode="train", optimizer="adamw",
                      budget=int(base.peak - 0.6 * base.activations), baseline=base,
                      enabled=("checkpoint", "offload"), loss_fn=loss_fn)
    res = ck.CheckpointPass().run(p.snapshot(), ctx)
    q = res.program
    regions = [m for n, m in q.module.named_children() if n.startswith("ckpt_")]
    assert regions
    for r in regions:
        has_randn = "randn" in r.body.code
        assert not (has_randn and "packed_bernoulli" in r.keep_ops), r.body.code
    o1, g1 = _train_step(copy.deepcopy(p.module), (x,), loss_fn)
    o2, g2 = _train_step(copy.deepcopy(q.module), (x,), loss_fn)
    assert torch.equal(o1, o2)
    assert all(torch.equal(g1[k], g2[k]) for k in g1)


def test_region_with_kept_draws_under_torch_compile():
    """Users stack torch.compile on the result: a full region keeping its bool draws traces in one graph and
    gives what eager gives (values: compiled RNG may differ, so dropout off via p only in the comparison)."""
    from fxmem.nn.checkpoint import CheckpointRegion

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 8)

        def forward(self, x, train: bool):
            return self.b(bool_mask_dropout(torch.relu(self.a(x)), 0.25, train, 4 / 3, torch.float32))

    torch.manual_seed(0)
    body = Body()
    reg = CheckpointRegion(body, frozenset({"bernoulli"})).train()
    x = torch.randn(4, 8, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(reg, backend="aot_eager", fullgraph=True)
    out = compiled(x, True)
    out.sum().backward()
    assert out.shape == (4, 8) and x.grad is not None and torch.isfinite(x.grad).all()
    # eval-mode flag: no dropout, equal to the plain body
    x.grad = None
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, False), body(x, False))


def _forced(choice: str):
    """A planner that recomputes every region that may with `choice` and keeps the others."""
    def solve(model, budget, solver, time_limit, chain, tiebreak=True):
        plan = [choice if choice in allowed else "keep" for allowed in model.choices]
        return ck.Solution(plan, model.cost(plan), model.peak(plan), "forced", True)
    return solve


def test_redraw_plan_draws_masks_again_exactly(small_gpt, monkeypatch):
    """Regions that draw their masks again (`redraw`; forced here: with masks packed, a bit per element, this
    model's lowest peak no longer needs it) recompute them from the restored RNG state, bit-identical, and keep
    less through the forward than the same regions keeping their masks, as estimated."""
    p, x, loss_fn = small_gpt
    monkeypatch.setattr(ck, "solve", _forced("redraw"))
    low, _ = _run_pass(p, loss_fn, 1, enabled=("checkpoint", "offload"))  # unreachable: regions planned
    assert "redraw" in low.metrics["plan"].values(), low.metrics["plan"]
    q = low.program
    regions = {n: m for n, m in q.module.named_children() if n.startswith("ckpt_")}
    redraw = [m for m in regions.values() if not m.keep_ops]
    assert redraw and all("packed_bernoulli" not in m.keep_ops for m in redraw)
    assert _exact_and_draws_in_backward(p.module, copy.deepcopy(q.module), x, loss_fn) > 0  # drawn again
    monkeypatch.setattr(ck, "solve", _forced("full"))
    kept, _ = _run_pass(p, loss_fn, 1, enabled=("checkpoint", "offload"))
    assert "full" in kept.metrics["plan"].values()
    m_low = fxmem.measure(copy.deepcopy(q.module), x, loss_fn=loss_fn)
    m_kept = fxmem.measure(copy.deepcopy(kept.program.module), x, loss_fn=loss_fn)
    e_low = estimate(q, mode="train", loss_fn=loss_fn)
    assert m_low.activations < m_kept.activations and e_low.peak == m_low.peak
