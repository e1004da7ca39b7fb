"""What bit-packed dropout masks would buy, projected before they are built.

    python benchmarks/packed_masks_projection.py             # gpt at compile@b's bytes
    python benchmarks/packed_masks_projection.py --steps 15 --out /tmp/packed_masks

fxmem keeps a dropout's mask as one byte per element (`compact_dropout`); a mask packed eight elements to a byte
would keep an eighth. At compile@0.1's bytes on the reference decoder the masks are most of what is kept, and the
plan draws one block's masks again to fit (benchmarks/recompute_ops.py: 4.5 ms of Bernoulli draws). This script
prices the masks at one bit per element on both sides, without building the packing: the cost model's trace
records every bool Bernoulli draw at an eighth of its bytes (the checkpoint pass then plans as if masks were packed)
and the eager floor keeps a mask for an eighth of its bytes. The plans it gets are run as they are (bool masks: the
bytes measured are not the projected ones), and their recomputation timed as recompute_ops.py times it (op by op:
each aten op's least over the steps plus the time outside the ops; clocked: each recomputation's least), which
is what the packed program would recompute, less the unpacking (a few bit operations per mask, left out here). Each
pricing's plans are compared with the floor priced the same way.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fxmem.costmodel import trace as trace_module  # noqa: E402
from fxmem.measure import saved_bytes  # noqa: E402
from fxmem.nn.checkpoint import CheckpointRegion  # noqa: E402
from fxmem.nn.dropout import DRAW_OPS  # noqa: E402
from checkpoint_pareto import fxmem_module, step_fn  # noqa: E402
from eager_floor import EagerFloor, is_mask  # noqa: E402
from recompute_ops import clock_steps, draw_seconds, op_split  # noqa: E402
from region_recipes import MIB, TARGETS, prepared  # noqa: E402


def packed(nbytes: int) -> int:
    """The bytes of a mask of `nbytes` bool elements packed eight to a byte."""
    return (nbytes + 7) // 8


@contextlib.contextmanager
def masks_priced_as_bits():
    """While active, the cost model's traces record each bool Bernoulli draw (a dropout mask) at an eighth of its
    bytes, rounded up."""
    recorder = trace_module.DispatchRecorder
    original = recorder.__torch_dispatch__

    def priced(self, func, types, args=(), kwargs=None):
        out = original(self, func, types, args, kwargs)
        if func.overloadpacket.__name__ in DRAW_OPS and isinstance(out, torch.Tensor) and out.dtype == torch.bool:
            key = self.key(out)[0]
            self.storage_bytes[key] = packed(self.storage_bytes[key])
        return out
    recorder.__torch_dispatch__ = priced
    try:
        yield
    finally:
        recorder.__torch_dispatch__ = original


def floor_with_bit_masks(floor: EagerFloor) -> EagerFloor:
    """`floor` with each dropout mask kept for an eighth of its bytes (rounded up)."""
    graph = copy.deepcopy(floor.graph)
    graph.keep_bytes = [packed(kept) if is_mask(name) else kept for name, kept in zip(graph.names, graph.keep_bytes)]
    return EagerFloor(floor.items, floor.free, graph)


def planned_row(bench: dict, target: float, bits: bool, floor: EagerFloor, steps: int) -> str:
    """One plan at `target` MiB (the hooks' count), masks priced as bits or bytes: its shape, bytes and recompute
    against `floor` (priced the same way)."""
    with masks_priced_as_bits() if bits else contextlib.nullcontext():
        module, _, _, _, metrics = fxmem_module(bench["program"], bench["base"], bench["loss_fn"], None,
                                                acts=target * MIB + bench["offset"])
    regions = [m for m in module.modules() if isinstance(m, CheckpointRegion)]
    redraws = sum(1 for r in regions if not r.keep_ops & DRAW_OPS)
    step = step_fn(module, bench["x"], bench["loss_fn"])
    step()
    step()  # (warm-up)
    clocked, least_step = clock_steps(module, step, steps)
    split, ops_least_step = op_split(module, step, steps)
    op_by_op = sum(seconds for _, seconds in split.values()) + max(0.0, least_step - ops_least_step)
    floor_s = floor.seconds(bench["hooks"] - int(target * MIB))
    projected = (metrics["estimated_activations"] - bench["offset"]) / MIB
    measured = saved_bytes(copy.deepcopy(module), bench["x"]) / MIB
    sites = (metrics.get("remat") or {}).get("sites", 0)
    return (f"| {target} | {'bits' if bits else 'bytes'} | {sites} / {len(regions)} ({redraws}) | {projected:.2f} | "
            f"{measured:.2f} | {draw_seconds(split) * 1e3:.2f} | {op_by_op * 1e3:.2f} | "
            f"{clocked * 1e3:.2f} | {floor_s * 1e3:.2f} | {op_by_op / floor_s:.2f} | {clocked / floor_s:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=9, help="steps each plan is timed over (each op's least)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "packed_masks_projection"),
                    help="output path without suffix (.md is written)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    bench = prepared("gpt")
    floors = {False: EagerFloor.of(bench["program"], bench["loss_fn"])}
    floors[True] = floor_with_bit_masks(floors[False])
    rows = [planned_row(bench, target, bits, floors[bits], args.steps) for target in TARGETS["gpt"]
            for bits in (False, True)]
    header = [
        "# Bit-packed dropout masks, projected", "",
        f"`python benchmarks/packed_masks_projection.py --steps {args.steps}` at {commit} on {platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}.", "",
        "The reference decoder at compile@b's saved bytes (MiB, the hooks' count), planned twice: with dropout "
        "masks priced at a byte per element (as fxmem keeps them) and at a bit (projected). Plan: remat sites / "
        "regions (of which draw their masks again). Projected saved: the cost model's estimate of the plan under "
        "its pricing; measured saved: the plan as it runs today (bool masks). Draws: Bernoulli draws in the "
        "recomputation. Op by op and clocked as in benchmarks/recompute_ops.py; the floor priced as the row (masks "
        "kept at a byte or a bit per element).", "",
        "| target MiB | masks | plan (redraws) | projected saved MiB | measured saved MiB | draws ms | op by op ms | "
        "clocked ms | floor ms | op by op / floor | clocked / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    text = "\n".join(header + rows) + "\n"
    Path(args.out).with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
