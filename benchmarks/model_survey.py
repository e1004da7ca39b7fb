"""The model survey: fxmem's checkpoint pass on models nobody here wrote (`survey_models.py`: transformers,
torch_geometric and torch.nn classes, small random configs).

    python benchmarks/model_survey.py                  # every model, each in its own process (about an hour)
    python benchmarks/model_survey.py phi lstm_lm      # some of them
    python benchmarks/model_survey.py --table          # the table again from the saved per-model results

Per model, two checks:
- every remat site the pass finds applied at once, for the three site sets (plain; with matrix-product sites;
  with softmax sites too): the planned activations and peak (`as_planned`) equal those traced on the rewritten
  program, the traced activations equal `fxmem.measure`'s, and one training step is bit-identical to the
  original's (outputs and gradients); where it is not, the capture and the rewrite are compared apart;
- `fxmem.transform` with `activation_budget: 40%` and measure=True: measured activations before and after against
  the budget, the estimate after beside the measured, gradients equal to the original's.

A cost-model or remat change should leave every row OK (a row names what differs otherwise). Results:
benchmarks/results/model_survey.md, per-model JSON under benchmarks/results/model_survey/. The script imports
fxmem from the checkout it is in (not an editable install elsewhere), so a second checkout of another commit
surveys that commit. Each model runs under a timeout of PER_MODEL_S seconds.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "results" / "model_survey"
TABLE = HERE / "results" / "model_survey.md"
PER_MODEL_S = 600
SITE_SETS = [(False, False), (True, False), (True, True)]  # (products, scores) for remat_sites
BUDGET = "40%"


def _import_from_root() -> None:
    """fxmem, its passes and tests from ROOT: an editable install's finder (which maps fxmem to its own checkout)
    is taken off sys.meta_path and ROOT put first on sys.path."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                        and "editable" not in getattr(f, "__name__", "")]
    sys.path[:0] = [str(ROOT), str(HERE)]
    from fxmem.registry import _passes_package
    _passes_package()  # fxmem.passes from ROOT/passes (the tests import fxmem.passes.checkpoint directly)


def _setup() -> None:
    warnings.filterwarnings("ignore")
    _import_from_root()
    import torch
    import transformers
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()


def site_set(build, products: bool, scores: bool) -> dict:
    """Every site applied: planned, traced and measured, and the step against the original's."""
    import fxmem
    from tests.conftest import step_difference
    from tests.test_remat_planned import _every_site_applied
    model, args, kwargs, loss_fn = build()
    kwargs = kwargs or {}
    started = time.time()
    program, sites, before, planned, traced = _every_site_applied(model, args, kwargs, loss_fn, products, scores)
    measured = fxmem.measure(copy.deepcopy(program.module), args, kwargs, loss_fn=loss_fn)
    row = {"products": products, "scores": scores, "sites": len(sites), "before_act": before.activations,
           "planned_act": planned.activations, "planned_peak": planned.peak, "traced_act": traced.activations,
           "traced_peak": traced.peak, "measured_act": measured.activations}
    fails = []
    if (planned.activations, planned.peak) != (traced.activations, traced.peak):
        fails.append(f"planned - traced: activations {planned.activations - traced.activations:+,d} B, peak "
                     f"{planned.peak - traced.peak:+,d} B")
    if traced.activations != measured.activations:
        fails.append(f"traced - measured: activations {traced.activations - measured.activations:+,d} B")
    difference = step_difference(model, program.module, args, kwargs, loss_fn)
    if difference:
        captured = fxmem.capture(copy.deepcopy(model), args, kwargs)
        fails.append(f"step not bit-identical: {difference} [capture against the original: "
                     f"{step_difference(model, captured.module, args, kwargs, loss_fn) or 'identical'}; rewrite "
                     f"against the capture: "
                     f"{step_difference(captured.module, program.module, args, kwargs, loss_fn) or 'identical'}]")
    row["fails"] = fails
    row["seconds"] = round(time.time() - started, 1)
    return row


def transform_at_budget(build) -> dict:
    """`fxmem.transform` at activation_budget BUDGET, measured, its gradients against the original's."""
    import fxmem
    from tests.conftest import step_difference
    model, args, kwargs, loss_fn = build()
    started = time.time()
    result = fxmem.transform(copy.deepcopy(model), args, kwargs, loss_fn=loss_fn, measure=True,
                             policy={"version": 1, "passes": {"checkpoint": {"activation_budget": BUDGET}}})
    report = result.report
    before = report.measured_before.activations if report.measured_before is not None else None
    record = next(r for r in report.passes if r.name == "checkpoint")
    return {"measured_before_act": before,
            "measured_after_act": report.measured_after.activations if report.measured_after is not None else None,
            "target": int(float(BUDGET.rstrip("%")) / 100 * before) if before is not None else None,
            "estimated_after_act": result.after.activations, "status": getattr(record, "status", None),
            "reason": getattr(record, "reason", None),
            "step": step_difference(model, result.module, args, kwargs or {}, loss_fn),
            "seconds": round(time.time() - started, 1)}


