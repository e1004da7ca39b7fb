"""The PassManager: run the policy's passes in canonical order, re-validate and verify after each.

The pass contract (Pass, PassContext, PassResult, Change, PassRecord, register) is fxmem/pass_api.py; the table
of passes is fxmem/registry.py. The manager resolves what the user asked for once: each pass's options, validated,
and what passes share (budget and its strictness, the guard of lossy changes' settings, distribution mode, whether a
later pass takes the rest of the budget, the device, the user's evaluate) in its PassContext.

After each pass: lint, dead-code elimination, recompile, metadata refresh, re-estimate, verification on the
example inputs (eval mode, a seeded training step, the other mode's graph when the model has one). A failing exact
pass, or a lossy pass the guard of lossy changes refuses (`fxmem.lossguard`), is rolled back and the report says
why.
"""
from __future__ import annotations

import contextlib
import gc
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from . import costmodel
from .compare import (ACCURACY_FACTOR, Precision, compare_named, compare_outputs, deviation, dtype_name,
                      least_precise_of)
from .errors import FxmemError, PassError, PolicyError
from .lossguard import KIND_LIMITS, KIND_WORDS, GuardOptions, guard_for
from .nn.modes import mode_dispatch, mode_graph
from .pass_api import Change, DeviceInfo, PassContext, PassRecord, PassResult, register
from .program import Program, buffers_kept
from .registry import (CANONICAL_ORDER, LOAD_ERRORS, REGISTRY, Registration, budget_rest_taken, load_passes,
                       pass_class, pass_module)
from .shadow import float32_shadow, program_precision
from .step import compute_loss
from .units import format_bytes

# the manager's names that tests, benchmarks and tools import from here
__all__ = ["PassManager", "run_reference", "long_lived_frozen", "compare_grads", "compare_buffers", "Reference",
           "Change", "PassContext", "PassRecord", "PassResult", "register", "CANONICAL_ORDER", "REGISTRY",
           "LOAD_ERRORS", "load_passes", "pass_module"]


# ============================================================================================ verification
@dataclass
class Reference:
    outputs: Any
    grads: dict | None
    buffers: dict | None = None  # train-mode references: the buffers after the step (batch-norm statistics)
    # a program computing in bf16/fp16: that dtype, and the same run of its float32 shadow (`fxmem.shadow`), or why
    # the shadow did not run
    low_precision: torch.dtype | None = None
    shadow: Reference | None = None
    shadow_error: str | None = None

    def precision(self, got: Reference, field: str) -> Precision:
        """How `got`'s `field` (outputs, grads, buffers) is judged against this one's (`fxmem.compare.Precision`)."""
        low = least_precise_of([self.low_precision, got.low_precision])
        if low is None or self.shadow is None or got.shadow is None:
            return Precision(low)
        return Precision(low, getattr(self.shadow, field), getattr(got.shadow, field))

    def precision_words(self, got: Reference) -> str | None:
        """How the comparison with `got` judged low-precision values, for the report; None for float32 or wider."""
        precision = self.precision(got, "outputs")
        if precision.dtype is None:
            return None
        low = dtype_name(precision.dtype)
        if precision.ref_shadow is not None:
            return (f"{low}: the float32 shadows agree within the tolerances, and the {low} results are no further "
                    f"from float32 than {ACCURACY_FACTOR:g}x the previous program's plus one {low} rounding")
        why = self.shadow_error or got.shadow_error or "not run"
        return f"{low}: at torch.testing.assert_close's {low} tolerances or the policy's (float32 shadow: {why})"


