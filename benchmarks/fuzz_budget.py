"""Random models through the `low` policy at several budgets: does a result that says it fits, fit when measured?

    python benchmarks/fuzz_budget.py                       # the CI set's size: 12 models from seed 0
    python benchmarks/fuzz_budget.py --long 2000 --jobs 8  # thousands of models, 8 processes
    python benchmarks/fuzz_budget.py --long 300 --start 1000 --out /tmp/fuzz

Each model (`tests/fuzz_models.py`, a deterministic function of its seed) is captured and measured, run once with
its budget as a target out of reach (the lowest peak `low` reaches), then with strict budgets between that lowest
peak and the baseline (`tests/fuzz_harness.py`). Counts: models, runs, results claiming to fit (estimated peak <=
budget), measured over the budget and over the checkpoint pass's slack, the worst measured/budget ratio, results
not exact against the model, refusals (a strict budget out of reach: BudgetError) and crashes by exception type;
the seeds of every miss, to reproduce one: `python -c "from tests.fuzz_models import fuzz_case; ..."`.
Writes benchmarks/results/fuzz_budget.md (or `--out DIR`).
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import pathlib
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.fuzz_harness import FRACTIONS, FuzzModelResult, run_model  # noqa: E402
from tests.fuzz_models import fuzz_case  # noqa: E402

CI_MODELS = 12


def run_seed(seed: int) -> FuzzModelResult:
    """One model's runs (in a worker process: one torch thread each)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return run_model(fuzz_case(seed))


def _percent(x: float) -> str:
    return f"{x * 100:+.2f}%"


def summarize(results: list[FuzzModelResult]) -> dict:
    """The counts the report shows."""
    runs = [r for m in results for r in m.runs]
    done = [r for r in runs if r.crash is None and r.refused is None]
    fits = [r for r in done if r.fits]
    crashes = collections.Counter(c.split(":")[0] for c in [m.crash for m in results if m.crash]
                                  + [r.crash for r in runs if r.crash])
    captured = [m for m in results if m.crash is None and m.measured]
    return {
        "models": len(results), "runs": len(runs), "completed": len(done), "fits": len(fits),
        "refused": sum(r.refused is not None for r in runs),
        "over_budget": [r for r in fits if r.over_budget], "over_slack": [r for r in fits if r.over_slack],
        "worst": max(fits, key=lambda r: r.ratio, default=None),
        "inexact": [r for r in done if r.exact_error], "crashes": crashes,
        "crashed_runs": [(m.seed, m.crash) for m in results if m.crash] + [(r.seed, r.crash) for r in runs if r.crash],
        "low_results": [r for r in done if r.estimated < r.measured],
        "worst_result": min(done, key=lambda r: r.estimated / r.measured - 1, default=None),
        "worst_captured": min(captured, key=lambda m: m.estimated / m.measured - 1, default=None),
        "low_captured": [m for m in captured if m.estimated < m.measured],
    }


def _run_line(r) -> str:
    return (f"| {r.seed} | {r.label} | {r.budget} | {r.estimated} | {r.measured} | {r.measured / r.budget:.4f} | "
            f"{_percent(r.estimated / r.measured - 1)} |")


def report(s: dict, command: str, seconds: float) -> str:
    """The markdown of one run of this script."""
    worst = s["worst"]
    lines = [
        f"Command: `{command}` ({seconds / 60:.1f} min; torch {torch.__version__}, CPU, policy `low`, optimizer "
        f"adamw; budgets per model: the lowest reachable peak L as a target, then L + f (P - L) for f in "
        f"{', '.join(f'{f:g}' for f in FRACTIONS)}, P the baseline estimate).", "",
        "| count | value |", "|---|---|",
        f"| models | {s['models']} |", f"| transform runs | {s['runs']} |",
        f"| runs completed (not refused, not crashed) | {s['completed']} |",
        f"| strict budgets refused (BudgetError: out of reach) | {s['refused']} |",
        f"| results claiming to fit (estimate <= budget) | {s['fits']} |",
        f"| ... measured over the budget | {len(s['over_budget'])} |",
        f"| ... measured over budget + slack | {len(s['over_slack'])} |",
        f"| worst measured / budget among those | "
        + (f"{worst.ratio:.4f} (seed {worst.seed}, {worst.label})" if worst else "-") + " |",
        f"| results estimated below their measured peak | {len(s['low_results'])} |",
        "| worst result estimate vs measured | "
        + (f"{_percent(s['worst_result'].estimated / s['worst_result'].measured - 1)} (seed "
           f"{s['worst_result'].seed})" if s["worst_result"] else "-") + " |",
        f"| captured programs estimated below their measured peak | {len(s['low_captured'])} |",
        "| worst captured estimate vs measured | "
        + (f"{_percent(s['worst_captured'].estimated / s['worst_captured'].measured - 1)} (seed "
           f"{s['worst_captured'].seed})" if s["worst_captured"] else "-") + " |",
        f"| results not exact (outputs, gradients, buffers vs the model) | {len(s['inexact'])} |",
        "| crashes by exception type | "
        + (", ".join(f"{k} {v}" for k, v in s["crashes"].most_common()) or "none") + " |",
    ]
    misses = s["over_budget"]
    if misses:
        lines += ["", "Claimed to fit, measured over the budget (bytes; estimate vs measured):", "",
                  "| seed | budget | budget B | estimated | measured | measured/budget | estimate error |",
                  "|---|---|---|---|---|---|---|"] + [_run_line(r) for r in misses]
    for r in s["inexact"]:
        lines.append(f"- not exact: seed {r.seed} ({r.label}): {r.exact_error}")
    for seed, crash in s["crashed_runs"]:
        lines.append(f"- crash: seed {seed}: {crash[:300]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=CI_MODELS, metavar="N", help="number of models (default: %(default)s)")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--title", default="", help="a heading for this run in the file (it is appended to)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    seeds = range(a.start, a.start + a.long)
    t0 = time.perf_counter()
    results = []
    with multiprocessing.get_context("spawn").Pool(a.jobs) if a.jobs > 1 else _Serial() as pool:
        for i, res in enumerate(pool.imap(run_seed, seeds), 1):
            results.append(res)
            bad = [r for r in res.runs if r.over_slack or r.exact_error or r.crash] or ([res] if res.crash else [])
            print(f"[{i}/{len(seeds)}] seed {res.seed}: {len(res.runs)} runs" + (" MISS" if bad else ""), flush=True)
    command = "python benchmarks/fuzz_budget.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(summarize(results), command.strip(), time.perf_counter() - t0)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fuzz_budget.md"
    head = "" if path.exists() else ("# Random models through `low`: budgets measured\n\n"
                                     "Reproduce with the command given for each run; see "
                                     "`benchmarks/fuzz_budget.py`.\n")
    with path.open("a") as f:
        f.write(head + (f"\n## {a.title}\n\n" if a.title else "\n") + text)
    print(text)
    return 0


class _Serial:
    """The Pool interface, in this process."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def imap(fn, items):
        return map(fn, items)


if __name__ == "__main__":
    sys.exit(main())