def survey_one(name: str) -> None:
    """One model, in this process: OUT/<name>.json, written after each check (a timeout keeps what was done)."""
    _setup()
    from survey_models import MODELS
    build = MODELS[name]
    result = {"model": name, "site_sets": [], "transform": None}
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    for products, scores in SITE_SETS:
        try:
            row = site_set(build, products, scores)
        except Exception as error:  # (recorded: the table shows it, the survey goes on)
            row = {"products": products, "scores": scores, "error": f"{type(error).__name__}: {error}"[:2000],
                   "traceback": traceback.format_exc()[-4000:]}
        result["site_sets"].append(row)
        path.write_text(json.dumps(result, indent=1, default=str))
        print(name, (products, scores), row.get("fails", row.get("error")), flush=True)
    try:
        result["transform"] = transform_at_budget(build)
    except Exception as error:
        result["transform"] = {"error": f"{type(error).__name__}: {error}"[:2000],
                               "traceback": traceback.format_exc()[-4000:]}
    path.write_text(json.dumps(result, indent=1, default=str))
    print(name, "transform", {k: v for k, v in result["transform"].items() if k != "traceback"}, flush=True)


def _bytes(n) -> str:
    return "-" if n is None else f"{n:,}"


def _site_set_row(model: str, row: dict) -> str:
    label = ", ".join(k for k in ("products", "scores") if row[k]) or "plain"
    if "error" in row:
        return f"| {model} | {label} | - | - | - | - | - | error: {row['error'][:200]} |"
    verdict = "OK" if not row["fails"] else "; ".join(row["fails"])
    return (f"| {model} | {label} | {row['sites']} | {_bytes(row['before_act'])} | "
            f"{_bytes(row['planned_act'])} / {_bytes(row['planned_peak'])} | "
            f"{_bytes(row['traced_act'])} / {_bytes(row['traced_peak'])} | {_bytes(row['measured_act'])} | "
            f"{verdict.replace('|', '/')} |")


def _transform_row(model: str, t: dict | None) -> str:
    if t is None:
        return f"| {model} | not reached (timeout) | | | | | | |"
    if "error" in t:
        return f"| {model} | error: {t['error'][:300].replace('|', '/')} | | | | | | |"
    after = t["measured_after_act"]
    within = "-" if after is None else "yes" if after <= t["target"] else "no"
    exact = "-" if after is None else "yes" if t["estimated_after_act"] == after else \
        f"{t['estimated_after_act'] - after:+,d} B"
    return (f"| {model} | {_bytes(t['measured_before_act'])} | {_bytes(t['target'])} | {_bytes(after)} | {within} | "
            f"{exact} | {t['step'] or 'identical'} | {(t.get('reason') or t['status'] or '').replace('|', '/')[:300]} |")


def table() -> str:
    """TABLE from the per-model results in OUT, in MODELS' order."""
    sys.path.insert(0, str(HERE))
    from survey_models import MODELS
    results = {p.stem: json.loads(p.read_text()) for p in OUT.glob("*.json")}
    names = [n for n in MODELS if n in results]
    sets = ["| model | sites applied | sites | activations before | planned activations / peak | "
            "traced activations / peak | measured activations | result |", "|---|---|---|---|---|---|---|---|"]
    transforms = [f"| model | measured activations before | {BUDGET} | measured after | within | estimate - measured | "
                  "step against the original | checkpoint pass |", "|---|---|---|---|---|---|---|---|"]
    clean = 0
    for name in names:
        r = results[name]
        rows = r["site_sets"]
        sets.extend(_site_set_row(name, row) for row in rows)
        if r.get("rc"):
            sets.append(f"| {name} | stopped (exit {r['rc']}) | | | | | | |")
        clean += len(rows) == len(SITE_SETS) and all(not row.get("fails") and "error" not in row for row in rows)
        transforms.append(_transform_row(name, r.get("transform")))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    text = (f"# Model survey\n\n`python benchmarks/model_survey.py` at {commit or 'an unknown commit'}, "
            f"{time.strftime('%Y-%m-%d')}: {len(names)} models, {clean} with every site set planned == traced == "
            f"measured and a bit-identical step. Bytes per training step; \"planned\" is the remat planner's "
            f"estimate of every site applied, \"traced\" the cost model's trace of the rewritten program.\n\n"
            f"## Every remat site applied\n\n" + "\n".join(sets) +
            f"\n\n## transform at activation_budget {BUDGET}\n\n" + "\n".join(transforms) + "\n")
    TABLE.write_text(text)
    return text


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        survey_one(argv[1])
        return
    if argv[:1] != ["--table"]:
        sys.path.insert(0, str(HERE))
        from survey_models import MODELS
        unknown = [n for n in argv if n not in MODELS]
        if unknown:
            sys.exit(f"model_survey.py: no model named {', '.join(unknown)} in benchmarks/survey_models.py")
        for name in argv or list(MODELS):
            started = time.time()
            try:
                rc = subprocess.call([sys.executable, __file__, "--one", name], timeout=PER_MODEL_S)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            print(f"== {name}: exit {rc} in {time.time() - started:.0f} s", flush=True)
            if rc != 0:
                path = OUT / f"{name}.json"
                result = json.loads(path.read_text()) if path.exists() else \
                    {"model": name, "site_sets": [], "transform": None}
                result["rc"] = rc
                OUT.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=1))
    print(table())


if __name__ == "__main__":
    main(sys.argv[1:])