@contextlib.contextmanager
def long_lived_frozen():
    """While passes run, the objects that existed before (the user's model, torch, the rest of the process) are
    out of the cyclic garbage collector's view (`gc.freeze`). Passes allocate many short-lived graph objects,
    which trigger full collections, and each full collection would otherwise walk the whole process heap: on a
    process holding a large model or compiled code that is a large part of a pass's time. Cyclic garbage the
    passes make is still collected. Nothing is done when something else has frozen objects already (unfreezing
    would undo it) or the collector is disabled."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_reference(program: Program, mode: str, loss_fn=None, seed: int = 0, want_grads: bool = True,
                  training: bool = False, shadow: bool = True) -> Reference:
    """Outputs (and parameter/input gradients in train mode) on the example inputs, deterministically.

    Runs in eval mode (dropout off, batch-norm from running statistics) so two programs can be compared
    exactly. `training`: the seeded training-mode step instead (forward and backward), the path eval mode does not
    take: dropout draws, batch statistics, checkpoint and offload regions (which only recompute or offload in
    training with autograd on); the buffers after the step are returned too. Buffers, `.grad`, the mode and the
    global RNG state are left as they were. A program computing in bf16/fp16 also runs its float32 shadow (`shadow`).
    """
    graph_module = program.module
    was = graph_module.training
    prev_grads = {name: param.grad for name, param in graph_module.named_parameters()}
    for param in graph_module.parameters():
        param.grad = None
    args, kwargs = program.example_args, program.example_kwargs
    graph_module.train(training)
    buffers = None
    try:
        with torch.random.fork_rng(devices=[]), buffers_kept(graph_module):
            torch.manual_seed(seed)
            if training or mode == "train" and want_grads:
                out = graph_module(*args, **kwargs)
                loss = compute_loss(loss_fn, out, args, kwargs)
                loss.backward()
                grads = {name: param.grad.detach().clone() for name, param in graph_module.named_parameters()
                         if param.grad is not None}
                out = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            else:
                with torch.no_grad():
                    out = graph_module(*args, **kwargs)
                grads = None
            if training:
                buffers = {name: buffer.detach().clone() for name, buffer in graph_module.named_buffers()}
    finally:
        for name, param in graph_module.named_parameters():
            param.grad = prev_grads.get(name)
        graph_module.train(was)
    ref = Reference(out, grads, buffers, low_precision=program_precision(program, out, grads))
    if shadow and ref.low_precision is not None:
        try:
            ref.shadow = run_reference(float32_shadow(program), mode, loss_fn, seed, want_grads, training, False)
        except Exception as error:  # noqa: BLE001 - then the dtype's tolerances judge (`fxmem.compare`)
            ref.shadow_error = f"{type(error).__name__}: {error}"
    return ref


def compare_references(ref: Reference, got: Reference, verify, *, buffers: bool = False) -> str | None:
    """How `got` differs from `ref` within the policy's verify tolerances: outputs, gradients (when both have them)
    and, with `buffers`, the buffers after a training step; each at the precision it was computed in."""
    err = compare_outputs(ref.outputs, got.outputs, atol=verify.atol, rtol=verify.rtol,
                          precision=ref.precision(got, "outputs"))
    if err is None and ref.grads is not None and got.grads is not None:
        err = compare_grads(ref.grads, got.grads, verify.grad_atol, verify.grad_rtol, ref.precision(got, "grads"))
    if err is None and buffers and ref.buffers:
        err = compare_buffers(ref.buffers, got.buffers or {}, verify.atol, verify.rtol, ref.precision(got, "buffers"))
    return err


def compare_grads(ref: dict, got: dict, atol: float, rtol: float, precision: Precision | None = None) -> str | None:
    return compare_named(ref, got, "gradient of {}", atol, rtol, required=True, precision=precision)


def compare_buffers(ref: dict, got: dict, atol: float, rtol: float, precision: Precision | None = None) -> str | None:
    """Buffers present in both after the step (a pass may add or drop its own)."""
    return compare_named(ref, got, "buffer {} after the step", atol, rtol, required=False, precision=precision)


# ============================================================================================ manager
class PassManager:
    """Runs enabled passes in canonical order with verification and rollback."""

    def __init__(self, policy, *, strict: bool = False, calibration=None, loss_fn=None,
                 log: Callable[[str], None] | None = None, model_file=None, evaluate=None):
        self.policy = policy
        self.evaluate = evaluate
        self.strict = strict
        self.calibration = calibration
        self.loss_fn = loss_fn
        self.log = log or (lambda msg: None)
        self._train_ref: Reference | None = None  # the current program's seeded training step (`_verify_train`)
        # outputs of the other mode's graph (`run_other_mode`): [the captured program's, the current program's]
        self._other_refs: list | None = None
        self.model_file = model_file
        self.records: list[PassRecord] = []

    def enabled_passes(self) -> list[str]:
        load_passes()
        names = []
        for name in CANONICAL_ORDER:
            sec = self.policy.passes.get(name)
            if sec is None or not sec.enabled:
                continue
            if pass_class(name) is None:
                why = (f"it failed to load ({LOAD_ERRORS[name]})" if name in LOAD_ERRORS else
                       "this pass is not implemented in this version of fxmem")
                available = sorted(n for n in CANONICAL_ORDER if pass_class(n) is not None)
                raise PolicyError(
                    f"{_src(self.policy, sec)} passes.{name}: {why} (available: {', '.join(available) or 'none'}); "
                    f"set passes.{name}.enabled: false")
            names.append(name)
        for name in sorted(self.policy.passes):
            if name not in CANONICAL_ORDER and self.policy.passes[name].enabled and pass_class(name) is not None:
                names.append(name)  # extra passes run after the canonical ones
        return names

    def run(self, program: Program, baseline) -> Program:
        # passes rewrite and evaluate the main graph, in whatever mode they run it: a program with one graph per mode
        # (`fxmem.nn.modes.ModeGraph`) does not switch graphs here; `_verify_other_mode` checks the other one
        with long_lived_frozen(), mode_dispatch(False):
            return self._run(program, baseline)

    def _run(self, program: Program, baseline) -> Program:
        names = self.enabled_passes()
        verify = self.policy.verify
        mode, optimizer = self.policy.mode, self.policy.optimizer
        original = run_reference(program, mode, self.loss_fn, verify.seed) if verify.enabled else None
        current_ref = original
        self._train_ref = self._train_step(program) if verify.enabled and mode == "train" else None
        self._other_refs = [run_other_mode(program, verify.seed)] * 2 if verify.enabled else None
        current_est = baseline
        for name in names:
            entry = REGISTRY[name]
            options = self.policy.section_options(name, entry.options) if entry.options is not None else None
            ctx = self._context(name, names, options, baseline, program)
            rec = PassRecord(name=name, status="unchanged", exact=entry.is_exact(options),
                             peak_before=current_est.peak)
            self.records.append(rec)
            started = time.perf_counter()
            result = self._run_pass(entry, program, ctx, rec, started)
            if result is None:
                continue
            new = result.program
            try:
                new.refresh()
            except Exception as error:  # noqa: BLE001
                self._rollback(rec, f"graph invalid after the pass: {type(error).__name__}: {error}", started)
                continue
            ok = self._verify(rec, new, original, current_ref, verify, started)
            if ok and not rec.exact and verify.enabled:
                ok = self._judge_lossy(rec, result.verdicts, ctx, program, new, started)
            if not ok:
                continue
            new_train = self._verify_train(rec, new, result.draws_differ, verify, started)
            if new_train is False:
                continue
            new_other = self._verify_other_mode(rec, new, verify, started, ctx, program)
            if new_other is False:
                continue
            est = costmodel.estimate(new, mode=mode, optimizer=optimizer, loss_fn=self.loss_fn)
            rec.peak_after = est.peak
            rec.status = "applied"
            rec.seconds = time.perf_counter() - started
            self.log(f"[{name}] applied: {len(rec.changes)} change(s), estimated peak "
                     f"{format_bytes(current_est.peak)} -> {format_bytes(est.peak)}")
            program, current_est = new, est
            if new_train is not None:
                self._train_ref = new_train
            if new_other is not None:
                self._other_refs[1] = new_other
            if verify.enabled:
                current_ref = run_reference(program, mode, self.loss_fn, verify.seed,
                                            want_grads=_grads_comparable(rec))
        return program

    # ------------------------------------------------------------------------------------------- helpers
    def _context(self, name: str, names: list[str], options, baseline, program: Program) -> PassContext:
        """What pass `name` is handed: its options and what passes share, derived from the policy."""
        policy = self.policy
        return PassContext(options=options, mode=policy.mode, optimizer=policy.optimizer,
                           budget=self._budget_for(options, baseline), baseline=baseline,
                           budget_strict=policy.budget_strict, guard=GuardOptions.from_verify(policy.verify),
                           distribution=policy.distribution, rest_taken=budget_rest_taken(names, after=name),
                           device=DeviceInfo.of(program), calibration=self.calibration, loss_fn=self.loss_fn,
                           log=self.log, seed=policy.verify.seed, model_file=self.model_file, evaluate=self.evaluate)

    def _run_pass(self, entry: Registration, program: Program, ctx: PassContext, rec: PassRecord,
                  started: float) -> PassResult | None:
        """Run one pass on a snapshot of `program` and record what it returned; None when there is nothing to
        verify (it failed, or changed nothing)."""
        self.log(f"[{entry.name}] running")
        candidate = program.snapshot()
        try:
            with buffers_kept(candidate.module):  # what a pass runs (calibration, guards) leaves them as given
                result = entry.pass_class().run(candidate, ctx)
        except FxmemError:
            raise
        except Exception as error:  # noqa: BLE001 - a pass bug must not lose the user's model
            rec.status, rec.reason = "failed", f"{type(error).__name__}: {error}"
            rec.notes.append(traceback.format_exc(limit=3))
            rec.seconds = time.perf_counter() - started
            self.log(f"[{entry.name}] failed and was rolled back: {rec.reason}")
            if self.strict:
                raise PassError(f"pass {entry.name} failed: {rec.reason}") from error
            return None
        rec.changes, rec.notes, rec.metrics = list(result.changes), list(result.notes), dict(result.metrics)
        rec.intents = [intent.to_dict() for intent in result.intents]
        if result.verdicts:
            rec.metrics["guard"] = [verdict.to_dict() for verdict in result.verdicts]
        if not result.modified:
            rec.reason = result.reason
            rec.seconds = time.perf_counter() - started
            self.log(f"[{entry.name}] no change")
            return None
        return result

    def _budget_for(self, options, baseline) -> int | None:
        """The pass's own `budget` option when it has one, else the policy's; in bytes of the baseline's peak."""
        budget = getattr(options, "budget", None) or self.policy.budget
        if budget is None:
            return None
        if isinstance(budget, int):
            return budget
        return int(budget.resolve(baseline.peak))

    def _rollback(self, rec: PassRecord, reason: str, started: float) -> None:
        rec.status, rec.reason = "rolled_back", reason
        rec.seconds = time.perf_counter() - started
        self.log(f"[{rec.name}] rolled back: {reason}")
        if self.strict:
            raise PassError(f"pass {rec.name} was rolled back: {reason}")

    def _verify(self, rec, new, original, current_ref, verify, started) -> bool:
        if not verify.enabled or original is None:
            return True
        mode = self.policy.mode
        exact = rec.exact
        got = run_reference(new, mode, self.loss_fn, verify.seed, want_grads=exact, shadow=exact)
        dev_orig = deviation(original.outputs, got.outputs)
        dev_prev = deviation(current_ref.outputs, got.outputs)
        rec.deviation = {"vs_original": dev_orig.to_dict(), "vs_previous": dev_prev.to_dict()}
        judged = current_ref.precision_words(got) if exact else None
        if judged:
            rec.deviation["precision"] = judged
        if exact:
            err = compare_outputs(current_ref.outputs, got.outputs, atol=verify.atol, rtol=verify.rtol,
                                  precision=current_ref.precision(got, "outputs"))
            if err is None and current_ref.grads is not None and got.grads is not None:
                err = compare_grads(current_ref.grads, got.grads, verify.grad_atol, verify.grad_rtol,
                                    current_ref.precision(got, "grads"))
                rec.grad_deviation = {"checked": len(current_ref.grads), "ok": err is None}
            if err is not None:
                self._rollback(rec, f"exact pass changed the result: {err}", started)
                return False
        return True

    def _judge_lossy(self, rec, verdicts: list, ctx, previous: Program, new: Program, started) -> bool:
        """A lossy pass is judged by the guard of lossy changes (`fxmem.lossguard`): on the verdicts the pass gave
        for what it kept, or, when it gave none, by the manager on its result (kind "lossy"). A refusal rolls it
        back."""
        if not verdicts:
            verdicts = [guard_for(ctx, previous, "lossy").judge(new)]
            rec.metrics["guard"] = [v.to_dict() for v in verdicts]
        refused = next((v for v in verdicts if not v.accepted), None)
        if refused is None:
            return True
        self._rollback(rec, f"the guard refused {KIND_WORDS.get(refused.kind, refused.kind)}: {refused.reason()} on "
                            f"{refused.data}; {refused.hint()}", started)
        return False


    def _train_step(self, program: Program) -> Reference | None:
        """The program's seeded training step, or None when it does not run (then no pass is compared in training
        mode; the eval-mode verification still holds)."""
        try:
            return run_reference(program, "train", self.loss_fn, self.policy.verify.seed, training=True)
        except Exception as error:  # noqa: BLE001 - the captured program's own step: not a pass's fault
            self.log(f"training-mode verification off: the captured program's training step raised "
                     f"{type(error).__name__}: {error}")
            return None

    def _verify_train(self, rec, new, draws_differ: bool, verify, started):
        """Run the seeded training step of the pass's result. A step that raises rolls the pass back (a pass whose
        result runs in eval mode but not in training is broken); an exact pass's outputs, gradients and buffers
        must then equal the previous program's step, unless the pass draws its random numbers differently
        (`PassResult.draws_differ`). Returns the new step's Reference, None when there is nothing to compare with,
        or False after a rollback."""
        if self._train_ref is None:
            return None
        try:
            got = run_reference(new, "train", self.loss_fn, verify.seed, training=True)
        except Exception as error:  # noqa: BLE001
            rec.train_check = {"compared": False, "ok": False, "why": f"the training step raised: {error}"}
            self._rollback(rec, f"the training-mode step fails after the pass: {type(error).__name__}: {error}",
                           started)
            return False
        if not rec.exact:
            rec.train_check = {"compared": False, "ok": True, "why": "lossy pass: the training step runs"}
            return got
        if draws_differ:
            rec.train_check = {"compared": False, "ok": True,
                               "why": "the pass draws dropout differently (same distribution): the training step "
                                      "runs; outputs and gradients compared in eval mode"}
            return got
        ref = self._train_ref
        err = compare_references(ref, got, verify, buffers=True)
        rec.train_check = {"compared": True, "ok": err is None, "checked": len(ref.grads or {})}
        if err is not None:
            rec.train_check["why"] = err
            self._rollback(rec, f"exact pass changed the training-mode step: {err}", started)
            return False
        return got


    def _verify_other_mode(self, rec, new, verify, started, ctx, previous: Program):
        """A program with one graph per mode: passes leave the other mode's graph as captured, but it reads the
        root's parameters and buffers, which a pass may replace. It must still run, and give the same outputs as
        before the pass (an exact pass) or be accepted by the guard of the pass's kind of change against them (a
        lossy one, output measures only). Returns its outputs, None when the program has no such graph, or False
        after a rollback."""
        if self._other_refs is None or self._other_refs[0] is None:
            return None
        branch = mode_graph(new.module)
        word = "train" if branch.serves_training else "eval"
        try:
            got = run_other_mode(new, verify.seed)
        except Exception as error:  # noqa: BLE001 - the pass broke what the other graph reads
            self._rollback(rec, f"the {word}-mode graph (the model reads self.training) fails after the pass: "
                                f"{type(error).__name__}: {error}", started)
            return False
        if rec.exact:
            err = compare_outputs(self._other_refs[1], got, atol=verify.atol, rtol=verify.rtol)
            why = f"exact pass changed the {word}-mode graph's result: {err}"
        else:
            verdict = _lossy_guard(ctx, previous, rec).judge_outputs([self._other_refs[1]], [got])
            err = None if verdict.accepted else verdict.reason()
            why = f"the {word}-mode graph after the pass: {err}; {verdict.hint()}"
        if err is not None:
            self._rollback(rec, why, started)
            return False
        return got


