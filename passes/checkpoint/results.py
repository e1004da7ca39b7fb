"""What the pass carries between its steps and what it reports.

A `Variant` is a program the pass plans regions on (after compact dropout; with remat's rewrite or without) with
the changes, notes and metrics so far; an `Attempt` is one plan emitted on a copy and verified; `regions_result`
turns the best attempt into the pass's result (or keeps the variant when no plan lowers the estimate).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fxmem.pass_api import PassResult
from fxmem.program import Program
from fxmem.units import format_bytes

from .candidates import CandidateSet
from .options import CheckpointOptions, Limits
from .solvers import Solution


@dataclass
class Variant:
    """A program to plan regions on, its trace and estimate, and what the pass did and says about it so far."""
    program: Program
    traced: Any  # what fxmem.costmodel.trace_forward returned for it (None until traced)
    estimate: Any  # its MemoryEstimate
    changes: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    rewrite_cost: float = 0.0  # recompute cost of its rewrites before regions (remat's), when comparing plans
    sets: list | None = None  # its candidate sets, once built

    def result(self, note: str) -> PassResult:
        """The variant as the pass's result, with `note` (and its estimate in the metrics if it changed anything)."""
        notes, metrics = list(self.notes) + [note], dict(self.metrics)
        if self.changes:
            metrics.update({"estimated_peak": self.estimate.peak, "estimated_activations": self.estimate.activations})
        return PassResult(self.program, bool(self.changes), changes=list(self.changes), notes=notes, metrics=metrics)


@dataclass
class Attempt:
    """One plan emitted on a copy of the variant's program and checked with the cost model."""
    solution: Solution
    program: Program
    changes: list
    estimate: Any  # the static estimate of `program`; None when not verified (verify=False)
    target: int  # the planning budget it was solved at
    cset: CandidateSet
    rank: tuple  # (bytes it misses the limits by, its estimated peak): lower is better


def regions_result(variant: Variant, attempt: Attempt, limits: Limits, opts: CheckpointOptions, log,
                   started: float) -> PassResult:
    """The pass's result with `attempt`'s regions, or `variant` unchanged when they do not lower the estimate."""
    before, after = variant.estimate, attempt.estimate
    notes, metrics = list(variant.notes), dict(variant.metrics)
    if after is None:
        lowered = True  # (not checked: verify=False)
    elif limits.activations is not None:  # fewer activations, the peak no higher
        lowered = after.activations < before.activations and (limits.peak is None or after.peak <= before.peak)
    else:  # a lower peak, or the same with fewer activations
        lowered = (after.peak, after.activations) < (before.peak, before.activations)
    sol, cset = attempt.solution, attempt.cset
    plan = {r.path: c for r, c in zip(cset.regions, sol.plan)}
    if not lowered:
        notes.append(_not_lowered_note(variant, after, limits))
        metrics.update({"estimated_peak": before.peak if variant.changes else after.peak,
                        "estimated_activations": before.activations if variant.changes else after.activations,
                        "plan": plan})
        return PassResult(variant.program, bool(variant.changes), changes=variant.changes, notes=notes,
                          metrics=metrics)
    metrics.update({"chain": cset.chain, "granularity": cset.level})
    if sol.note:
        notes.append("checkpoint: " + sol.note)
    metrics.update({
        "solver": sol.solver, "optimal": sol.optimal, "gap": sol.gap, "solve_seconds": round(sol.seconds, 4),
        "planned_peak": sol.peak, "planning_budget": attempt.target if limits.peak is not None else None,
        "planned_activations": before.activations - cset.model.freed(sol.plan),
        "estimated_peak": after.peak if after is not None else None,
        "estimated_activations": after.activations if after is not None else None,
        "recompute_flops": sol.cost if opts.cost == "flops" else None,
        "recompute_roofline_flops": sol.cost if opts.cost == "roofline" else None,
        "recompute_seconds": sol.cost if opts.cost == "profile" else None,
        "forward_flops": before.flops_forward, "plan": plan,
        "transform_seconds": round(time.perf_counter() - started, 3),
    })
    notes.extend(_over_slack_notes(after, limits, opts.slack, sol, metrics["planned_activations"]))
    log(f"[checkpoint] {sum(c != 'keep' for c in sol.plan)}/{len(cset.regions)} regions recomputed "
        f"({sol.solver}); planned peak {format_bytes(sol.peak)}, estimated "
        f"{format_bytes(after.peak) if after is not None else 'not checked'}"
        + (f", activations {format_bytes(after.activations)}" if after is not None else "")
        + f"; {limits.describe()}")
    return PassResult(attempt.program, bool(attempt.changes) or bool(variant.changes),
                      changes=variant.changes + attempt.changes, notes=notes, metrics=metrics)


def _not_lowered_note(variant: Variant, after, limits: Limits) -> str:
    before = variant.estimate
    why = ("no plan of the candidate regions frees activations" if limits.activations is not None else
           f"the peak is where recomputation cannot reach, at {before.peak_at or before.peak_phase}")
    kept = (f"no region emitted; the {len(variant.changes)} rewrite(s) before regions (remat, compact dropout) are "
            f"kept" if variant.changes else "graph left unchanged")
    return (f"checkpoint: the best plan would not lower the estimated memory (peak {format_bytes(after.peak)} vs "
            f"{format_bytes(before.peak)}, activations {format_bytes(after.activations)} vs "
            f"{format_bytes(before.activations)}: {why}); {kept}")


def _over_slack_notes(after, limits: Limits, slack: float, sol: Solution, planned_activations: int) -> list[str]:
    """Notes for an estimate above a limit plus the stated slack."""
    notes = []
    if after is not None and limits.peak is not None and after.peak > limits.peak * (1 + slack):
        notes.append(f"checkpoint: estimated peak after the pass {format_bytes(after.peak)} is above the "
                     f"budget {format_bytes(limits.peak)} + {slack:.0%} slack (planned {format_bytes(sol.peak)})")
    if after is not None and limits.activations is not None and after.activations > limits.activations * (1 + slack):
        notes.append(f"checkpoint: estimated activations after the pass {format_bytes(after.activations)} are "
                     f"above the activation budget {format_bytes(limits.activations)} + {slack:.0%} slack "
                     f"(planned {format_bytes(planned_activations)})")
    return notes
