"""The Python API: `fxmem.transform(...)`, `TransformResult`, `fxmem.load(...)`."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from .capture import capture
from .errors import BudgetError, FxmemError
from .program import Program, deep_copy

SAVE_FORMAT = 1


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

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the result to a directory (atomically): the module, its readable code, weights, report."""
        return save_result(self, path, overwrite=overwrite)


def transform(model, args: Any = (), kwargs: dict | None = None, *, policy: Any = "high", budget: Any = None,
              activation_budget: Any = None, calibration=None, loss_fn=None, measure: bool = False,
              strict: bool = False, overrides=(), log=None, model_file=None, **option_overrides) -> TransformResult:
    """Capture `model`, run the policy's passes, return the transformed module and a report.

    policy: a preset name ("low", "medium", "high", "inference"), a YAML path, a dict with the policy schema, or
    a Policy. budget: bytes, or a size/fraction string ("4GiB", "40%"), overriding the policy's. activation_budget:
    the same for the activations kept at the end of forward (`passes.checkpoint.activation_budget`; the checkpoint
    pass is enabled for it; out of reach, it is an error unless the policy's budgets are targets). Extra keyword
    arguments override policy keys with dots written as double underscores, e.g.
    `passes__checkpoint__solver="greedy"`. measure=True also measures memory before and after with real steps.
    strict=True: a pass that fails or is rolled back, or a result over its budget (the estimate, and the measurement
    when measured, beyond the checkpoint pass's stated slack), raises instead of being reported.
    """
    from .costmodel import estimate
    from .pipeline import PassManager, load_passes
    from .policy import load_policy
    load_passes()  # passes register their option classes, so the policy validates their sections
    from .report import Report
    t0 = time.perf_counter()
    ov = list(overrides)
    for k, v in option_overrides.items():
        ov.append(f"{k.replace('__', '.')}={_yaml_scalar(v)}")
    if budget is not None:
        ov.append(f"budget={budget if isinstance(budget, str) else int(budget)}")
        ov.append("budget_strict=true")  # a budget the user asked for is a requirement, not a target
    if activation_budget is not None:
        ov.append("passes.checkpoint.enabled=true")
        ov.append("passes.checkpoint.activation_budget="
                  f"{activation_budget if isinstance(activation_budget, str) else int(activation_budget)}")
    pol = load_policy(policy, overrides=ov)
    if not isinstance(args, tuple):
        args = (args,) if not isinstance(args, list) else tuple(args)
    kwargs = dict(kwargs or {})
    if isinstance(model, Program):
        program = model
    else:
        program = capture(model, args, kwargs, mode=pol.mode)
    t_capture = time.perf_counter() - t0
    program.refresh()
    original = program.snapshot()
    before = estimate(program, mode=pol.mode, optimizer=pol.optimizer, loss_fn=loss_fn)
    if pol.budget is not None:
        b = pol.budget.resolve(before.peak) if hasattr(pol.budget, "resolve") else int(pol.budget)
        if b <= 0:
            raise BudgetError(f"budget resolves to {b} bytes; it must be positive")
    measured_before = _measure(program, pol, loss_fn) if measure else None
    pm = PassManager(pol, strict=strict, calibration=calibration, loss_fn=loss_fn, log=log,
                     model_file=model_file)
    t1 = time.perf_counter()
    result_program = pm.run(program, before)
    t_passes = time.perf_counter() - t1
    after = estimate(result_program, mode=pol.mode, optimizer=pol.optimizer, loss_fn=loss_fn)
    measured_after = _measure(result_program, pol, loss_fn) if measure else None
    result_program.module.train(pol.mode == "train")
    report = Report(
        model_name=program.model_name, policy=pol.to_dict(), mode=pol.mode, optimizer=pol.optimizer,
        before=before, after=after, measured_before=measured_before, measured_after=measured_after,
        passes=pm.records, code_before=_full_code(original.module), code_after=_full_code(result_program.module),
        specialized=[str(s) for s in program.specialized], notes=list(program.notes),
        budget=(pol.budget.resolve(before.peak) if pol.budget is not None and hasattr(pol.budget, "resolve")
                else None),
        versions={"fxmem": _version(), "torch": torch.__version__},
        timing={"capture_s": round(t_capture, 3), "passes_s": round(t_passes, 3),
                "total_s": round(time.perf_counter() - t0, 3)})
    if strict:
        _require_budgets(report, pm.records)
    return TransformResult(module=result_program.module, report=report, before=before, after=after,
                           program=result_program, original=original, policy=pol,
                           measured_before=measured_before, measured_after=measured_after, records=pm.records)


def _require_budgets(report, records) -> None:
    """strict: a result over its budget is an error, as a failed pass is. The checkpoint pass states its tolerance
    (`slack`, measured peak <= budget * (1 + slack)); the estimate, and the measurement when there is one, must be
    within it. (Without strict the report says OVER and the run succeeds: a policy's budget can be a target.)"""
    slack = next((float(r.metrics["slack"]) for r in records
                  if r.name == "checkpoint" and (r.metrics or {}).get("slack") is not None), 0.0)
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
        raise BudgetError("strict: the result is over its budget (" + "; ".join(misses)
                          + f"; tolerance {slack:.0%}). The report's notes say what each pass reached: run without "
                            "--strict to write it, raise the budget, or enable a pass that can take the rest")


def _yaml_scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def _version() -> str:
    from . import __version__
    return __version__


def _measure(program: Program, pol, loss_fn):
    """Measure a copy (measuring trains the module: the user's parameters must not change)."""
    from .measure import measure
    snap = deep_copy(program.module)
    return measure(snap, program.example_args, program.example_kwargs, mode=pol.mode, optimizer=pol.optimizer,
                   loss_fn=loss_fn)


