"""Where a plan's backward recomputation spends its time, op by op, beside what the eager floor prices.

    python benchmarks/recompute_ops.py                     # gpt and the U-Net at compile@b's bytes
    python benchmarks/recompute_ops.py --models gpt --steps 15 --out /tmp/recompute_ops

Issue 33 holds fxmem's recomputation to 1.15x the eager floor (benchmarks/eager_floor.py). The clock
(benchmarks/recompute_clock.py) gives one number per plan; this splits it. For each target (torch.compile's saved
bytes at activation_memory_budget b, as benchmarks/region_recipes.py) the checkpoint pass plans, and the plan's
steps run with a dispatch mode that times every aten op issued inside a recomputation (`RecomputeClock`'s windows:
recipes and regions run again in backward). Beside it the floor's plan at the same bytes, its nodes' prices summed
by graph op (a dropout mask drawn again as its own line). Graph ops and dispatch ops differ in name (a linear runs
as `addmm`, a matmul as `bmm` with its copies), so the two lists are read by kind: draws, matrix products, the rest.

Two estimators of one recomputation. The clock's sums each recomputation's least over the steps (31 of them at
gpt's 0.1). The floor's sums each *node's* least (over 90 at gpt's 0.1): a sum of more minima, each taken alone,
lies further below any one step (a sum of per-item minima is never above the least step's sum of the same
items, and the more items, the further below it tends to lie). So fxmem's recomputation is also given on the
floor's own estimator ("op by op"): each aten op's least over the steps, summed, plus the time outside the ops
(Python around them: fx code, recipe bookkeeping), taken as the least clocked step (without the op timer) less the
least step's op sum (with it). The floor's node times are the least of 30 forward runs and of 15 backward steps
(`eager_floor.FORWARD_REPEATS`, `BACKWARD_STEPS`).
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fxmem import ops as optable  # noqa: E402
from fxmem.nn.dropout import DRAW_OPS  # noqa: E402
from checkpoint_pareto import step_fn  # noqa: E402
from eager_floor import MASK_DRAWN_AGAIN, EagerFloor, is_mask  # noqa: E402
from recompute_clock import RecomputeClock, clocked_runs, each_least  # noqa: E402
from region_recipes import MIB, TARGETS, plan, prepared  # noqa: E402

class OpTimer(TorchDispatchMode):
    """Times each aten op dispatched while `clock` is inside a recomputation; `ops`: (op name, seconds) in order."""

    def __init__(self, clock: RecomputeClock):
        super().__init__()
        self.clock = clock
        self.ops: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.clock.inside:
            return func(*args, **(kwargs or {}))
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.overloadpacket.__name__, time.perf_counter() - started))
        return out


def op_split(module, step, steps: int) -> tuple[dict[str, tuple[int, float]], float]:
    """(op name -> (count, seconds): each op position's least over `steps` steps, summed by name; the least step's
    sum of all its ops) for one step's recomputation."""
    clock = RecomputeClock.on(module)
    per_step = []
    try:
        for _ in range(steps):
            timer = OpTimer(clock)
            clock.reset()
            with timer:
                step()
            per_step.append(timer.ops)
    finally:
        clock.off()
    if len({len(ops) for ops in per_step}) != 1:
        raise RuntimeError("the recomputation ran different ops in different steps: no per-op least to take")
    split: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for column in zip(*per_step):
        name = column[0][0]
        split[name][0] += 1
        split[name][1] += min(seconds for _, seconds in column)
    least_step = min(sum(seconds for _, seconds in ops) for ops in per_step)
    return {name: (count, seconds) for name, (count, seconds) in split.items()}, least_step


def clock_steps(module, step, steps: int) -> tuple[float, float]:
    """(each recomputation's least, summed: the clock's estimator; the least step's whole recomputation), without the
    op timer."""
    runs, per_step = clocked_runs(module, step, steps)
    return each_least(runs, per_step), min(per_step)


def floor_split(floor: EagerFloor, drop: int, program) -> dict[str, tuple[int, float]]:
    """Graph op -> (count, seconds) the floor's plan at `drop` recomputes, at the floor's prices (a mask drawn again
    as MASK_DRAWN_AGAIN)."""
    graph = floor.graph
    index = {name: i for i, name in enumerate(graph.names)}
    ops = {n.name: optable.packet(n.target) for n in program.graph.nodes if n.op == "call_function"}
    split: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name in floor.plan(drop):
        i = index[name]
        kind = MASK_DRAWN_AGAIN if is_mask(name) else str(ops.get(name, name))
        split[kind][0] += 1
        split[kind][1] += graph.seconds[i] + graph.extra[i]
    return {kind: (count, seconds) for kind, (count, seconds) in split.items()}