def _lossy_guard(ctx, previous: Program, rec: PassRecord):
    """The guard for a lossy pass's other checks: the loosest kind among the verdicts it recorded, else "lossy"."""
    kinds = [v.get("kind") for v in rec.guard_metrics().kept if v.get("kind") in KIND_LIMITS] or ["lossy"]
    kind = max(kinds, key=lambda k: KIND_LIMITS[k].rel_error)
    return guard_for(ctx, previous, kind)


def run_other_mode(program: Program, seed: int = 0):
    """Outputs of a program's other mode's graph (`fxmem.nn.modes.ModeGraph`) on the example inputs, without
    gradients and with a fixed seed, or None when it has none. Buffers, the mode and the RNG state are put back."""
    graph_module = program.module
    branch = mode_graph(graph_module)
    if branch is None:
        return None
    was = graph_module.training
    graph_module.train(branch.serves_training)
    try:
        with mode_dispatch(True), buffers_kept(graph_module), torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return graph_module(*program.example_args, **program.example_kwargs)
    finally:
        graph_module.train(was)


def _grads_comparable(rec: PassRecord) -> bool:
    return True


def _src(policy, sec) -> str:
    if getattr(sec, "where", None):
        return sec.where
    src = getattr(policy, "source", "<policy>")
    line = getattr(sec, "line", None)
    return f"{Path(str(src)).name}:{line}" if line else str(Path(str(src)).name)
