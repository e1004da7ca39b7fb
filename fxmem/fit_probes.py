"""How `fxmem.fit_batch` and `fxmem.fit_length` try a size: what the policy's step costs there, in memory and time.

The passes that do not read the budget (attention, pruning, gating, precision and any pass of the user's) make
the same changes at every size: the guard of lossy changes judges them on the same rows. So they run once, at
the example inputs, and each probe re-sizes that program (the example's rows or tokens repeated along the dim,
which capture keeps dynamic) and runs only the budget passes (checkpoint, offload), which plan for the size they
see. When the program does not re-size, the model is transformed at that size instead: if that runs, the dim was
specialized at capture and every later probe transforms the model; if it does not either, the model does not run
at that size (a sequence longer than its position table), which counts as not fitting. Probes skip verification;
a probe over the cap is an answer, not an error.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

from .api import TransformResult, transform
from .costmodel import plan_batch, step_cost
from .costmodel.batch import scaled_inputs
from .errors import FxmemError
from .policy_loader import load_policy
from .registry import BUDGET_PASSES

# errors that say a program or model does not run at another size (as plan_batch treats them)
RESIZE_ERRORS = (RuntimeError, ValueError, IndexError, FxmemError)
# the peak of a size the model does not run at: above any cap
DOES_NOT_RUN = sys.maxsize


@dataclass(frozen=True)
class Axis:
    """What is searched: its name in messages ("batch", "length"), the inputs' dim, the largest size tried."""
    word: str
    dim: int
    limit: int


@dataclass(frozen=True)
class Probe:
    """One size tried: the estimated peak of its transformed step (DOES_NOT_RUN when the model does not run at
    it), and that step's cost in FLOP-equivalents (roofline: forward, backward, what the budget passes add in
    recomputation and exposed transfers)."""
    size: int
    peak: int
    step_cost: float
    budget_changes: int = 0  # changes the budget passes applied (recomputation, compact masks, offload)

    @property
    def cost_per_sample(self) -> float:
        return self.step_cost / self.size


class SizeProber:
    """Probes of one model under one policy and cap along one axis; `options` are the fit's transform options."""

    def __init__(self, model, inputs: tuple[tuple, dict], cap: int, policy: Any, options: dict, axis: Axis):
        self.model, self.inputs, self.cap, self.policy, self.axis = model, inputs, cap, policy, axis
        self.options = {**options, "measure": False, "strict": False}  # a probe over the cap is an answer
        self.probes: dict[int, Probe] = {}
        self.resize_notes: list[str] = []
        self.not_running: tuple[int, str] | None = None  # the smallest size the model does not run at, and why
        self.policy_read = _policy_of(policy, self.options)
        self._staged: TransformResult | None = None
        self._resizes = True

    @property
    def notes(self) -> list[str]:
        """What the search should say: a program that did not re-size, the smallest size the model does not run at."""
        failure = ([f"the model does not run at {self.axis.word} {self.not_running[0]} ({self.not_running[1]}): "
                    "taken as not fitting"] if self.not_running is not None else [])
        return self.resize_notes + failure

    def fits(self, size: int) -> bool:
        return self.probe(size).peak <= self.cap

    def probe(self, size: int) -> Probe:
        if size not in self.probes:
            self._run(size)
        return self.probes[size]

    def program_at(self, size: int):
        """The transformed program of the probe at `size` (probed again), None when the model does not run there."""
        self.probes.pop(size, None)
        result = self._run(size)
        return result.program if result is not None else None

    def staged(self) -> TransformResult:
        """The model at the example inputs with every enabled pass but the budget passes applied."""
        if self._staged is None:
            options = {key: value for key, value in self.options.items() if key != "activation_budget"}
            off = [name for name in BUDGET_PASSES if name in self.policy_read.passes]
            self._staged = self._transform(self.model, self.inputs, options, disable=off)
        return self._staged

    def largest_without_budget_passes(self) -> int | None:
        """The largest size whose step, with every pass but the budget passes, fits the cap by the estimate (None
        when that program does not re-size, or not even size 1 fits)."""
        try:
            return plan_batch(self.staged().program, budget=self.cap, batch_dim=self.axis.dim,
                              loss_fn=self.options.get("loss_fn"))["batch"] or None
        except (RuntimeError, ValueError, FxmemError):
            return None

    def _run(self, size: int) -> TransformResult | None:
        scaled = scaled_inputs(*self.inputs, self.axis.dim, size)
        resize_error = None
        if self._resizes:
            try:
                result = self._budget_passes_at(scaled)
            except RESIZE_ERRORS as error:
                resize_error, result = error, None
        else:
            result = None
        if result is None:
            try:
                result = self._transform(self.model, scaled, self.options)
            except RESIZE_ERRORS as error:
                if self.not_running is None or size < self.not_running[0]:
                    self.not_running = (size, _first_line(error))
                self.probes[size] = Probe(size, DOES_NOT_RUN, float("inf"))
                return None
            if resize_error is not None:
                self._resizes = False
                self.resize_notes.append(f"the program does not re-size to {self.axis.word} {size} "
                                  f"({_first_line(resize_error)}); every size is transformed from the model")
        changes = sum(len(record.changes) for record in result.records
                      if record.status == "applied" and record.name in BUDGET_PASSES)
        self.probes[size] = Probe(size, result.after.peak, self._step_cost(result), changes)
        return result

    def _budget_passes_at(self, scaled: tuple[tuple, dict]) -> TransformResult:
        """The staged program re-sized to the scaled inputs, with the budget passes run on it."""
        program = replace(self.staged().program.snapshot(), example_args=scaled[0], example_kwargs=scaled[1])
        others = [name for name in self.policy_read.enabled_passes if name not in BUDGET_PASSES]
        program.refresh()
        return self._transform(program, scaled, self.options, disable=others)

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


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:160]


def _policy_of(policy: Any, options: dict):
    """The policy as transform reads it: its overrides and typed keyword settings (dots as double underscores)."""
    read = load_policy(policy, overrides=options.get("overrides", ()))
    for keyword, value in options.items():
        if "__" in keyword:
            read = read.with_overrides({keyword.replace("__", "."): value}, where=f"fit({keyword}=...)")
    return read
