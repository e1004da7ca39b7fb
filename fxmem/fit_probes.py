"""How `fxmem.fit_batch` tries a batch size: what the policy's step costs there, in memory and in time.

The passes that do not read the budget (attention, pruning, gating, precision and any pass of the user's) make
the same changes at every batch: the guard of lossy changes judges them on the same rows. So they run once, at
the example batch, and each probe re-sizes that program (the example rows repeated along the batch dim, which
capture keeps dynamic) and runs only the budget passes (checkpoint, offload), which plan for the batch they see.
A program that does not re-size (a batch dim specialized at capture) falls back to transforming the model at
every batch. Probes skip verification; a probe over the cap is an answer, not an error.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .api import TransformResult, transform
from .costmodel import step_cost
from .costmodel.batch import scaled_inputs
from .errors import FxmemError
from .policy_loader import load_policy
from .registry import BUDGET_PASSES

# errors that say a captured program does not run at another batch size (as plan_batch treats them)
RESIZE_ERRORS = (RuntimeError, ValueError, IndexError, FxmemError)


@dataclass(frozen=True)
class Probe:
    """One batch tried: the estimated peak of its transformed step, and that step's cost in FLOP-equivalents
    (roofline: forward, backward, what the budget passes add in recomputation and exposed transfers)."""
    batch: int
    peak: int
    step_cost: float

    @property
    def cost_per_sample(self) -> float:
        return self.step_cost / self.batch


class BatchProber:
    """Probes of one model under one policy and cap; `options` are fit_batch's transform options."""

    def __init__(self, model, inputs: tuple[tuple, dict], cap: int, policy: Any, options: dict, batch_dim: int):
        self.model, self.inputs, self.cap, self.policy, self.batch_dim = model, inputs, cap, policy, batch_dim
        self.options = {**options, "measure": False, "strict": False}  # a probe over the cap is an answer
        self.probes: dict[int, Probe] = {}
        self.notes: list[str] = []
        self._staged: TransformResult | None = None
        self._resizes = True
        self.policy_read = _policy_of(policy, self.options)

    def fits(self, batch: int) -> bool:
        return self.probe(batch).peak <= self.cap

    def program_at(self, batch: int):
        """The transformed program of the probe at `batch` (probed now if it was not)."""
        self.probes.pop(batch, None)
        return self._run(batch).program

    def probe(self, batch: int) -> Probe:
        if batch not in self.probes:
            self._run(batch)
        return self.probes[batch]

    def _run(self, batch: int) -> TransformResult:
        scaled = scaled_inputs(*self.inputs, self.batch_dim, batch)
        result = self._budget_passes_at(batch, scaled) if self._resizes else None
        if result is None:
            result = self._transform(self.model, scaled, self.options)
        self.probes[batch] = Probe(batch, result.after.peak, self._step_cost(result))
        return result

    def staged(self) -> TransformResult:
        """The model at the example batch with every enabled pass but the budget passes applied."""
        if self._staged is None:
            options = {key: value for key, value in self.options.items() if key != "activation_budget"}
            off = [name for name in BUDGET_PASSES if name in self.policy_read.passes]
            self._staged = self._transform(self.model, self.inputs, options, disable=off)
        return self._staged

    def _budget_passes_at(self, batch: int, scaled: tuple[tuple, dict]) -> TransformResult | None:
        """The staged program re-sized to `batch`, with the budget passes run on it; None (and every later probe
        transforms the model) when the program does not run at that batch."""
        program = self.staged().program.snapshot()
        program = replace(program, example_args=scaled[0], example_kwargs=scaled[1])
        others = [name for name in self.policy_read.enabled_passes if name not in BUDGET_PASSES]
        try:
            program.refresh()
            return self._transform(program, scaled, self.options, disable=others)
        except RESIZE_ERRORS as error:
            self._resizes = False
            self.notes.append(f"the program does not re-size to batch {batch} ({str(error).splitlines()[0][:160]}); "
                              "every batch is transformed from the model")
            return None

    def _transform(self, model, inputs: tuple[tuple, dict], options: dict, disable=()) -> TransformResult:
        overrides = [*options.get("overrides", ()), "verify.enabled=false", "budget_strict=false",
                     *(f"passes.{name}.enabled=false" for name in disable)]
        return transform(model, *inputs, policy=self.policy, budget=self.cap, **{**options, "overrides": overrides})

    def _step_cost(self, result: TransformResult) -> float:
        """Roofline cost of the result's step at its inputs: forward and backward of the program the budget
        passes planned on (the model's, when transformed from it), plus the recomputation their applied changes
        state (`recompute_cost`) and offload's exposed transfer time at the machine rate offload measured."""
        planned_on = result.original
        cost = step_cost(planned_on, loss_fn=self.options.get("loss_fn"))
        for record in (r for r in result.records if r.status == "applied"):
            cost += sum(float(change.details.get("recompute_cost", 0.0)) for change in record.changes)
            if record.metrics.get("exposed_transfer_s") and record.metrics.get("flops_per_s"):
                cost += record.metrics["exposed_transfer_s"] * record.metrics["flops_per_s"]
        return cost


def _policy_of(policy: Any, options: dict):
    """The policy as transform reads it: its overrides and typed keyword settings (dots as double underscores)."""
    read = load_policy(policy, overrides=options.get("overrides", ()))
    for keyword, value in options.items():
        if "__" in keyword:
            read = read.with_overrides({keyword.replace("__", "."): value}, where=f"fit_batch({keyword}=...)")
    return read
