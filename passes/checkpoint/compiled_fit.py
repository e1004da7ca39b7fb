"""Planning for the compiled step: `passes.checkpoint.compiled_activation_budget` (and `compiler_budgets`).

A result that will run under torch.compile saves what inductor's partitioner decides: fxmem's recompute tags
honoured, the compiler's own min-cut on top (cheap pointwise ops recomputed for free; below an
activation_memory_budget of 1 more, by its own knapsack), convolution weights saved as channels-last copies. The
eager plan's bytes are not that number, so a plan sized for eager saves keeps less or more than asked once compiled.
Here the compiled saves are the limit: at a partitioner budget c, the pass is planned at the largest eager
activation budget (bisection) whose result, compiled at c, saves no more than the target, both read off the
compiler's own partition (`fxmem.costmodel.compiled_saves`, before code generation). The target is bytes, or a
fraction b: what torch.compile alone saves at activation_memory_budget b.

Which c: by default the compiler's own setting (one fit, no timing; the result compiles with plain torch.compile).
With `compiler_budgets` the fit runs at each listed c ("auto": b, halfway from b to 1, and 1; for a byte target
1, 0.75 and 0.5), and of the plans that fit, the one whose compiled step is fastest, measured
(`fxmem.compiled_timing`), is the result. The step time depends on what the compiler does with a plan, which the
pass's costs, priced for eager execution, do not know: on the benchmark's decoder compile@0.5 runs faster than
compile@1.0, so a plan fitted at c = 1 can fit the bytes and still be slower. The chosen c is recorded
(`metrics["compiler_budget"]`; the transform puts it on the module, and `fxmem.compile` compiles at it). Where the
program as given, compiled at c = b, is fastest, the result is the program unchanged, compiled at b: torch.compile
alone, said so. The result is exact as the pass's every result is.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from fxmem.compiled_timing import Candidate, compiled_step_times
from fxmem.costmodel import compiled_saves
from fxmem.errors import BudgetError
from fxmem.pass_api import PassResult
from fxmem.program import Program
from fxmem.units import Budget, format_bytes

# the bisection stops when the eager budgets it brackets are this share of the baseline's activations apart
RESOLUTION = 0.01
STEPS = 10  # at most this many plans per partitioner budget
AUTO_FOR_BYTES = (1.0, 0.75, 0.5)  # `compiler_budgets: auto` for a target in bytes
TIE = 0.01  # measured step times this share apart are a tie, which the plan saving fewer bytes wins


@dataclass(frozen=True)
class CompiledGoal:
    """What the fit is asked: the compiled saves' `budget`, the partitioner budgets to fit at (None: the
    compiler's setting; a tuple, or "auto"), whether a miss is an error, and the loss the timed steps take."""
    budget: Budget
    compiler_budgets: tuple | str | None = None
    strict: bool = True
    loss_fn: Callable | None = None

    def settings(self) -> tuple:
        """The partitioner budgets to fit at, largest first (None: the compiler's setting)."""
        if self.compiler_budgets is None:
            return (None,)
        if self.compiler_budgets == "auto":
            b = self.budget.fraction
            chosen = AUTO_FOR_BYTES if b is None else (1.0, (1.0 + b) / 2, b)
        else:
            chosen = self.compiler_budgets
        return tuple(sorted({float(c) for c in chosen}, reverse=True))


@dataclass
class Tried:
    """One plan of the search: the eager activation budget it was planned for, what its compiled step saves, the
    result."""
    activation_budget: int
    saves: int
    result: PassResult


@dataclass
class Fit:
    """The search at one partitioner budget: what the program saves compiled at it (`before`), the plans tried,
    the chosen one (None: the program itself fits) and whether it fits."""
    compiler_budget: float | None
    before: int
    tried: list[Tried]
    best: Tried | None
    fits: bool

    @property
    def saves(self) -> int:
        return self.before if self.best is None else self.best.saves

    def module(self, program: Program):
        return program.module if self.best is None else self.best.result.program.module


def compiled_target(budget: Budget, program: Program) -> tuple[int, str]:
    """(bytes, how they were set): a byte budget itself; a fraction b, what torch.compile alone saves at
    activation_memory_budget b."""
    if budget.bytes is not None:
        return budget.bytes, "passes.checkpoint.compiled_activation_budget"
    saves = compiled_saves(program.module, program.example_args, program.example_kwargs,
                           activation_memory_budget=budget.fraction)
    return saves.total, f"torch.compile alone at activation_memory_budget {budget.fraction:g}"


