"""Random models through the `low` policy at several budgets: does a result that says it fits, fit when measured?

    python benchmarks/fuzz_budget.py                       # the CI set's size: 12 models from seed 0
    python benchmarks/fuzz_budget.py --long 2000 --jobs 8  # thousands of models, 8 processes
    python benchmarks/fuzz_budget.py --long 300 --start 1000 --out /tmp/fuzz
    python benchmarks/fuzz_budget.py --long 2000 --seeds-file /tmp/fuzz/seeds.jsonl  # stop and start again

Each model (`tests/fuzz_models.py`, a deterministic function of its seed) is captured and measured, run once with
its budget as a target out of reach (the lowest peak `low` reaches), then with strict budgets between that lowest
peak and the baseline (`tests/fuzz_harness.py`). Counts: models, runs, results claiming to fit (estimated peak <=
budget), measured over the budget and over the checkpoint pass's slack, the worst measured/budget ratio, results
not exact against the model, refusals (a strict budget out of reach: BudgetError) and crashes by exception type;
the seeds of every miss, to reproduce one: `python -c "from tests.fuzz_models import fuzz_case; ..."`.
Writes benchmarks/results/fuzz_budget.md (or `--out DIR`).

A run of thousands of models takes hours on a small machine. With `--seeds-file FILE`, each model's result is
appended to FILE (JSON lines, the first naming the commit) as it finishes, and a run started again with the same
arguments takes the seeds FILE has and runs only the rest: the run can stop (a session's end, a kill) and go on
later, at the same commit (a different or uncommitted checkout is refused: the counts are of one version).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import multiprocessing
import pathlib
import subprocess
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.fuzz_harness import FRACTIONS, FuzzModelResult, FuzzRun, run_model  # noqa: E402
from tests.fuzz_models import fuzz_case  # noqa: E402

CI_MODELS = 12


def run_seed(seed: int) -> FuzzModelResult:
    """One model's runs (in a worker process: one torch thread each)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return run_model(fuzz_case(seed))


def checkout_version() -> str:
    """The commit this checkout is at, with "+changes" when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


class SeedsFile:
    """Each finished model's result, one JSON line per seed after a first line naming the checkout's version."""

    def __init__(self, path: pathlib.Path, version: str):
        self.path, self.version = path, version

    def done(self) -> dict[int, tuple[FuzzModelResult, float]]:
        """Seed -> (its result, the run's seconds until it came) the file has (none if it does not exist yet);
        SystemExit when it is another version's, or this checkout has uncommitted changes."""
        if self.version.endswith("+changes"):
            raise SystemExit(f"{self.path}: the checkout has uncommitted changes: commit them first (a resumable "
                             f"run's counts are of one commit)")
        if not self.path.exists():
            return {}
        text = self.path.read_text()
        if text and not text.endswith("\n"):  # a process killed while writing: its last model runs again
            text = text[:text.rfind("\n") + 1]
            self.path.write_text(text)
        lines = text.splitlines()
        header = json.loads(lines[0]) if lines else {}
        if header.get("version") != self.version:
            raise SystemExit(f"{self.path}: results of version {header.get('version')}, this checkout is "
                             f"{self.version}: give another --seeds-file (one run's counts are of one version)")
        results = {}
        for line in lines[1:]:
            if line.strip():
                model = json.loads(line)
                seconds = model.pop("seconds")
                model["runs"] = [FuzzRun(**run) for run in model["runs"]]
                results[model["seed"]] = (FuzzModelResult(**model), seconds)
        return results

    def add(self, result: FuzzModelResult, seconds: float) -> None:
        new = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            if new:
                f.write(json.dumps({"version": self.version}) + "\n")
            f.write(json.dumps({**dataclasses.asdict(result), "seconds": round(seconds, 3)}) + "\n")


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
    ap.add_argument("--seeds-file", default="", metavar="FILE",
                    help="keep each model's result in FILE as it finishes, and take the seeds it has (resumable)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    seeds_file = SeedsFile(pathlib.Path(a.seeds_file), checkout_version()) if a.seeds_file else None
    done = seeds_file.done() if seeds_file else {}
    seeds = range(a.start, a.start + a.long)
    todo = [seed for seed in seeds if seed not in done]
    results = [done[seed][0] for seed in seeds if seed in done]
    seconds = sum(done[seed][1] for seed in seeds if seed in done)
    last = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(a.jobs) if a.jobs > 1 else _Serial() as pool:
        for res in pool.imap(run_seed, todo):
            results.append(res)
            now = time.perf_counter()
            seconds, took, last = seconds + now - last, now - last, now
            if seeds_file:
                seeds_file.add(res, took)
            print(f"[{len(results)}/{len(seeds)}] seed {res.seed}: {len(res.runs)} runs{_flag(res)}", flush=True)
    command = "python benchmarks/fuzz_budget.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(summarize(results), command.strip(), seconds)
    if seeds_file:
        text += (f"\nVersion {seeds_file.version}; {len(todo)} of the {len(seeds)} models run by the last process, "
                 f"the rest by earlier ones (the minutes are the sum of all).\n")
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


def _flag(res: FuzzModelResult) -> str:
    """What the progress line says of a model: a miss beyond the slack, inexact or crashed, or over its budget."""
    if res.crash or any(r.over_slack or r.exact_error or r.crash for r in res.runs):
        return " MISS"
    return " over budget (within slack)" if any(r.over_budget for r in res.runs) else ""


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
