"""Where a plan's step time goes beyond its recomputation: forward, backward outside the clock, optimizer; and how
much of it is glibc's allocator.

    python benchmarks/recompute_allocator.py                          # U-Net and gpt at compile@0.1's and 0.7's bytes
    python benchmarks/recompute_allocator.py --models unet --targets 3.05 --steps 80

On CPU a recomputed activation is a fresh allocation in backward. glibc serves blocks above its mmap threshold
(128 KiB, raised dynamically up to 32 MiB as such blocks are freed) with mmap, so each is page-faulted on first touch
and unmapped when freed, and it trims the heap's top back to the system. Each target's plan (the checkpoint pass at
that activation budget, as benchmarks/region_recipes.py plans it) and the captured graph run interleaved training
steps; per phase the plan's time less the captured graph's (least and median over the steps) and the recomputation
clocked in backward (benchmarks/recompute_clock.py: its per-step total). Then the same in a child process with
`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` and `MALLOC_TOP_PAD_` set so that freed memory stays in the
heap. "Backward outside the clock" = the backward's excess less the clocked recomputation.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from recompute_clock import RecomputeClock  # noqa: E402
from region_recipes import TARGETS, plan, prepared  # noqa: E402

HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2 ** 32), "MALLOC_TRIM_THRESHOLD_": str(2 ** 32),
            "MALLOC_TOP_PAD_": str(2 ** 29)}


def plan_for(name: str, target_mib: float):
    """(captured module, plan at `target_mib` of saved bytes, example inputs, loss_fn, remat sites)."""
    bench = prepared(name)
    planned = plan(bench, target_mib, recipes=True)
    return bench["captured"], planned["module"], bench["x"], bench["loss_fn"], planned["sites"]


def phase_times(captured, module, x, loss_fn, steps: int) -> dict:
    """Per module ("captured", "plan") and phase (forward, backward, optimizer, clocked) the seconds of each step,
    the two modules' steps interleaved (order alternating), after a warm-up."""
    modules = {"captured": captured, "plan": module}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in modules.items()}
    times = {k: {"forward": [], "backward": [], "optimizer": [], "clocked": []} for k in modules}
    clock = RecomputeClock.on(module)
    try:
        for m in modules.values():
            m.train()
        for i in range(steps + 6):
            order = list(modules) if i % 2 else list(reversed(modules))
            for key in order:
                clock.reset()
                started = time.perf_counter()
                optimizers[key].zero_grad(set_to_none=True)
                loss = loss_fn(modules[key](*x), x)
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                optimizers[key].step()
                done = time.perf_counter()
                if i >= 6:  # (warm-up)
                    row = times[key]
                    row["forward"].append(forward - started)
                    row["backward"].append(backward - forward)
                    row["optimizer"].append(done - backward)
                    row["clocked"].append(clock.reset())
    finally:
        clock.off()
    return times


def rows_for(name: str, target: float, steps: int, label: str) -> list[str]:
    captured, module, x, loss_fn, sites = plan_for(name, target)
    times = phase_times(captured, module, x, loss_fn, steps)
    lines = []
    for stat in (min, statistics.median):
        plan, base = times["plan"], times["captured"]
        excess = {p: stat(plan[p]) - stat(base[p]) for p in ("forward", "backward", "optimizer")}
        clocked = stat(plan["clocked"])
        lines.append(f"| {name} | {target} | {sites} | {label} | {'least' if stat is min else 'median'} | "
                     f"{excess['forward'] * 1e3:+.2f} | {excess['backward'] * 1e3:+.2f} | {clocked * 1e3:.2f} | "
                     f"{(excess['backward'] - clocked) * 1e3:+.2f} | {excess['optimizer'] * 1e3:+.2f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="unet,gpt")
    ap.add_argument("--targets", default=None, help="MiB of saved bytes, comma-separated (default: compile@0.1's "
                                                      "and compile@0.7's per model)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recompute_allocator"),
                    help="output path without suffix (.md is written)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # label of a child run: rows to stdout
    args = ap.parse_args(argv)
    jobs = [(name, float(t)) for name in args.models.split(",")
            for t in (args.targets.split(",") if args.targets else (TARGETS[name][0], TARGETS[name][-1]))]
    if args.child:
        for name, target in jobs:
            print("\n".join(rows_for(name, target, args.steps, args.child)), flush=True)
        return 0
    lines = []
    for label, env in (("glibc defaults", {}), ("freed memory kept in the heap", HEAP_ENV)):
        child = subprocess.run([sys.executable, __file__, "--models", args.models, "--steps", str(args.steps),
                                "--child", label] + (["--targets", args.targets] if args.targets else []),
                               env={**os.environ, **env}, capture_output=True, text=True, check=True)
        lines += [line for line in child.stdout.splitlines() if line.startswith("| ")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    header = ["# A plan's step beyond its recomputation, and the allocator", "",
              f"`python benchmarks/recompute_allocator.py --models {args.models} --steps {args.steps}` at {commit} on "
              f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"{time.strftime('%Y-%m-%d %H:%M')}. The heap setting: " +
              ", ".join(f"`{k}={v}`" for k, v in HEAP_ENV.items()) + ".", "",
              "Per target (MiB of saved bytes): the plan's time less the captured graph's per phase (ms, least or "
              "median over the interleaved steps), the recomputation clocked in backward, and the backward's excess "
              "beyond it.", "",
              "| model | target MiB | remat sites | allocator | statistic | forward | backward | clocked recompute | "
              "backward outside the clock | optimizer |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    text = "\n".join(header + lines) + "\n"
    Path(args.out).with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