def fit_compiled(plan: Callable[[int], PassResult], program: Program, baseline_activations: int,
                 goal: CompiledGoal) -> PassResult:
    """The result of `plan(activation_budget)` whose compiled step saves no more than `goal` asks
    (`compiled_target`): at each partitioner budget the largest eager activation budget that fits, the fastest
    of those measured when there are several; the program itself where it fits as it is. Out of reach: a
    BudgetError when strict, else the lowest plan, saying so."""
    target, source = compiled_target(goal.budget, program)
    # at the target's own fraction the program's compiled saves are the target (one partition fewer)
    fits = [_fit_at(plan, target, baseline_activations, c,
                    target if c is not None and c == goal.budget.fraction else _saves(program, c))
            for c in goal.settings()]
    chosen, times = _choose(fits, program, goal)
    if goal.strict:
        _require(chosen, target, source)
    result = PassResult(program, False) if chosen.best is None else chosen.best.result
    result.metrics.update(_metrics(target, source, chosen, fits, times))
    if not chosen.fits:
        result.metrics["best_effort"] = "compiled_activations"
    result.notes.insert(0, _note(chosen, fits, target, source))
    if times is not None:
        result.notes.insert(1, _timing_note(chosen, fits, times))
    if chosen.compiler_budget is not None:
        result.notes.insert(2 if times is not None else 1,
                            f"checkpoint: compile the result at activation_memory_budget {chosen.compiler_budget:g}, "
                            f"as planned: fxmem.compile(module) (or torch.compile(module, "
                            f"options=fxmem.compile_options(module)))")
    return result


def _fit_at(plan, target: int, baseline_activations: int, compiler_budget, before: int) -> Fit:
    """The search at one partitioner budget, where the program saves `before` compiled: the program itself when
    it fits, else the bisection's best."""
    if before <= target:
        return Fit(compiler_budget, before, [], None, True)
    tried = _bisect(plan, target, baseline_activations, compiler_budget)
    fitting = [t for t in tried if t.saves <= target]
    best = max(fitting, key=lambda t: t.activation_budget) if fitting else min(tried, key=lambda t: t.saves)
    return Fit(compiler_budget, before, tried, best, bool(fitting))


def _choose(fits: list[Fit], program: Program, goal: CompiledGoal) -> tuple[Fit, dict | None]:
    """The fit to return and, when several fit, their measured compiled step times (seconds, by partitioner
    budget): the fastest fitting (of those within TIE of the fastest, the one saving the fewest bytes); none
    fitting, the lowest."""
    fitting = [fit for fit in fits if fit.fits]
    if not fitting:
        return min(fits, key=lambda fit: fit.saves), None
    if len(fitting) == 1:
        return fitting[0], None
    times = compiled_step_times({fit.compiler_budget: Candidate(fit.module(program), fit.compiler_budget)
                                 for fit in fitting}, program.example_args, program.example_kwargs, goal.loss_fn)
    fastest = min(times.values())
    tied = [fit for fit in fitting if times[fit.compiler_budget] <= fastest * (1 + TIE)]
    return min(tied, key=lambda fit: (fit.saves, times[fit.compiler_budget])), times


def _bisect(plan: Callable[[int], PassResult], target: int, baseline_activations: int,
            compiler_budget) -> list[Tried]:
    """The plans tried: bisection over the eager activation budget in [0, the baseline's], at most STEPS, until
    the bracket is RESOLUTION of the baseline wide; the pass's lowest plan too when none fits."""
    tried: list[Tried] = []
    low, high = 0, baseline_activations
    while len(tried) < STEPS and high - low > RESOLUTION * baseline_activations:
        middle = (low + high) // 2
        tried.append(_try(plan, middle, compiler_budget))
        low, high = (middle, high) if tried[-1].saves <= target else (low, middle)
    if all(t.saves > target for t in tried):
        tried.append(_try(plan, 1, compiler_budget))  # the lowest plan the pass reaches
    return tried


