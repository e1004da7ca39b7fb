"""The Python API: `fxmem.transform(...)`, `TransformResult`, `fxmem.estimate(...)`, `fxmem.plan_batch(...)`,
`fxmem.load(...)`."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import numbers
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from . import __version__, costmodel
from .capture import capture
from .budgets import further_steps, require_reachable, stated_slack
from .errors import BudgetError, FxmemError, StrictBudgetError
from .files import write_text, writing
from .intent import require_intents
from .lossguard import make_evaluator
from .measure import measure as measure_memory
from .nn.lowbit import QuantLinear
from .nn.offload import WeightStreamer
from .pipeline import PassManager, load_passes
from .policy_loader import load_policy
from .program import Program, deep_copy
from .report import Report
from .resultdir import RESULT_KIND, STRUCTURE, WEIGHTS, load_result, write_manifest
from .staging import claim_scratch, release_scratch, remove_abandoned
from .staging import remove_path as _remove_path
from .step import check_trainable
from .structure import describe, format_code, generated_code
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
    t0 = time.perf_counter()
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
    evaluator = make_evaluator(evaluate, evaluate_mode, model_file)
    if not isinstance(args, tuple):
        args = (args,) if not isinstance(args, list) else tuple(args)
    kwargs = dict(kwargs or {})
    if isinstance(model, Program):
        program = model
    else:
        program = capture(model, args, kwargs, mode=pol.mode)
    t_capture = time.perf_counter() - t0
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
    pm = PassManager(pol, strict=strict, calibration=calibration, loss_fn=loss_fn, log=log,
                     model_file=model_file, evaluate=evaluator)
    t1 = time.perf_counter()
    result_program = pm.run(program, before)
    t_passes = time.perf_counter() - t1
    after = costmodel.estimate(result_program, mode=pol.mode, optimizer=pol.optimizer, loss_fn=loss_fn)
    require_reachable(pol, budget_bytes, before, after, pm.records, result_program.module)
    measured_after = _measure(result_program, pol, loss_fn) if measure else None
    result_program.module.train(pol.mode == "train")
    report = Report(
        model_name=program.model_name, policy=pol.to_dict(), mode=pol.mode, optimizer=pol.optimizer,
        before=before, after=after, measured_before=measured_before, measured_after=measured_after,
        passes=pm.records, code_before=_full_code(original.module), code_after=_full_code(result_program.module),
        specialized=[str(s) for s in program.specialized], notes=list(program.notes),
        budget=budget_bytes, budget_further=(further_steps(pol, after, result_program.module)
                                             if budget_bytes is not None and after.peak > budget_bytes else None),
        versions={"fxmem": __version__, "torch": torch.__version__},
        timing={"capture_s": round(t_capture, 3), "passes_s": round(t_passes, 3),
                "total_s": round(time.perf_counter() - t0, 3)})
    if strict:
        require_intents(pm.records)
        _require_budgets(report, pm.records)
    return TransformResult(module=result_program.module, report=report, before=before, after=after,
                           program=result_program, original=original, policy=pol,
                           measured_before=measured_before, measured_after=measured_after, records=pm.records)


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
    ab = report.activation_budget()
    if ab is not None:
        acts = [report.after.activations] + (
            [report.measured_after.activations] if report.measured_after is not None else [])
        if max(acts) > ab * (1 + slack):
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


def _full_code(gm: nn.Module) -> str:
    """The generated code of a GraphModule and of every GraphModule inside it, readable."""
    return format_code(type(gm).__name__, [(name, mod.code) for name, mod in [("", gm)] + list(gm.named_modules())[1:]
                                           if isinstance(mod, fx.GraphModule)])


# ============================================================================================ save / load

def _quantized_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) for every bitsandbytes layer wrapper (`fxmem.nn.lowbit.QuantLinear`): their weights
    are bitsandbytes parameters with state outside the tensor, saved by `quantized_state()`, not as plain tensors."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, QuantLinear)]


def _unsaveable(module: nn.Module) -> str | None:
    """Why `module` cannot be saved (a one-line reason for an FxmemError), or None. Checked before anything is
    written: a module holding a WeightStreamer (weight offload: its weights live in a scratch file, and the hooks
    that make its owner's state_dict see them are local functions), or any module whose `__getstate__` refuses."""
    for name, mod in module.named_modules():
        where = f"{name or '<root>'} ({type(mod).__name__})"
        if isinstance(mod, WeightStreamer):
            return (f"results with weight offload (passes.offload.weights) cannot be saved: {where} streams "
                    "frozen weights from a scratch file that exists only while this process runs; run the "
                    "transform where the model is used (fxmem.transform), or save the weights with "
                    "torch.save(result.module.state_dict(), ...) (it holds the streamed weights under their "
                    "original names)")
        getstate = getattr(type(mod), "__getstate__", None)
        if getstate is not None and getstate is not nn.Module.__getstate__:
            try:
                getstate(mod)
            except Exception as e:  # noqa: BLE001  (the module's own refusal: say it)
                return f"{where} cannot be saved: {e}"
    return None


# what a result held before its manifest listed its files ("files"); such results are recognised by their keys
_LEGACY_RESULT_FILES = frozenset({"module.pt", "weights.safetensors", "transformed.py", "original.py", "manifest.json",
                                  "report.md", "report.html", "report.json", "memory_timeline.png",
                                  "memory_timeline.svg"})


def save_result(result: TransformResult, path, *, overwrite: bool = False) -> Path:
    """Directory layout: module.json (the module structure and graphs as data, `fxmem.structure`),
    weights.safetensors (every parameter and buffer), transformed.py (the code module.json generates), original.py,
    the report files, and manifest.json (written last: it lists the files with their sha256 and marks the directory as
    a result fxmem wrote). Written to a temp dir beside `path` and renamed into place. Quantized linears
    (`fxmem.nn.lowbit.QuantLinear`) keep their bitsandbytes weights and quantization state as tensors in
    weights.safetensors and JSON fields in module.json ("quantized"). `fxmem.load` reads it without running pickles.

    An existing `path` is replaced only when it is an empty directory, or a result fxmem wrote and `overwrite=True`;
    never a file, a link, a directory holding anything else, or the current working directory. See `OutputDir`.
    A result that cannot be saved (weight offload) is an FxmemError before anything is written."""
    why = _unsaveable(result.module)
    if why is not None:
        raise FxmemError(f"{os.fspath(path)}: {why}; nothing was written")
    with OutputDir(path, overwrite=overwrite) as out:
        return out.write(result)


class OutputDir:
    """Where a result goes, checked and reserved before any work, so a run that cannot write its result fails in a
    second rather than after the transform.

    The target must be a new path, an empty directory, or (with `overwrite`) a result written by fxmem that holds
    only files fxmem wrote; it must not be a file or a symbolic link, be or contain the current working directory,
    or contain one of `protect` (`(label, path)` pairs: the model file, the policy file). Missing parent directories
    are created, and a hidden scratch directory `.NAME.fxmem-tmp-*` beside the target (same file system, so the
    final move is a rename) proves the place writable; the ones earlier runs to the same target left behind (killed
    by SIGKILL, a crash) are removed first, never a live run's (`fxmem.staging`). `write` fills it and moves the
    result into place: the swap with a previous result is atomic (an exchange where the system has one), and
    SIGINT/SIGTERM are held back during it, so the target is always the old result or the new one. `discard` (also
    on leaving a `with` block) removes the scratch directory and the parents this object created unless the result
    was written. Errors are `FxmemError`s naming the path, one line each (a failed write names the file)."""

    def __init__(self, path, *, overwrite: bool = False, protect=()):
        self.given = os.fspath(path)
        self.overwrite = bool(overwrite)
        self.protect = [(label, os.fspath(p)) for label, p in protect]
        self.committed = False  # the result is in place
        self.staging: Path | None = None
        self._created: list[Path] = []  # parent directories made here (removed again if nothing is written)
        self._keep_staging = False  # it holds the previous result (a failed swap could not put it back)
        self._claim: int | None = None  # the locked marker file of the scratch directory (see fxmem.staging)
        self.shown = self.given
        if not self.given.strip():
            raise FxmemError("--out: the output path is empty; nothing was written")
        if os.path.islink(self.given):
            raise self._error(f"is a symbolic link (to {os.readlink(self.given)}); fxmem writes a new directory or "
                              "replaces one it wrote, never a link: give a new path")
        self.dest = Path(os.path.realpath(self.given))
        if os.path.abspath(self.given) != str(self.dest):
            self.shown = f"{self.given} (= {self.dest})"
        try:
            self._check_name()
            self._check()
            self._was_new = not (self.dest.is_dir() and os.listdir(self.dest))  # absent or empty now
        except OSError as e:  # a path the system cannot look at (too long, a loop of links, no permission)
            raise self._error(f"cannot use it: {e.strerror or e}") from None
        self._reserve()

    # ------------------------------------------------------------------------------------------- checks
    def _error(self, why: str, *, nothing: bool = True) -> FxmemError:
        return FxmemError(f"{self.shown}: {why}" + ("; nothing was written" if nothing else ""))

    def _check(self) -> None:
        """The target as it is now (run again just before the result is moved into place)."""
        dest = self.dest
        if dest.parent == dest:
            raise self._error("is the root of the file system")
        if os.path.islink(dest):  # appeared since
            raise self._error("is a symbolic link; fxmem writes a new directory or replaces one it wrote, never a link")
        if os.path.lexists(dest) and not dest.is_dir():
            raise self._error("is a file, not a directory; fxmem writes a result directory, and replaces only one it "
                              "wrote (choose another --out)")
        try:
            cwd = Path(os.getcwd()).resolve()
        except OSError:  # the working directory was removed
            cwd = None
        if cwd is not None and dest == cwd:
            raise self._error("is the current working directory; fxmem never replaces it (choose a new directory)")
        if cwd is not None and dest in cwd.parents:
            raise self._error(f"contains the current working directory ({cwd}); fxmem never replaces it "
                              "(choose a new directory)")
        for label, p in self.protect:
            rp = Path(os.path.realpath(p))
            if dest == rp or dest in rp.parents:
                raise self._error(f"contains {label} {p}; fxmem never replaces it (choose a new directory)")
        if not dest.is_dir():
            return
        try:
            entries = sorted(os.listdir(dest))
        except OSError as e:
            raise self._error(f"cannot read it: {e.strerror or e}") from None
        if not entries:
            return  # an empty directory is taken as it is
        foreign = _not_an_fxmem_result(dest, entries)
        if not self.overwrite:
            if foreign is None:
                raise self._error("already exists (a result written by fxmem); nothing was written (choose another "
                                  "--out, or pass --overwrite to replace it atomically)", nothing=False)
            raise self._error(f"already exists and is not empty, and {foreign}; nothing was written (choose another "
                              "--out: --overwrite replaces only a result written by fxmem)", nothing=False)
        if foreign is not None:
            raise self._error(f"{foreign}; --overwrite replaces only a result written by fxmem or an empty "
                              "directory (choose another --out)")

    def _check_name(self) -> None:
        """The parent's nearest existing directory, and a name that file system takes."""
        existing = self.dest.parent
        while not os.path.lexists(existing):
            existing = existing.parent
        if not existing.is_dir():
            raise self._error(f"{existing} is not a directory")
        try:
            name_max = os.pathconf(existing, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):
            name_max = 255
        n = len(os.fsencode(self.dest.name))
        if name_max and name_max > 0 and n > name_max:
            raise self._error(f"the name is too long ({n} bytes; this file system allows {name_max})")

    def _reserve(self) -> None:
        parent, name = self.dest.parent, self.dest.name
        missing = []
        p = parent
        while not os.path.lexists(p):
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if d.is_dir():
                    continue  # made by someone else meanwhile
                self.discard()
                raise self._error(f"{d} is not a directory") from None
            except OSError as e:
                self.discard()
                raise self._error(f"cannot create the directory {d}: {e.strerror or e}") from None
            self._created.append(d)
        remove_abandoned(parent, name)  # what earlier runs to this output left (killed by SIGKILL, ...)
        try:
            self.staging, self._claim = claim_scratch(parent, name)
        except OSError as e:
            self.discard()
            raise self._error(f"cannot write in {parent}: {e.strerror or e}") from None

    # ------------------------------------------------------------------------------------------- writing
    def write(self, result: TransformResult) -> Path:
        """Write `result` into the scratch directory and move it into place; return the target."""
        if self.staging is None or self.committed:
            raise RuntimeError("OutputDir.write: this output was already written or discarded")
        new = self.staging / "result"
        try:
            new.mkdir()
            _write_result_files(result, new)
        except OSError as e:  # a full disk, a quota, a read-only file system (`files.writing` names the file)
            raise self._error(f"writing the result failed{_written_file(e, new)}: {e.strerror or e}") from e
        with _signals_deferred():  # a signal during the swap is handled once the scratch directory is gone too
            self._commit(new)
            self.discard()
        return self.dest

    def _commit(self, new: Path) -> None:
        with _signals_deferred():
            try:
                self._check()  # the target may have changed during the run (another run, the user)
            except FxmemError:
                if self._was_new and os.path.lexists(self.dest):
                    raise self._error("was created by another process while fxmem ran (another fxmem run with the "
                                      "same --out?)") from None
                raise
            except OSError as e:
                raise self._error(f"cannot use it: {e.strerror or e}") from None
            dest = self.dest
            if dest.is_dir() and os.listdir(dest):
                self._swap(new, dest)  # a result fxmem wrote, with --overwrite (else _check raised)
            else:
                try:
                    os.replace(new, dest)  # a new path, or an empty directory (replaced by the rename)
                except OSError as e:
                    if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                        raise self._error("was created by another process while fxmem ran (another fxmem run "
                                          "with the same --out?)") from None
                    raise self._error(f"cannot move the result into place: {e.strerror or e}") from None
            self.committed = True

    def _swap(self, new: Path, dest: Path) -> None:
        """Replace the result at `dest` by `new`; the previous one ends up in the scratch directory (removed next)."""
        try:
            if _exchange(new, dest):
                return  # atomic: `new` now holds the previous result
        except OSError as e:
            raise self._error(f"cannot replace it: {e.strerror or e}") from None
        old = self.staging / "previous"
        try:
            os.replace(dest, old)
        except OSError as e:
            raise self._error(f"cannot move the previous result aside: {e.strerror or e}") from None
        try:
            os.replace(new, dest)
        except BaseException as e:
            try:
                os.replace(old, dest)  # put the previous result back
            except OSError as e2:
                self._keep_staging = True
                raise self._error(f"cannot move the result into place ({e}), nor the previous result back "
                                  f"({e2.strerror or e2}): the previous result is in {old}", nothing=False) from None
            if isinstance(e, OSError):
                raise self._error(f"cannot move the result into place: {e.strerror or e}") from None
            raise

    def discard(self) -> None:
        """Remove the scratch directory (and, unless the result was written, the parents created for it)."""
        with _signals_deferred():
            if self.staging is not None and not self._keep_staging:
                _remove_path(self.staging)
                self.staging = None
            if self._claim is not None:
                release_scratch(self._claim, self.staging if self._keep_staging else None)
                self._claim = None
            if not self.committed:
                for d in reversed(self._created):
                    try:
                        os.rmdir(d)
                    except OSError:
                        break
            self._created = []

    def __enter__(self) -> "OutputDir":
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


def _written_file(e: OSError, result_dir: Path) -> str:
    """" at NAME" for the file of the result that `e` names (its path inside the result), "" when it names none."""
    if not isinstance(e.filename, str):
        return ""
    try:
        return f" at {Path(e.filename).relative_to(result_dir)}"
    except ValueError:
        return f" at {e.filename}"


def _not_an_fxmem_result(d: Path, entries: list[str]) -> str | None:
    """None when `d` is a result fxmem wrote holding only the files it wrote; else why not (for a message)."""
    if "manifest.json" not in entries:
        return "it is not a result written by fxmem (no manifest.json)"
    try:
        man = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        man = None
    if not isinstance(man, dict):
        return "its manifest.json was not written by fxmem"
    if man.get("kind") == RESULT_KIND and isinstance(man.get("files"), list):
        files = {str(f) for f in man["files"]}
    elif isinstance(man.get("fxmem"), str) and "format" in man and "module_sha256" in man:
        files = set(_LEGACY_RESULT_FILES)  # written before manifests listed their files
    else:
        return "its manifest.json was not written by fxmem"
    files.add("manifest.json")
    extra = [e for e in entries if e not in files or os.path.islink(d / e) or not (d / e).is_file()]
    if extra:
        shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
        return f"it holds {len(extra)} entr{'y' if len(extra) == 1 else 'ies'} fxmem did not write ({shown})"
    return None


def _write_result_files(result: TransformResult, d: Path) -> None:
    from safetensors.torch import save_file
    gm = result.module
    why = _unsaveable(gm)  # (OutputDir.write comes here directly: the CLI; it removes its scratch directory)
    if why is not None:
        raise FxmemError(f"{why}; nothing was written")
    # quantized linears: their bitsandbytes weight and state as tensors + JSON fields; taken out of the modules
    # while the structure and its plain tensors are described
    quant_weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    quant_mods = _quantized_modules(gm)
    for qual, mod in quant_mods:
        try:
            tensors, fields = mod.quantized_state()
        except ValueError as e:
            raise FxmemError(f"cannot save the quantized layer {qual}: {e}; nothing was written") from None
        for k, t in tensors.items():
            quant_weights[f"{qual}.{k}"] = t.detach().contiguous().cpu()
        quantized[qual] = fields
    with contextlib.ExitStack() as stack:
        for _, mod in quant_mods:
            stack.enter_context(mod.without_quantized_state())
        try:
            doc, weights = describe(gm, mode=result.policy.mode, quantized=quantized)
            code = generated_code(doc)  # what loading will generate: checks the description as loading does
        except ValueError as e:
            raise FxmemError(f"cannot save the result: {e}; nothing was written") from None
    expected = _full_code(gm)
    if code != expected:  # the description would load as another module: a bug, never written
        line = next((f"{a!r} != {b!r}" for a, b in zip(code.splitlines(), expected.splitlines()) if a != b), "")
        raise RuntimeError(f"the saved description of the module does not generate the module's code ({line})")
    clash = sorted(set(weights) & set(quant_weights))
    if clash:
        raise FxmemError(f"cannot save: {clash[0]} names both a tensor and a quantized layer's state")
    weights.update(quant_weights)
    with writing(d / WEIGHTS):
        save_file(weights, str(d / WEIGHTS))
    write_text(d / STRUCTURE, json.dumps(doc, indent=1) + "\n")
    write_text(d / "transformed.py", code)
    write_text(d / "original.py", _full_code(result.original.module))
    if result.report is not None:
        result.report.save(d)
    write_manifest(d, {"fxmem": __version__, "torch": torch.__version__, "model": result.program.model_name,
                       "mode": result.policy.mode, "inputs": list(result.program.input_names)})


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT and SIGTERM back for a short critical section (renames, removing scratch files): a signal that
    arrives is noted and handled as usual when the section ends, so an interrupt never lands between two renames.
    Python handlers run in the main thread whichever thread the signal reached, so swapping the handlers (rather
    than masking the signal in this thread) holds with the worker threads torch starts. Elsewhere than the main
    thread a signal does not interrupt Python code anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old: dict = {}

    def note(signum, frame):
        pending.append(signum)

    try:
        for s in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
            if s is None:
                continue
            h = signal.getsignal(s)
            if h is None:  # installed outside Python: cannot be put back, leave it
                continue
            old[s] = h
            signal.signal(s, note)
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for s in dict.fromkeys(pending):
            h = old[s]
            if callable(h):
                h(s, None)  # e.g. raises KeyboardInterrupt
            elif h == signal.SIG_DFL:
                signal.raise_signal(s)  # the default action (terminate), now that the section is done


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE): even a crash leaves one or the other in
    place. False where the system or the file system has no such call (then two renames, with signals held back)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def load(path, *, map_location="cpu", trust_code: bool = False) -> fx.GraphModule:
    """Load a saved result's module (a trainable GraphModule in the mode it was transformed for).

    Loading runs no pickle and no code from the result: the structure is JSON data (module.json) whose classes and
    call targets must be on fxmem's allow-list, weights come from weights.safetensors, and every file read is
    checked against the manifest's sha256 first. A damaged or changed result is an FxmemError naming the file.
    `trust_code=True` also loads results of older fxmem versions (formats 1-2), whose structure is a pickle:
    that runs code, like `torch.load(weights_only=False)`; use it only for results you trust.
    """
    return load_result(path, map_location=map_location, trust_code=trust_code)
