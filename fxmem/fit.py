"""The batch to train at, or the longest sequence, under a memory cap: `fxmem.fit_batch`, `fxmem.fit_length`.

HF Trainer's `auto_find_batch_size` finds a batch by running out of memory and halving. fxmem answers before the
first step. It searches for the largest size (batch, or sequence length) whose transformed step fits the cap by the
cost model: a guess from the plan at the example inputs (`fxmem.plan_batch` on its program), then brackets and
bisection (`costmodel.batch.largest_fitting`), each size probed as `fit_probes` says (the budget passes plan again
at every size). For a batch it then takes, among the batches probed that fit, the one with the most samples per
second by the cost model's time estimate (the roofline cost of the step, recomputation and exposed transfers
included, per sample): a smaller batch that needs less recomputation can train faster than the largest one. The
largest batch whose step fits without the budget passes is always among the candidates. Ties within `TIE_TOLERANCE`
go to a batch that the budget passes leave as it is when there is one (what they add in time is the least sure part
of the estimate: recomputation's fixed cost per site and compact dropout masks are not in it), then to the larger
batch (per-step costs such as the optimizer's are not in the estimate). A length fit takes the longest. The result
at the chosen size is transformed again from the model, with the policy's verification as given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .api import TransformResult, transform
from .costmodel import plan_batch
from .costmodel.batch import batch_size, largest_fitting, scaled_inputs
from .errors import BudgetError, FxmemError, PolicyError
from .fit_probes import DOES_NOT_RUN, Axis, Probe, SizeProber
from .units import format_bytes, parse_size

# a batch whose estimated cost per sample is within this share of the cheapest counts as a tie
TIE_TOLERANCE = 0.02


@dataclass
class FitResult:
    """The size chosen along the axis searched (`what`: "batch" or "length"), the transformed model at that size,
    its inputs, the largest size that fits, and every probe (estimated peak and step cost)."""
    size: int
    what: str
    result: TransformResult
    args: tuple
    kwargs: dict
    budget: int
    largest: int = 0
    probes: dict[int, Probe] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        tried = ", ".join(f"{size}: " + (format_bytes(probe.peak) if probe.peak != DOES_NOT_RUN else "does not run")
                          for size, probe in sorted(self.probes.items()))
        chosen = (f"{self.what} {self.size} is the largest whose transformed step fits {format_bytes(self.budget)}"
                  if self.size == self.largest else
                  f"{self.what} {self.size} trains the most samples per second by the estimate "
                  f"({self.speedup():.2f}x {self.what} {self.largest}'s, the largest that fits "
                  f"{format_bytes(self.budget)})")
        return (f"fit: {chosen} (peak {format_bytes(self.result.after.peak)}); estimated peak by {self.what}: "
                f"{tried}" + "".join(f"; {note}" for note in self.notes))

    def speedup(self) -> float:
        """Estimated samples per second at the chosen size over the largest size's."""
        return self.probes[self.largest].cost_per_sample / self.probes[self.size].cost_per_sample


def _cap_bytes(budget: Any) -> int:
    if isinstance(budget, str):
        if budget.strip().endswith("%"):
            raise PolicyError(f"fit: budget {budget!r} is a fraction of the baseline; a search across sizes needs a "
                              "cap in bytes (e.g. '16GiB')")
        return parse_size(budget)
    if isinstance(budget, float) and budget < 1:
        raise PolicyError(f"fit: budget {budget!r} is a fraction; give a cap in bytes (e.g. '16GiB')")
    return int(budget)


def fit_batch(model, args: Any = (), kwargs: dict | None = None, *, budget: Any, policy: Any = "high",
              batch_dim: int = 0, max_batch: int = 4096, **transform_options) -> FitResult:
    """The batch (inputs scaled along `batch_dim`, at most `max_batch`) that trains the most samples per second
    by the estimate among those whose step, transformed by `policy` with `budget` (bytes or "16GiB") as its cap,
    fits by the cost model; with the result at that batch. `transform_options` go to every `fxmem.transform`
    call (loss_fn, overrides, measure for the final one, ...). BudgetError when not even batch 1 fits."""
    return _fit(model, (args, kwargs), budget, policy, Axis("batch", batch_dim, max_batch), transform_options)


def fit_length(model, args: Any = (), kwargs: dict | None = None, *, budget: Any, policy: Any = "high",
               seq_dim: int = 1, max_length: int = 1 << 16, **transform_options) -> FitResult:
    """The longest sequence (every input whose size along `seq_dim` is the example's: its tokens repeated, at most
    `max_length`) whose step, transformed by `policy` with `budget` as its cap, fits by the cost model; a length
    the model does not run at (past its position table) counts as not fitting. As `fit_batch` otherwise."""
    return _fit(model, (args, kwargs), budget, policy, Axis("length", seq_dim, max_length), transform_options)


def _fit(model, inputs: tuple, budget: Any, policy: Any, axis: Axis, transform_options: dict) -> FitResult:
    args, kwargs = inputs
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    cap = _cap_bytes(budget)
    prober = SizeProber(model, (args, kwargs), cap, policy, transform_options, axis)
    if not prober.fits(1):
        why = (prober.notes[-1] + ")" if prober.notes else
               f"estimated peak {format_bytes(prober.probes[1].peak)} after the policy's passes); raise the cap or "
               "enable passes that go further")
        raise BudgetError(f"fit: not even {axis.word} 1 fits the cap of {format_bytes(cap)} ({why}")
    largest = largest_fitting(prober.fits, _guess(prober, batch_size(args, kwargs, axis.dim)), axis.limit)
    size = fastest(prober, largest) if axis.word == "batch" else largest
    final_args, final_kwargs = scaled_inputs(args, kwargs, axis.dim, size)
    result = transform(model, final_args, final_kwargs, policy=policy, budget=cap,
                       **{**transform_options, "overrides": [*transform_options.get("overrides", ()),
                                                              "budget_strict=false"]})
    return FitResult(size, axis.word, result, final_args, final_kwargs, cap, largest, dict(prober.probes),
                     prober.notes)


def fastest(prober: SizeProber, largest: int) -> int:
    """Among the sizes probed that fit (half and three quarters of the largest, and the largest at which the step
    fits without the budget passes), the one with the least estimated cost per sample. Of those within
    TIE_TOLERANCE of it: the largest that the budget passes leave as it is, else the largest."""
    for share in (0.75, 0.5):
        prober.probe(max(1, int(largest * share)))
    unplanned = prober.largest_without_budget_passes()
    if unplanned is not None:
        prober.probe(min(unplanned, largest))
    fitting = [probe for probe in prober.probes.values() if probe.size <= largest and probe.peak <= prober.cap]
    cheapest = min(probe.cost_per_sample for probe in fitting)
    tied = [probe for probe in fitting if probe.cost_per_sample <= cheapest * (1 + TIE_TOLERANCE)]
    plain = [probe for probe in tied if probe.budget_changes == 0]
    return max(probe.size for probe in plain or tied)


def _guess(prober: SizeProber, example: int) -> int:
    """Where the search starts: the largest size at which the plan made at the example inputs fits the cap."""
    program = prober.program_at(example)
    if program is None:
        return example
    try:
        return max(1, plan_batch(program, budget=prober.cap, batch_dim=prober.axis.dim)["batch"])
    except (RuntimeError, ValueError, FxmemError):  # the transformed program does not re-size: start there
        return example
