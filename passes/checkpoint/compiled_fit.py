"""Planning for the compiled step: `passes.checkpoint.compiled_activation_budget`.

A result that will run under torch.compile saves what inductor's partitioner decides: fxmem's recompute tags
honoured, the compiler's own min-cut on top (cheap pointwise ops recomputed for free), convolution weights saved as
channels-last copies. The eager plan's bytes are not that number, so a plan sized for eager saves keeps less or
more than asked once compiled. Here the compiled saves are the limit: the pass is planned at the largest eager
activation budget (bisection) whose result, compiled, saves no more than the target, both read off the compiler's
own partition (`fxmem.costmodel.compiled_saves`, before code generation). The target is bytes, or a fraction b:
what torch.compile alone saves at activation_memory_budget b (issue 33's stacked goal: no more bytes than compile@b,
at less recomputation, since fxmem's plan recomputes what its measured costs make cheapest). The result is exact
as the pass's every result is; planned once per bisection step (about eight).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from fxmem.costmodel import compiled_saves
from fxmem.errors import BudgetError
from fxmem.pass_api import PassResult
from fxmem.program import Program
from fxmem.units import Budget, format_bytes

# the bisection stops when the eager budgets it brackets are this share of the baseline's activations apart
RESOLUTION = 0.01
STEPS = 10  # at most this many plans


@dataclass
class Tried:
    """One plan of the search: the eager activation budget it was planned for, what its compiled step saves, the
    result."""
    activation_budget: int
    saves: int
    result: PassResult


def compiled_target(budget: Budget, program: Program) -> tuple[int, str]:
    """(bytes, how they were set): a byte budget itself; a fraction b, what torch.compile alone saves at
    activation_memory_budget b."""
    if budget.bytes is not None:
        return budget.bytes, "passes.checkpoint.compiled_activation_budget"
    saves = compiled_saves(program.module, program.example_args, program.example_kwargs,
                           activation_memory_budget=budget.fraction)
    return saves.total, f"torch.compile alone at activation_memory_budget {budget.fraction:g}"


def fit_compiled(plan: Callable[[int], PassResult], program: Program, baseline_activations: int,
                 budget: Budget, strict: bool) -> PassResult:
    """The result of `plan(activation_budget)` at the largest eager activation budget whose compiled step saves no
    more than `budget` asks (`compiled_target`); the program itself when its compiled step does already. Out of
    reach: a BudgetError when `strict`, else the lowest plan, saying so."""
    target, source = compiled_target(budget, program)
    before = _saves(program)
    if before <= target:
        return PassResult(program, False, metrics=_metrics(target, source, before, before, None, []), notes=[
            f"checkpoint: compiled, the program saves {format_bytes(before)} for backward, within "
            f"{format_bytes(target)} ({source}); nothing recomputed"])
    tried: list[Tried] = []
    low, high = 0, baseline_activations
    while len(tried) < STEPS and high - low > RESOLUTION * baseline_activations:
        middle = (low + high) // 2
        tried.append(_try(plan, middle))
        low, high = (middle, high) if tried[-1].saves <= target else (low, middle)
    fitting = [t for t in tried if t.saves <= target]
    if not fitting:
        tried.append(_try(plan, 1))  # the lowest plan the pass reaches
        fitting = [t for t in tried[-1:] if t.saves <= target]
    best = max(fitting, key=lambda t: t.activation_budget) if fitting else min(tried, key=lambda t: t.saves)
    trace = [(t.activation_budget, t.saves) for t in tried]
    if strict and not fitting:
        error = BudgetError(f"passes.checkpoint.compiled_activation_budget: the lowest plan's compiled step saves "
                            f"{format_bytes(best.saves)}, above {format_bytes(target)} ({source})")
        error.lowest = best.saves
        raise error
    result = best.result
    if strict and result.metrics.get("best_effort") == "peak":
        raise BudgetError(f"checkpoint: the plan whose compiled step fits {format_bytes(target)} misses the peak "
                          f"budget: " + next((n for n in result.notes if "budget" in n), "by its estimate"))
    result.metrics.update(_metrics(target, source, before, best.saves, best.activation_budget, trace))
    if not fitting:
        result.metrics["best_effort"] = "compiled_activations"
    verdict = "within" if fitting else "the lowest the pass reaches, above"
    result.notes.insert(0, f"checkpoint: planned for torch.compile: the result's compiled step saves "
                           f"{format_bytes(best.saves)} for backward ({format_bytes(before)} before), {verdict} "
                           f"{format_bytes(target)} ({source}); planned at the eager activation budget "
                           f"{format_bytes(best.activation_budget)}, the largest of {len(tried)} tried whose compiled "
                           f"saves fit (fxmem.costmodel.compiled_saves: the compiler's own partition)")
    return result


def _saves(program: Program) -> int:
    return compiled_saves(program.module, program.example_args, program.example_kwargs).total


def _try(plan: Callable[[int], PassResult], activation_budget: int) -> Tried:
    result = plan(activation_budget)
    return Tried(activation_budget, _saves(result.program), result)


def _metrics(target: int, source: str, before: int, after: int, activation_budget: int | None,
             trace: list) -> dict:
    return {"compiled": {"target": target, "target_from": source, "saves_before": before, "saves": after,
                         "activation_budget": activation_budget, "tried": trace}}


def planner(run: Callable, program: Program, ctx) -> Callable[[int], PassResult]:
    """`plan(activation_budget)`: the pass (`run(program, ctx)`) on a copy of `program` at that eager activation
    budget, its compiled limit left out, the budget a target (the search brackets it)."""
    options = replace(ctx.options, compiled_activation_budget=None)

    def plan(activation_budget: int) -> PassResult:
        inner = replace(ctx, options=replace(options, activation_budget=Budget(bytes=max(1, activation_budget))),
                        budget_strict=False)
        return run(program.snapshot(), inner)
    return plan