def _full_code(gm: nn.Module) -> str:
    """The generated code of a GraphModule and of every GraphModule inside it, readable."""
    parts = []
    for name, mod in [("", gm)] + list(gm.named_modules())[1:]:
        if isinstance(mod, fx.GraphModule):
            title = f"# ---- {type(gm).__name__}" + (f".{name}" if name else "") + " ----"
            parts.append(title + "\n" + mod.code.strip() + "\n")
    return "\n".join(parts)


# ============================================================================================ save / load

def _plain_tensors(module: nn.Module):
    """(owner module, attr name, qualified name, tensor) for every plain parameter/buffer."""
    out = []
    for mname, mod in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for n, t in getattr(mod, kind).items():
                if t is None:
                    continue
                if type(t) in (torch.Tensor, nn.Parameter):
                    out.append((mod, kind, n, f"{mname}.{n}" if mname else n, t))
    return out


def save_result(result: TransformResult, path, *, overwrite: bool = False) -> Path:
    """Directory layout: module.pt (structure, tensors on meta), weights.safetensors (all plain tensors),
    transformed.py, original.py, manifest.json, and the report files. Written to a temp dir and renamed."""
    from safetensors.torch import save_file
    dest = Path(path)
    if dest.exists():
        nonempty = dest.is_file() or any(dest.iterdir())
        if nonempty and not overwrite:
            raise FxmemError(f"{dest}: already exists and is not empty; nothing was written (choose another "
                             "--out, or pass --overwrite to replace it atomically)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.fxmem-tmp-", dir=dest.parent))
    try:
        gm = result.module
        entries = _plain_tensors(gm)
        weights, seen = {}, {}
        for mod, kind, n, qual, t in entries:
            key = id(t)
            if key in seen:
                continue  # tied weights: stored once under the first name
            seen[key] = qual
            weights[qual] = t.detach().contiguous().cpu()
        save_file(weights, str(tmp / "weights.safetensors"))
        ties = {qual: seen[id(t)] for _, _, _, qual, t in entries if seen[id(t)] != qual}
        # pickle the structure with tensors swapped for meta tensors, then put the real ones back
        originals = []
        try:
            for mod, kind, n, qual, t in entries:
                meta = torch.empty_like(t, device="meta")
                if isinstance(t, nn.Parameter):
                    meta = nn.Parameter(meta, requires_grad=t.requires_grad)
                originals.append((mod, kind, n, t))
                getattr(mod, kind)[n] = meta
            from .serialize import save_module
            save_module(gm, tmp / "module.pt")
        finally:
            for mod, kind, n, t in originals:
                getattr(mod, kind)[n] = t
        (tmp / "transformed.py").write_text(_full_code(gm))
        (tmp / "original.py").write_text(_full_code(result.original.module))
        manifest = {"format": SAVE_FORMAT, "fxmem": _version(), "torch": torch.__version__,
                    "model": result.program.model_name, "mode": result.policy.mode,
                    "inputs": list(result.program.input_names), "ties": ties,
                    "module_sha256": _sha256(tmp / "module.pt"), "weights_sha256": _sha256(tmp / "weights.safetensors")}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if result.report is not None:
            result.report.save(tmp)
        if dest.exists():
            if dest.is_dir() and not any(dest.iterdir()):
                dest.rmdir()
            elif overwrite:
                backup = dest.with_name(dest.name + ".fxmem-old")
                os.replace(dest, backup)
                os.replace(tmp, dest)
                shutil.rmtree(backup, ignore_errors=True)
                return dest
        os.replace(tmp, dest)
        return dest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(path, *, map_location="cpu") -> fx.GraphModule:
    """Load a saved result's module.

    Loading runs code: the module structure is a pickle (like `torch.load(weights_only=False)`), so load only
    results you trust. Weights come from weights.safetensors; the module's integrity is checked against the
    manifest's hash first.
    """
    from safetensors.torch import load_file
    d = Path(path)
    man_p = d / "manifest.json"
    if not man_p.exists():
        raise FxmemError(f"{d}: not an fxmem result (no manifest.json)")
    manifest = json.loads(man_p.read_text())
    if manifest.get("format") != SAVE_FORMAT:
        raise FxmemError(f"{d}: saved with format {manifest.get('format')}, this fxmem reads {SAVE_FORMAT}")
    if _sha256(d / "module.pt") != manifest.get("module_sha256"):
        raise FxmemError(f"{d / 'module.pt'}: does not match the manifest's hash; refusing to load it")
    gm = torch.load(d / "module.pt", weights_only=False, map_location="cpu")
    weights = load_file(str(d / "weights.safetensors"), device=str(map_location))
    ties = manifest.get("ties", {})
    by_name = {qual: (mod, kind, n, t) for mod, kind, n, qual, t in _plain_tensors(gm)}
    for qual, (mod, kind, n, t) in by_name.items():
        src = weights.get(ties.get(qual, qual))
        if src is None:
            raise FxmemError(f"{d}: weights.safetensors has no tensor for {qual}")
        val = src.to(t.dtype)
        if isinstance(t, nn.Parameter):
            val = nn.Parameter(val, requires_grad=t.requires_grad)
        getattr(mod, kind)[n] = val
    # re-tie: tied names must share one tensor
    for qual, first in ties.items():
        mod, kind, n, _ = by_name[qual]
        fm, fk, fn, _ = by_name[first]
        getattr(mod, kind)[n] = getattr(fm, fk)[fn]
    gm.train(manifest.get("mode") == "train")
    return gm
