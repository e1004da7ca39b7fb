"""The static estimate: a liveness walk over the forward trace, then backward, then the optimizer step.

The forward walk (`forward_walk`) adds each op's new storages and frees a value when the traced code let it go
unless something saved it (`SavePlan`); the backward walk (`backward_walk`) runs the records in reverse, making
each op's gradients and the temporaries their formulas hold, and frees what the ops saved; the optimizer step adds
its workspace. Works for models far bigger than RAM: nothing real is allocated.
"""
from __future__ import annotations

from collections import defaultdict

from .. import ops as optable
from ..measure import TimelinePoint
from ..nn.regions import region_info
from ..program import Program
from .backward_walk import StaticBackward
from .formula import UNMEASURED_FORMULA, formula_unmeasured
from .forward_walk import ForwardWalk
from .liveness import SavePlan, off_loss_path, seed_gradient
from .memory import MemoryEstimate, optimizer_state_bytes, optimizer_step_workspace
from .trace import ForwardTrace

def static_estimate(program: Program, traced: ForwardTrace, mode: str, optimizer: str) -> MemoryEstimate:
    """The static estimate of `program` from its forward trace `traced` (same mode; in train mode with the loss)."""
    records = traced.recorder.records
    est = _step_counts(program, traced, mode, optimizer)
    trained = traced.trained if mode == "train" else []
    plan = SavePlan(program, traced)
    baseline = est.params + est.buffers + est.inputs + est.optimizer_state
    walk = ForwardWalk(plan, baseline)
    walk.run()
    est.activations = walk.live_bytes - baseline
    live_bytes, peak, timeline = walk.live_bytes, walk.peak, walk.timeline
    if mode == "train":
        loss_key = getattr(traced.recorder, "loss_key", None)
        backward = StaticBackward(plan, walk, off_loss_path(records, loss_key), seed_gradient(records, loss_key))
        backward.run()
        live_bytes = backward.live_bytes
        unmeasured = {f"{record.func}{UNMEASURED_FORMULA}" for record in records
                      if formula_unmeasured(record.call)}
        est.unknown_ops = sorted(set(est.unknown_ops) | unmeasured)
        # optimizer step: the gradients of the parameters backward reached are live, plus the step's temporaries
        est.grads = sum(p.numel() * p.element_size() for p in trained)
        # the workspace counts every gradient; those the walk still holds (its parameters known by storage) are
        # in live_bytes already
        step_peak = live_bytes + optimizer_step_workspace(optimizer, trained) - backward.param_grad_bytes()
        peak.see(step_peak, "optimizer.step", "optimizer", "")
        timeline.append(TimelinePoint("optimizer", "optimizer.step", live_bytes, step_peak))
    est.peak = peak.bytes
    est.peak_at, est.peak_phase, est.peak_module = peak.at, peak.phase, peak.module
    est.timeline = timeline
    est.by_module = _saved_by_module(plan)
    return est


def _step_counts(program: Program, traced: ForwardTrace, mode: str, optimizer: str) -> MemoryEstimate:
    """The estimate's fixed parts: parameters, buffers, inputs, optimizer state, unknown ops and FLOPs."""
    records, storage_bytes, base_keys = traced.recorder.records, traced.recorder.storage_bytes, traced.base_keys
    est = MemoryEstimate(mode=mode, optimizer=optimizer, method="static")
    est.params = sum(storage_bytes[key] for key, kind in base_keys.items() if kind == "param")
    est.buffers = sum(storage_bytes[key] for key, kind in base_keys.items() if kind == "buffer")
    est.inputs = sum(storage_bytes[key] for key, kind in base_keys.items() if kind == "input")
    # the optimizer makes state at its first step, for the parameters that had a gradient then
    est.optimizer_state = optimizer_state_bytes(optimizer, traced.trained) if mode == "train" else 0
    est.unknown_ops = sorted({str(r.func) for r in records if not r.known and not optable.ignored(r.func)})
    measured = sorted({str(r.func) for r in records if r.saves_measured})
    if measured:
        est.notes.append(f"not in fxmem's op table, what these save for backward was measured on fake tensors: "
                         f"{', '.join(measured)}")
    est.flops_forward = sum(record.flops for record in records)
    est.flops_backward = 2 * sum(record.flops for record in records if record.out_rg)
    # recompute regions run their forward again in backward (selective regions skip the ops they keep)
    for record in records:
        if record.region and record.out_rg:
            info = region_info(program.module.get_submodule(record.region))
            if info is not None and info.kind == "recompute" and not info.keeps(record.func):
                est.flops_backward += record.flops
    return est


def _saved_by_module(plan: SavePlan) -> list:
    """[(module path, bytes saved for backward)], the ten heaviest."""
    saved: dict[str, int] = defaultdict(int)
    for key, until in plan.saved_until.items():
        saved[plan.records[plan.created_in.get(key, until)].module or "<root>"] += plan.storage_bytes[key]
    return sorted(saved.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
