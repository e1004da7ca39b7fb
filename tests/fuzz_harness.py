"""Running one random model (`tests/fuzz_models.py`) through the `low` policy at several budgets, and checking
what a user relies on: the result computes what the model does, and a result that says it fits its budget does
when measured (within the checkpoint pass's stated slack). Used by `tests/test_fuzz.py` and
`benchmarks/fuzz_budget.py`.

Budgets: one run with the budget as a target far below reach (the policy goes as low as checkpointing reaches:
its estimate is the lowest peak L), then strict budgets at L + f * (P - L) for each fraction f, P the captured
program's estimated peak: budgets the planner can reach, from its floor to no saving at all.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import fxmem
from fxmem.errors import BudgetError

from .exactness import difference

FRACTIONS = (0.0, 0.3, 0.7)


@dataclass
class FuzzRun:
    """One transform of one model at one budget."""
    seed: int
    label: str  # "lowest" (the target run) or the fraction, e.g. "0.3"
    budget: int
    estimated: int = 0  # the static estimate of the result's peak (the report's "after")
    measured: int = 0  # fxmem.measure of the result
    slack: float = 0.0  # the checkpoint pass's stated tolerance
    fits: bool = False  # the result says it fits: estimated <= budget
    exact_error: str | None = None  # how the result differs from the model, or None
    refused: str | None = None  # a BudgetError's message (a strict budget the pass cannot reach)
    crash: str | None = None  # "ExceptionType: message" of anything else raised

    @property
    def over_budget(self) -> bool:
        return self.fits and self.measured > self.budget

    @property
    def over_slack(self) -> bool:
        return self.fits and self.measured > self.budget * (1 + self.slack)

    @property
    def ratio(self) -> float:
        """Measured peak over the budget."""
        return self.measured / self.budget if self.budget else 0.0


@dataclass
class FuzzModelResult:
    """The captured program's estimate and measurement, and the runs at each budget."""
    seed: int
    description: str
    estimated: int = 0
    measured: int = 0
    runs: list[FuzzRun] = field(default_factory=list)
    crash: str | None = None  # capturing or measuring the model itself failed


def _slack(records) -> float:
    return next((float(r.metrics["slack"]) for r in records
                 if r.name == "checkpoint" and (r.metrics or {}).get("slack") is not None), 0.0)


def transform_once(case, program, run: FuzzRun, overrides=(), check_exact: bool = True) -> FuzzRun:
    """`fxmem.transform(program, policy="low", ...)`, its result measured and (optionally) compared with the
    model; a BudgetError is a refusal, anything else a crash, both noted on `run`."""
    try:
        budget = {} if overrides else {"budget": run.budget}
        res = fxmem.transform(program.snapshot(), case.args, policy="low", overrides=overrides, **budget)
        run.estimated = res.after.peak
        run.budget = res.report.budget
        run.fits = run.estimated <= run.budget
        run.slack = _slack(res.records)
        run.measured = fxmem.measure(copy.deepcopy(res.module), case.args, mode="train").peak
        if check_exact:
            run.exact_error = difference(case.model, res.module, case.args)
    except BudgetError as e:
        run.refused = str(e)
    except Exception as e:  # noqa: BLE001  (a crash is a finding: counted by type, not raised)
        run.crash = f"{type(e).__name__}: {e}"
    return run


def run_model(case, fractions=FRACTIONS, check_exact: bool = True) -> FuzzModelResult:
    """Capture `case` once, measure it, find the lowest peak `low` reaches, then transform at each budget."""
    out = FuzzModelResult(case.seed, case.describe())
    try:
        program = fxmem.capture(copy.deepcopy(case.model), case.args)
        program.refresh()
        out.estimated = fxmem.estimate(program, mode="train").peak
        out.measured = fxmem.measure(copy.deepcopy(program.module), case.args, mode="train").peak
    except Exception as e:  # noqa: BLE001
        out.crash = f"{type(e).__name__}: {e}"
        return out
    lowest = transform_once(case, program, FuzzRun(case.seed, "lowest", 1), overrides=("budget=1",),
                            check_exact=check_exact)
    out.runs.append(lowest)
    if lowest.crash or lowest.refused or lowest.estimated >= out.estimated:
        return out  # no saving possible: every budget below the baseline is out of reach
    for f in fractions:
        budget = int(lowest.estimated + f * (out.estimated - lowest.estimated))
        out.runs.append(transform_once(case, program, FuzzRun(case.seed, f"{f:g}", budget),
                                       check_exact=check_exact))
    return out
