"""The largest batch whose transformed program fits a memory cap: `fxmem.fit_batch`.

HF Trainer's `auto_find_batch_size` finds a batch by running out of memory and halving. fxmem answers before the
first step: it transforms the model under the policy at a batch size (the example inputs' rows repeated along the
batch dim), with the cap as the budget, and asks the cost model whether the result's peak fits. Each probe plans
for its own batch (a plan tuned at batch 8 is not the best one at batch 64), so the search transforms at every
batch it tries: a guess from the plan at the example batch (`fxmem.plan_batch` on its program), then brackets and
bisection (`costmodel.batch.largest_fitting`). Probes skip verification (no real steps of the original model at
large batches); the result at the chosen batch is transformed again with the policy's verification as given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .api import TransformResult, transform
from .costmodel import plan_batch
from .costmodel.batch import batch_size, largest_fitting, scaled_inputs
from .errors import BudgetError, FxmemError, PolicyError
from .units import format_bytes, parse_size


@dataclass
class FitResult:
    """The batch chosen, the transformed model at that batch, its inputs, and every probe's estimated peak
    in bytes."""
    batch: int
    result: TransformResult
    args: tuple
    kwargs: dict
    budget: int
    probes: dict[int, int] = field(default_factory=dict)

    def summary(self) -> str:
        tried = ", ".join(f"{batch}: {format_bytes(peak)}" for batch, peak in sorted(self.probes.items()))
        return (f"fit: batch {self.batch} is the largest whose transformed step fits {format_bytes(self.budget)} by "
                f"the estimate (peak {format_bytes(self.result.after.peak)}); estimated peak by batch: {tried}")


def _cap_bytes(budget: Any) -> int:
    if isinstance(budget, str):
        if budget.strip().endswith("%"):
            raise PolicyError(f"fit_batch: budget {budget!r} is a fraction of the baseline; a batch search needs a "
                              "cap in bytes (e.g. '16GiB')")
        return parse_size(budget)
    if isinstance(budget, float) and budget < 1:
        raise PolicyError(f"fit_batch: budget {budget!r} is a fraction; give a cap in bytes (e.g. '16GiB')")
    return int(budget)


def fit_batch(model, args: Any = (), kwargs: dict | None = None, *, budget: Any, policy: Any = "high",
              batch_dim: int = 0, max_batch: int = 4096, **transform_options) -> FitResult:
    """The largest batch (inputs scaled along `batch_dim`, at most `max_batch`) whose step, transformed by
    `policy` with `budget` (bytes or "16GiB") as its cap, fits by the cost model; with the result at that batch.
    `transform_options` go to every `fxmem.transform` call (loss_fn, overrides, measure for the final one, ...).
    BudgetError when not even batch 1 fits."""
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    cap = _cap_bytes(budget)
    probes: dict[int, int] = {}
    probe_options = {**transform_options, "measure": False, "strict": False}  # a probe over the cap is an answer
    probe_options["overrides"] = [*transform_options.get("overrides", ()), "verify.enabled=false",
                                  "budget_strict=false"]

    def fits(batch: int) -> bool:
        if batch not in probes:
            scaled_args, scaled_kwargs = scaled_inputs(args, kwargs, batch_dim, batch)
            result = transform(model, scaled_args, scaled_kwargs, policy=policy, budget=cap, **probe_options)
            probes[batch] = result.after.peak
        return probes[batch] <= cap

    example = batch_size(args, kwargs, batch_dim)
    if not fits(1):
        raise BudgetError(f"fit_batch: not even batch 1 fits the cap of {format_bytes(cap)} (estimated peak "
                          f"{format_bytes(probes[1])} after the policy's passes); raise the cap or enable passes "
                          "that go further")
    batch = largest_fitting(fits, _guess(model, args, kwargs, cap, policy, probe_options, example), max_batch)
    final_args, final_kwargs = scaled_inputs(args, kwargs, batch_dim, batch)
    result = transform(model, final_args, final_kwargs, policy=policy, budget=cap,
                       **{**transform_options, "overrides": [*transform_options.get("overrides", ()),
                                                              "budget_strict=false"]})
    return FitResult(batch, result, final_args, final_kwargs, cap, probes)


def _guess(model, args, kwargs, cap: int, policy, probe_options: dict, example: int) -> int:
    """Where the search starts: the largest batch at which the plan made at the example batch fits the cap."""
    planned = transform(model, args, kwargs, policy=policy, budget=cap, **probe_options)
    try:
        return max(1, plan_batch(planned.program, budget=cap)["batch"])
    except (RuntimeError, ValueError, FxmemError):  # the transformed program does not re-size: start at the example batch
        return example
