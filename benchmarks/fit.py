"""Speed at a memory cap: the batch each method trains at under a cap, and its measured samples per second.

    python benchmarks/fit.py            # the reference decoder: 6 blocks, d=128, T=128 (checkpoint_pareto --full)
    python benchmarks/fit.py --quick    # 4 blocks, d=64, T=64: a smoke run

Caps: 25%, 50% and 75% of the measured peak of the eager step at batch 32. Methods:
- eager: the model as written, at the largest batch whose measured peak fits the cap;
- uniform: every block under torch.utils.checkpoint (checkpoint_pareto's anchor), the same search;
- fxmem fit: `fxmem.fit_batch(policy="low")` (exact passes only: SDPA and checkpointing), which picks its batch by
  the estimate before any step; the table gives the measured peak of that step, and says when it is over the cap;
- fxmem at the largest: when fit chose a smaller batch for speed, the largest batch it found to fit, transformed
  the same way (the check of that choice).
Eager's and uniform's searches measure (`fxmem.measure`, real steps at every batch tried), from plan_batch's
estimate as the first guess. Samples/s: the batch over the best of `--rounds` timed AdamW steps, after a warm-up,
the rows of a cap interleaved. torch.compile is not a row here: its memory under a compiled graph is not measurable with fxmem.measure's
tracker on CPU (checkpoint_pareto counts its saved bytes with hooks instead).

Writes benchmarks/results/fit.md and fit.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxmem  # noqa: E402
from fxmem.costmodel.batch import largest_fitting, scaled_inputs  # noqa: E402
from fxmem.step_timing import interleaved_times  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402

from benchmarks.checkpoint_pareto import setup, step_fn, uniform  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CAP_SHARES = (0.25, 0.5, 0.75)
REFERENCE_BATCH = 32


def at_batch(x: tuple, batch: int) -> tuple:
    return scaled_inputs(x, {}, 0, batch)[0]


def measured_peak(model, x, loss_fn) -> int:
    return fxmem.measure(model, x, loss_fn=loss_fn).peak


def largest_measured(model, x, loss_fn, cap: int, guess: int, limit: int) -> int:
    """The largest batch whose measured step fits `cap` (0 when not even batch 1 does)."""
    fits = {}

    def fit(batch: int) -> bool:
        if batch not in fits:
            fits[batch] = measured_peak(model, at_batch(x, batch), loss_fn) <= cap
        return fits[batch]

    return largest_fitting(fit, guess, limit) if fit(1) else 0


def interleaved_samples_per_second(rows: list[dict], rounds: int) -> None:
    """Each row's samples/s: its batch over the best of `rounds` AdamW steps, after a warm-up; one step of each
    row per round, the order rotated every round (as checkpoint_pareto times), so load on the machine hits every
    row alike."""
    steps = {index: step_fn(copy.deepcopy(row.pop("module")), row.pop("inputs"), row.pop("loss_fn"))
             for index, row in enumerate(rows) if "module" in row}
    for step in steps.values():
        step()  # warm-up
    for index, seconds in interleaved_times(steps, rounds).items():
        rows[index]["samples_s"] = rows[index]["batch"] / min(seconds)


def method_row(name: str, model, x, loss_fn, batch: int, cap: int, extra: str = "") -> dict:
    """A row's batch and measured peak; the model and inputs stay in it until timed."""
    if batch == 0:
        return {"method": name, "batch": 0, "peak": None, "samples_s": 0.0, "note": "not even batch 1 fits"}
    inputs = at_batch(x, batch)
    peak = measured_peak(model, inputs, loss_fn)
    note = extra + (" OVER THE CAP (measured)" if peak > cap else "")
    return {"method": name, "batch": batch, "peak": peak, "note": note, "module": model, "inputs": inputs,
            "loss_fn": loss_fn}


def cap_rows(model, x, loss_fn, cap: int, rounds: int, limit: int) -> list[dict]:
    """Every method's row at one cap, timed together."""
    guess = max(1, fxmem.plan_batch(model, x, budget=cap, loss_fn=loss_fn)["batch"])
    eager_batch = largest_measured(model, x, loss_fn, cap, guess, limit)
    checkpointed = uniform(model, "gpt")
    uniform_batch = largest_measured(checkpointed, x, loss_fn, cap, 2 * max(1, eager_batch), limit)
    started = time.perf_counter()
    fit = fxmem.fit_batch(model, x, budget=cap, policy="low", loss_fn=loss_fn, max_batch=limit)
    search = time.perf_counter() - started
    fxmem_note = (f"largest that fits: {fit.largest}; search {search:.0f} s" if fit.size != fit.largest
                  else f"search {search:.0f} s")
    rows = [method_row("eager", model, x, loss_fn, eager_batch, cap),
            method_row("uniform", checkpointed, x, loss_fn, uniform_batch, cap),
            method_row("fxmem fit", fit.result.module, x, loss_fn, fit.size, cap, fxmem_note)]
    if fit.size != fit.largest:  # what the choice by estimated samples/s is checked against
        largest = fxmem.transform(model, at_batch(x, fit.largest), policy="low", budget=cap, loss_fn=loss_fn,
                                  overrides=["budget_strict=false"])
        rows.append(method_row("fxmem at the largest", largest.module, x, loss_fn, fit.largest, cap,
                               "the batch fit did not choose"))
    interleaved_samples_per_second(rows, rounds)
    return rows


def table(results: list[dict], reference_peak: int, config: str) -> str:
    lines = [f"# Speed at a memory cap ({config})", "",
             f"Caps are shares of the eager step's measured peak at batch {REFERENCE_BATCH} "
             f"({format_bytes(reference_peak)}). Written by `python benchmarks/fit.py"
             f"{' --quick' if 'quick' in config else ''}`; load average {os.getloadavg()[0]:.1f} when written.", "",
             "| cap | method | batch | measured peak | samples/s | vs best other | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    for result in results:
        best_other = max((row["samples_s"] for row in result["rows"] if not row["method"].startswith("fxmem")),
                         default=0)
        for row in result["rows"]:
            ratio = f"{row['samples_s'] / best_other:.2f}x" if row["method"].startswith("fxmem") and best_other else ""
            peak = format_bytes(row["peak"]) if row["peak"] is not None else "n/a"
            lines.append(f"| {result['share']:.0%} ({format_bytes(result['cap'])}) | {row['method']} | "
                         f"{row['batch']} | {peak} | {row['samples_s']:.1f} | {ratio} | {row['note']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small decoder (a smoke run)")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per row (best of)")
    parser.add_argument("--max-batch", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    example, model, x = setup("gpt", full=not args.quick)
    loss_fn = example.loss_fn
    reference_peak = measured_peak(model, at_batch(x, REFERENCE_BATCH), loss_fn)
    results = []
    for share in CAP_SHARES:
        cap = int(share * reference_peak)
        results.append({"share": share, "cap": cap,
                        "rows": cap_rows(model, x, loss_fn, cap, args.rounds, args.max_batch)})
        print(table(results, reference_peak, "quick" if args.quick else "reference decoder"), flush=True)
    stem = "fit_quick" if args.quick else "fit"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(table(results, reference_peak, "quick" if args.quick else
                                              "reference decoder: 6 blocks, d=128, T=128"))
    (RESULTS / f"{stem}.json").write_text(json.dumps({"reference_peak": reference_peak, "results": results},
                                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
