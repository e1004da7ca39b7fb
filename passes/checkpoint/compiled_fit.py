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
        return PassResult(program, False, metrics=_metrics(target, source, before, None, []), notes=[
            f"checkpoint: compiled, the program saves {format_bytes(before)} for backward, within "
            f"{format_bytes(target)} ({source}); nothing recomputed"])
    tried = _bisect(plan, target, baseline_activations)
    fitting = [t for t in tried if t.saves <= target]
    best = max(fitting, key=lambda t: t.activation_budget) if fitting else min(tried, key=lambda t: t.saves)
    if strict:
        _require(best, target, source)
    result = best.result
    result.metrics.update(_metrics(target, source, before, best, tried))
    if not fitting:
        result.metrics["best_effort"] = "compiled_activations"
    how = (f"within {format_bytes(target)} ({source}); planned at the eager activation budget "
           f"{format_bytes(best.activation_budget)}, the largest of {len(tried)} tried whose compiled saves fit"
           if fitting else f"the lowest of {len(tried)} plans tried, above {format_bytes(target)} ({source})")
    result.notes.insert(0, f"checkpoint: planned for torch.compile: the result's compiled step saves "
                           f"{format_bytes(best.saves)} for backward ({format_bytes(before)} before), {how} "
                           f"(fxmem.costmodel.compiled_saves: the compiler's own partition)")
    return result


def _bisect(plan: Callable[[int], PassResult], target: int, baseline_activations: int) -> list[Tried]:
    """The plans tried: bisection over the eager activation budget in [0, the baseline's], at most STEPS, until
    the bracket is RESOLUTION of the baseline wide; the pass's lowest plan too when none fits."""
    tried: list[Tried] = []
    low, high = 0, baseline_activations
    while len(tried) < STEPS and high - low > RESOLUTION * baseline_activations:
        middle = (low + high) // 2
        tried.append(_try(plan, middle))
        low, high = (middle, high) if tried[-1].saves <= target else (low, middle)
    if all(t.saves > target for t in tried):
        tried.append(_try(plan, 1))  # the lowest plan the pass reaches
    return tried


def _require(best: Tried, target: int, source: str) -> None:
    """A strict budget: the compiled saves out of reach, or the peak budget missed by the plan that fits, is a
    BudgetError."""
    if best.saves > target:
        error = BudgetError(f"passes.checkpoint.compiled_activation_budget: the lowest plan's compiled step saves "
                            f"{format_bytes(best.saves)}, above {format_bytes(target)} ({source})")
        error.lowest = best.saves
        raise error
    if best.result.metrics.get("best_effort") == "peak":
        why = next((note for note in best.result.notes if note.startswith("checkpoint: budget")), "by its estimate")
        raise BudgetError(f"checkpoint: the plan whose compiled step fits {format_bytes(target)} misses the peak "
                          f"budget: {why}")


def _saves(program: Program) -> int:
    return compiled_saves(program.module, program.example_args, program.example_kwargs).total


def _try(plan: Callable[[int], PassResult], activation_budget: int) -> Tried:
    result = plan(activation_budget)
    return Tried(activation_budget, _saves(result.program), result)


def _metrics(target: int, source: str, before: int, best: Tried | None, tried: list[Tried]) -> dict:
    return {"compiled": {"target": target, "target_from": source, "saves_before": before,
                         "saves": before if best is None else best.saves,
                         "activation_budget": None if best is None else best.activation_budget,
                         "tried": [(t.activation_budget, t.saves) for t in tried]}}


def planner(run: Callable, program: Program, ctx) -> Callable[[int], PassResult]:
    """`plan(activation_budget)`: the pass (`run(program, ctx)`) on a copy of `program` at that eager activation
    budget, its compiled limit left out, the budget a target (the search brackets it)."""
    options = replace(ctx.options, compiled_activation_budget=None)

    def plan(activation_budget: int) -> PassResult:
        inner = replace(ctx, options=replace(options, activation_budget=Budget(bytes=max(1, activation_budget))),
                        budget_strict=False)
        return run(program.snapshot(), inner)
    return plan