def draw_seconds(split: dict[str, tuple[int, float]]) -> float:
    """The seconds of an `op_split` spent in random draws (dropout masks drawn again, `DRAW_OPS`)."""
    return sum(seconds for name, (_, seconds) in split.items() if name in DRAW_OPS)


def _listed(split: dict, limit: int = 8) -> str:
    """The `limit` dearest entries, '<name> <count>x <ms>', and the rest summed."""
    ranked = sorted(split.items(), key=lambda item: -item[1][1])
    shown = [f"{name} {count}x {seconds * 1e3:.2f}" for name, (count, seconds) in ranked[:limit]]
    rest = ranked[limit:]
    if rest:
        shown.append(f"{len(rest)} others {sum(s for _, (_, s) in rest) * 1e3:.2f}")
    return "; ".join(shown)


def run_model(name: str, targets, steps: int) -> list[str]:
    bench = prepared(name)
    floor = EagerFloor.of(bench["program"], bench["loss_fn"])
    lines = []
    for target in targets:
        planned = plan(bench, target, True)
        module = planned["module"]
        step = step_fn(module, bench["x"], bench["loss_fn"])
        step()
        step()  # (warm-up)
        clocked, least_step = clock_steps(module, step, steps)
        split, ops_least_step = op_split(module, step, steps)
        ops_s = sum(seconds for _, seconds in split.values())
        outside = max(0.0, least_step - ops_least_step)
        draws_s = draw_seconds(split)
        drop = bench["hooks"] - int(target * MIB)
        floor_s = floor.seconds(drop)
        floor_ops = floor_split(floor, drop, bench["program"])
        floor_draws = floor_ops.get(MASK_DRAWN_AGAIN, (0, 0.0))[1]
        lines.append(
            f"| {name} | {target} | {planned['sites']} / {planned['regions']} | {clocked * 1e3:.2f} | "
            f"{ops_s * 1e3:.2f} | {draws_s * 1e3:.2f} | {outside * 1e3:.2f} | {(ops_s + outside) * 1e3:.2f} | "
            f"{floor_s * 1e3:.2f} | {floor_draws * 1e3:.2f} | {clocked / floor_s:.2f} | "
            f"{(ops_s + outside) / floor_s:.2f} | {(ops_s - draws_s) / max(floor_s - floor_draws, 1e-9):.2f} |")
        lines.append(f"|  | fxmem's ops | {_listed(split)} ||||||||||")
        lines.append(f"|  | floor's ops | {_listed(floor_ops)} ||||||||||")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,unet")
    ap.add_argument("--steps", type=int, default=9, help="steps each plan is timed over (each op's least)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recompute_ops"),
                    help="output path without suffix (.md is written)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    header = [
        "# Backward recomputation by op, beside the eager floor", "",
        f"`python benchmarks/recompute_ops.py --models {args.models} --steps {args.steps}` at {commit} on "
        f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{time.strftime('%Y-%m-%d %H:%M')}.", "",
        "Per target (compile@b's saved bytes, MiB), the checkpoint pass's plan (remat sites / regions). Clocked: its "
        "recomputations timed in backward, each one's least over the steps, summed (benchmarks/recompute_clock.py). "
        "Ops: the aten ops inside those recomputations, each op's least over the steps, summed (timed in other "
        "steps, under a dispatch mode; the floor's estimator); draws: the Bernoulli draws among them (dropout masks "
        "drawn again); outside the ops: the least clocked step less the least step's op sum (Python around the "
        "ops); op by op: ops + outside. Floor: the eager floor at the target (benchmarks/eager_floor.py), its masks "
        "drawn again beside it. Ratios: clocked / floor (the pareto table's), op by op / floor (one estimator on "
        "both sides), and the ops without draws against the floor without its draws. Below each row the dearest "
        "ops of each side, `name count x ms` (fxmem's by dispatch op, the floor's by graph op).", "",
        "| model | target MiB | sites / regions | clocked ms | ops ms | draws ms | outside the ops ms | op by op ms | "
        "floor ms | floor's draws ms | clocked / floor | op by op / floor | ops / floor, both without draws |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines = []
    for name in args.models.split(","):
        lines += run_model(name, TARGETS[name], args.steps)
    text = "\n".join(header + lines) + "\n"
    Path(args.out).with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