def _require(chosen: Fit, target: int, source: str) -> None:
    """A strict budget: the compiled saves out of reach, or the peak budget missed by the plan that fits, is a
    BudgetError."""
    if not chosen.fits:
        error = BudgetError(f"passes.checkpoint.compiled_activation_budget: the lowest plan's compiled step saves "
                            f"{format_bytes(chosen.saves)}, above {format_bytes(target)} ({source})")
        error.lowest = chosen.saves
        raise error
    if chosen.best is not None and chosen.best.result.metrics.get("best_effort") == "peak":
        notes = chosen.best.result.notes
        why = next((note for note in notes if note.startswith("checkpoint: budget")), "by its estimate")
        raise BudgetError(f"checkpoint: the plan whose compiled step fits {format_bytes(target)} misses the peak "
                          f"budget: {why}")


def _saves(program: Program, compiler_budget) -> int:
    return compiled_saves(program.module, program.example_args, program.example_kwargs,
                          activation_memory_budget=compiler_budget).total


def _try(plan: Callable[[int], PassResult], activation_budget: int, compiler_budget) -> Tried:
    result = plan(activation_budget)
    return Tried(activation_budget, _saves(result.program, compiler_budget), result)


def _at(compiler_budget) -> str:
    return "" if compiler_budget is None else f" at activation_memory_budget {compiler_budget:g}"


def _note(chosen: Fit, fits: list[Fit], target: int, source: str) -> str:
    """The pass's first note: what the chosen result's compiled step saves and how it was chosen."""
    if chosen.best is None:
        return (f"checkpoint: compiled{_at(chosen.compiler_budget)}, the program saves "
                f"{format_bytes(chosen.before)} for backward, within {format_bytes(target)} ({source}); nothing "
                f"recomputed")
    tried = sum(len(fit.tried) for fit in fits)
    how = (f"within {format_bytes(target)} ({source}); planned at the eager activation budget "
           f"{format_bytes(chosen.best.activation_budget)}, the largest of {len(chosen.tried)} tried"
           f"{_at(chosen.compiler_budget)} whose compiled saves fit" if chosen.fits else
           f"the lowest of {tried} plans tried, above {format_bytes(target)} ({source})")
    return (f"checkpoint: planned for torch.compile{_at(chosen.compiler_budget)}: the result's compiled step saves "
            f"{format_bytes(chosen.saves)} for backward ({format_bytes(chosen.before)} before), {how} "
            f"(fxmem.costmodel.compiled_saves: the compiler's own partition)")


def _timing_note(chosen: Fit, fits: list[Fit], times: dict) -> str:
    """Which partitioner budgets fit and how fast each one's compiled step ran; how to compile at the chosen."""
    measured = ", ".join(f"{fit.compiler_budget:g}: {times[fit.compiler_budget] * 1e3:.1f} ms"
                         + ("" if fit.best is not None else " (the program as given)")
                         for fit in fits if fit.compiler_budget in times)
    missed = [f"{fit.compiler_budget:g}" for fit in fits if not fit.fits]
    return (f"checkpoint: chose activation_memory_budget {chosen.compiler_budget:g}, the fastest compiled training "
            f"step of those that fit, within {TIE:.0%} the one saving the least (median of timed steps on this "
            f"machine: {measured})"
            + (f"; at {', '.join(missed)} no plan fit" if missed else ""))


def _metrics(target: int, source: str, chosen: Fit, fits: list[Fit], times: dict | None) -> dict:
    return {"compiler_budget": chosen.compiler_budget,
            "compiled": {"target": target, "target_from": source, "saves_before": chosen.before,
                         "saves": chosen.saves, "compiler_budget": chosen.compiler_budget,
                         "activation_budget": None if chosen.best is None else chosen.best.activation_budget,
                         "tried": [(t.activation_budget, t.saves) for t in chosen.tried],
                         "fits": [{"compiler_budget": fit.compiler_budget, "saves_before": fit.before,
                                   "saves": fit.saves, "fits": fit.fits,
                                   "activation_budget": None if fit.best is None else fit.best.activation_budget,
                                   "step_s": None if times is None else times.get(fit.compiler_budget)}
                                  for fit in fits]}}


def planner(run: Callable, program: Program, ctx) -> Callable[[int], PassResult]:
    """`plan(activation_budget)`: the pass (`run(program, ctx)`) on a copy of `program` at that eager activation
    budget, its compiled limit left out, the budget a target (the search brackets it)."""
    options = replace(ctx.options, compiled_activation_budget=None, compiler_budgets=None)

    def plan(activation_budget: int) -> PassResult:
        inner = replace(ctx, options=replace(options, activation_budget=Budget(bytes=max(1, activation_budget))),
                        budget_strict=False)
        return run(program.snapshot(), inner)
    return plan
