"""The Python API: `fxmem.transform(...)`, `TransformResult`, `fxmem.estimate(...)`, `fxmem.plan_batch(...)`,
`fxmem.load(...)`."""
from __future__ import annotations

import numbers
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

from . import __version__, costmodel
from .capture import capture
from .budgets import further_steps, planned_compiler_budget, require_reachable, stated_slack
from .compiled_budget import set_planned_budget
from .errors import BudgetError, StrictBudgetError
from .intent import require_intents
from .lossguard import make_evaluator
from .measure import measure as measure_memory
from .output_dir import save_result
from .pipeline import PassManager, load_passes
from .policy_loader import load_policy
from .program import Program, deep_copy
from .report import Report
from .result_write import full_code
from .resultdir import load_result
from .step import check_trainable
from .userstate import keeps_model_state


@dataclass
class TransformResult:
    module: fx.GraphModule
    report: Any
    before: Any  # MemoryEstimate of the captured, untransformed program
    after: Any  # MemoryEstimate of the result
    program: Program
    original: Program
    policy: Any
    measured_before: Any = None
    measured_after: Any = None
    records: list = field(default_factory=list)
    fit_summary: str = ""  # `fxmem.fit_batch`'s search, when the batch was fitted to the budget

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the result to a directory (atomically): the module, its readable code, weights, report."""
        return save_result(self, path, overwrite=overwrite)


# (fifteen parameters: the public transform's keyword options, each documented in its docstring)
@keeps_model_state
def transform(model, args: Any = (), kwargs: dict | None = None, *, policy: Any = "high", budget: Any = None,
              activation_budget: Any = None, calibration=None, loss_fn=None, evaluate=None, evaluate_mode=None,
              measure: bool = False, strict: bool = False, overrides=(), log=None, model_file=None,
              **option_overrides) -> TransformResult:
    """Capture `model`, run the policy's passes, return the transformed module and a report.

    policy: a preset name ("low", "medium", "high", "inference"), a YAML path, a dict with the policy schema, or
    a Policy. budget: bytes, a fraction (0.4) or a size/fraction string ("4GiB", "40%"), overriding the policy's;
    required: out of reach of the enabled passes it is a BudgetError naming the lowest peak reached and what would go
    further, unless `budget_strict=False` makes it a target (the result, the miss first in the report).
    activation_budget: the same for the activations kept at the end of forward
    (`passes.checkpoint.activation_budget`; the checkpoint pass is enabled for it; out of reach, it is an error
    unless the policy's budgets are targets). overrides: `--set` strings ("passes.checkpoint.solver=greedy"). Extra
    keyword arguments set policy keys to typed values, dots written as double underscores, e.g.
    `passes__checkpoint__solver="greedy"`. measure=True also measures memory before and after with real steps.
    calibration: model inputs (tensors, tuples of arguments, dicts of keyword arguments, or (args, kwargs) pairs)
    that pruning's statistics and the guard of lossy changes (`fxmem.lossguard`) run on. evaluate: the task metric,
    `evaluate(module) -> number`, as a model file's `evaluate()`; when given, it alone judges each lossy change
    (its drop at most verify.metric_tolerance). evaluate_mode: "max" when higher is better (the default), "min"
    when lower is better (a loss).
    strict=True: a pass that fails or is rolled back, a lossy pass that did less than the policy asked (an intent
    shortfall), or a result over its budget (the estimate, and the measurement when measured, beyond the checkpoint
    pass's stated slack), raises a StrictError (PassError, ShortfallError, StrictBudgetError; CLI exit 3) instead of
    being reported.
    """
    load_passes()  # passes register their option classes, so the policy validates their sections
    start = time.perf_counter()
    pol = _resolve_policy(policy, overrides, option_overrides, budget, activation_budget)
    evaluator = make_evaluator(evaluate, evaluate_mode, model_file)
    program = model if isinstance(model, Program) else _capture(model, args, kwargs, pol.mode)
    t_capture = time.perf_counter() - start
    program.refresh()
    if pol.mode == "train":  # a loss backward cannot run from is the user's error, said before any work
        check_trainable(program.module, program.example_args, program.example_kwargs, loss_fn,
                        _model_named(program, model_file))
    original = program.snapshot()
    before = costmodel.estimate(program, mode=pol.mode, optimizer=pol.optimizer, loss_fn=loss_fn)
    budget_bytes = _budget_bytes(pol, before)
    if budget_bytes is not None and budget_bytes <= 0:
        raise BudgetError(f"budget resolves to {budget_bytes} bytes; it must be positive")
    measured_before = _measure(program, pol, loss_fn) if measure else None
    manager = PassManager(pol, strict=strict, calibration=calibration, loss_fn=loss_fn, log=log,
                     model_file=model_file, evaluate=evaluator)
    passes_start = time.perf_counter()
    result_program = manager.run(program, before)
    t_passes = time.perf_counter() - passes_start
    after = costmodel.estimate(result_program, mode=pol.mode, optimizer=pol.optimizer, loss_fn=loss_fn)
    require_reachable(pol, budget_bytes, before, after, manager.records, result_program.module)
    measured_after = _measure(result_program, pol, loss_fn) if measure else None
    result_program.module.train(pol.mode == "train")
    set_planned_budget(result_program.module, planned_compiler_budget(manager.records))
    report = Report(
        model_name=program.model_name, policy=pol.to_dict(), mode=pol.mode, optimizer=pol.optimizer,
        before=before, after=after, measured_before=measured_before, measured_after=measured_after,
        passes=manager.records, code_before=full_code(original.module), code_after=full_code(result_program.module),
        specialized=[str(s) for s in program.specialized], notes=list(program.notes),
        budget=budget_bytes, budget_further=(further_steps(pol, after, result_program.module)
                                             if budget_bytes is not None and after.peak > budget_bytes else None),
        versions={"fxmem": __version__, "torch": torch.__version__},
        timing={"capture_s": round(t_capture, 3), "passes_s": round(t_passes, 3),
                "total_s": round(time.perf_counter() - start, 3)})
    if strict:
        require_intents(manager.records)
        _require_budgets(report, manager.records)
    return TransformResult(module=result_program.module, report=report, before=before, after=after,
                           program=result_program, original=original, policy=pol,
                           measured_before=measured_before, measured_after=measured_after, records=manager.records)


def _resolve_policy(policy, overrides, option_overrides: dict, budget, activation_budget):
    """The policy the call asks for: loaded with its `--set` overrides, then the keyword overrides and budgets
    applied as typed values."""
    pol = load_policy(policy, overrides=overrides)
    for keyword, value in option_overrides.items():
        pol = pol.with_overrides({keyword.replace("__", "."): value}, where=f"transform({keyword}=...)")
    if budget is not None:  # a budget the user asked for is a requirement unless the call makes it a target
        pol = pol.with_overrides({"budget": _whole_bytes(budget),
                                  "budget_strict": _budget_required(pol, overrides, option_overrides)},
                                 where="transform(budget=...)")
    if activation_budget is not None:
        pol = pol.with_overrides({"passes.checkpoint.enabled": True,
                                  "passes.checkpoint.activation_budget": _whole_bytes(activation_budget)},
                                 where="transform(activation_budget=...)")
    return pol


def _capture(model, args, kwargs, mode: str) -> Program:
    """`model` captured on its example inputs (a single argument or a list taken as the positional arguments)."""
    if not isinstance(args, tuple):
        args = (args,) if not isinstance(args, list) else tuple(args)
    return capture(model, args, dict(kwargs or {}), mode=mode)


def _model_named(program: Program, model_file) -> str:
    """How errors about the model name it: its model file when there is one, else its class."""
    path = getattr(model_file, "__file__", None)
    return str(path) if path else f"the model ({program.model_name})"


def _require_budgets(report, records) -> None:
    """strict: a result over its budget is an error, as a failed pass is. A budget pass (checkpoint) states its
    tolerance (`slack`, measured peak <= budget * (1 + slack)); the estimate, and the measurement when there is one,
    must be within it. (Without strict, a required budget the estimate misses is a BudgetError already
    (`fxmem.budgets`); a target's miss is reported and the run succeeds.)"""
    slack = stated_slack(records)
    misses = []
    if report.budget is not None:
        peaks = [report.after.peak] + ([report.measured_after.peak] if report.measured_after is not None else [])
        if max(peaks) > report.budget * (1 + slack):
            misses.append(report.budget_line())
    activation_budget = report.activation_budget()
    if activation_budget is not None:
        acts = [report.after.activations] + (
            [report.measured_after.activations] if report.measured_after is not None else [])
        if max(acts) > activation_budget * (1 + slack):
            misses.append(report.activation_budget_line())
    if misses:
        raise StrictBudgetError("strict: the result is over its budget (" + "; ".join(misses)
                          + f"; tolerance {slack:.0%}). The report's notes say what each pass reached: run without "
                            "--strict to write it, raise the budget, or enable a pass that can take the rest")


def _budget_required(pol, overrides, option_overrides) -> bool:
    """Whether `budget=` is required: yes, unless the same call sets `budget_strict` itself (a keyword override,
    or a `--set budget_strict=...` string), which `pol` already holds."""
    texts = [overrides] if isinstance(overrides, str) else list(overrides)
    named = "budget_strict" in option_overrides or any(
        str(text).partition("=")[0].strip() == "budget_strict" for text in texts)
    return pol.budget_strict if named else True


def _budget_bytes(pol, before) -> int | None:
    """The policy's budget in bytes (a fraction resolved against the baseline's peak), or None."""
    if pol.budget is None:
        return None
    return pol.budget.resolve(before.peak) if hasattr(pol.budget, "resolve") else int(pol.budget)


def _whole_bytes(value):
    """A budget argument as the policy reads it: any integer type as an int (bytes), anything else as given."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def _measure(program: Program, pol, loss_fn):
    """Measure a copy (measuring trains the module: the user's parameters must not change)."""
    snap = deep_copy(program.module)
    return measure_memory(snap, program.example_args, program.example_kwargs, mode=pol.mode,
                          optimizer=pol.optimizer, loss_fn=loss_fn)


def load(path, *, map_location="cpu", trust_code: bool = False) -> fx.GraphModule:
    """Load a saved result's module (a trainable GraphModule in the mode it was transformed for).

    Loading runs no pickle and no code from the result: the structure is JSON data (module.json) whose classes and
    call targets must be on fxmem's allow-list, weights come from weights.safetensors, and every file read is
    checked against the manifest's sha256 first. A damaged or changed result is an FxmemError naming the file.
    `trust_code=True` also loads results of older fxmem versions (formats 1-2), whose structure is a pickle:
    that runs code, like `torch.load(weights_only=False)`; use it only for results you trust.
    """
    return load_result(path, map_location=map_location, trust_code=trust_code)
