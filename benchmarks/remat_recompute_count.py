"""How often backward recomputes each remat'd op: every remat site the checkpoint pass finds, applied alone.

    python benchmarks/remat_recompute_count.py            # the U-Net at the checkpoint benchmark's full size
    python benchmarks/remat_recompute_count.py --model gpt
    python benchmarks/remat_recompute_count.py --overhead # also: the fixed cost per site, on a tiny input
    python benchmarks/remat_recompute_count.py --kernels  # the CPU kernels the cost model prices per byte

Counts the ops of one backward (a dispatch mode) of the remat'd module and of the captured one. The difference is
what remat recomputes. A recipe nested in another (a batch norm -> ReLU chain that a skip concatenation reads) is
recomputed at each of the outer recipe's unpacks, unless they run right next to its own saves (a max pooling's:
then its value is shared), so an op can run more often than it has sites. The table lists the sites per op and the
extra calls of that op in backward.

`--kernels` times, at the U-Net benchmark's shapes, the CPU kernels the cost model charges per byte written
(fxmem.costmodel.SLOW_KERNELS_CPU) against an addcmul pass, in FLOP-equivalents at 200 per ns (the convention of
DRAW_COST_PER_ELEMENT_CPU).

`--overhead` times a training step with every site applied and with none, on an input so small (batch 1, 8 pixels
or tokens a side) that kernels cost next to nothing, on one thread: the difference per site, forward and backward,
is what a site costs beyond its kernels (saved-tensor hooks, recipe bookkeeping, dispatch), paid at any size.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxmem  # noqa: E402
from fxmem import ops as optable  # noqa: E402
from fxmem.costmodel import trace_forward  # noqa: E402
from fxmem.pipeline import pass_module  # noqa: E402
from checkpoint_pareto import setup  # noqa: E402


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[optable.packet(func)] += 1
        return func(*args, **(kwargs or {}))


def backward_calls(module, x, loss_fn) -> collections.Counter:
    torch.manual_seed(0)
    loss = loss_fn(module(*x), x)
    c = _Count()
    with c:
        loss.backward()
    return c.calls


def remat_all(ex, model, x):
    """`model` captured at `x`: (the captured program, a copy with every remat site applied, the sites)."""
    ck = pass_module("checkpoint")
    program = fxmem.capture(model, x)
    program.refresh()
    traced = trace_forward(program, program.example_args, program.example_kwargs, "train", ex.loss_fn)
    sites = ck.remat_sites(program, traced, ck.default_balance(program))
    remat = program.snapshot()
    ck.apply_remat(remat, sites)
    return program, remat, sites


def site_overhead(name: str, rounds: int = 300) -> None:
    """Forward and backward time with every site against none on a tiny input, on one thread (the intra-op pool's
    wake-ups would swamp a fixed cost of microseconds): 10th percentile of interleaved rounds."""
    ex, model, _ = setup(name, True)
    x = ex.example_inputs(batch=1, size=8) if name == "unet" else ex.example_inputs(batch=1, seq_len=8)
    program, remat, sites = remat_all(ex, model, x)
    mods = {"none": program.snapshot().module, "all": remat.module}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {(k, phase): [] for k in mods for phase in ("forward", "backward")}
        for round_ in range(rounds + 10):
            for k, m in mods.items():
                t0 = time.perf_counter()
                loss = ex.loss_fn(m(*x), x)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                if round_ >= 10:  # (warm-up)
                    times[k, "forward"].append(t1 - t0)
                    times[k, "backward"].append(t2 - t1)
    finally:
        torch.set_num_threads(threads)
    p10 = {key: sorted(v)[len(v) // 10] for key, v in times.items()}
    per_site = {phase: (p10["all", phase] - p10["none", phase]) / max(1, len(sites)) * 1e6
                for phase in ("forward", "backward")}
    print(f"{name}, input {tuple(x[0].shape)}, 1 thread: forward {p10['none', 'forward'] * 1e3:.2f} ms without "
          f"remat, {p10['all', 'forward'] * 1e3:.2f} ms with its {len(sites)} sites; backward "
          f"{p10['none', 'backward'] * 1e3:.2f} / {p10['all', 'backward'] * 1e3:.2f} ms: "
          f"{per_site['forward']:.0f} + {per_site['backward']:.0f} us per site (forward + backward; 10th "
          f"percentile of {rounds} interleaved rounds)")


def _best_us(f, n: int = 100) -> float:
    for _ in range(5):
        f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def kernel_costs() -> None:
    """CPU time per byte written of the kernels SLOW_KERNELS_CPU prices, at the U-Net benchmark's shapes."""
    aten = torch.ops.aten
    x, a = torch.randn(8, 32, 32, 32), torch.randn(1, 32, 1, 1)
    img, w1 = torch.randn(8, 1, 32, 32), torch.randn(32, 1, 3, 3)
    d, wt = torch.randn(8, 64, 16, 16), torch.randn(64, 32, 2, 2)
    cases = [("addcmul (a pointwise pass)", lambda: torch.addcmul(a, x, a), x.nbytes),
             ("max_pool2d_with_indices 2x2", lambda: aten.max_pool2d_with_indices(x, [2, 2], [2, 2]),
              x.nbytes // 4 * 3),  # output (4 bytes per element) and indices (8), a quarter of the elements
             ("avg_pool2d 2x2", lambda: aten.avg_pool2d(x, [2, 2], [2, 2]), x.nbytes // 4),
             ("first convolution 1->32, 3x3", lambda: aten.convolution(img, w1, None, [1, 1], [1, 1], [1, 1], False,
                                                                       [0, 0], 1), x.nbytes),
             ("transposed convolution 64->32, 2x2 stride 2",
              lambda: aten.convolution(d, wt, None, [2, 2], [0, 0], [1, 1], True, [0, 0], 1), x.nbytes)]
    print(f"| kernel ({torch.get_num_threads()} threads) | us | bytes written | FLOP-equivalents per byte written |")
    print("|---|---|---|---|")
    for name, f, written in cases:
        us = _best_us(f)
        print(f"| {name} | {us:.0f} | {written} | {us * 1e3 * 200 / written:.0f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="unet", choices=["unet", "gpt"])
    ap.add_argument("--overhead", action="store_true", help="also time the fixed cost per site (tiny input)")
    ap.add_argument("--kernels", action="store_true", help="only time the CPU kernels priced per byte written")
    args = ap.parse_args()
    if args.kernels:
        kernel_costs()
        return
    ex, model, x = setup(args.model, True)
    program, remat, sites = remat_all(ex, model, x)
    base = backward_calls(program.snapshot().module, x, ex.loss_fn)
    mine = backward_calls(remat.module, x, ex.loss_fn)
    per_op = collections.Counter()
    for s in sites:
        for n in (*s.chain, s.node):
            per_op[optable.packet(n.target)] += 1
    print(f"{args.model}: {len(sites)} remat sites; backward ops {sum(base.values())} captured, "
          f"{sum(mine.values())} remat'd")
    print("| op | sites (members included) | extra calls in backward |")
    print("|---|---|---|")
    for op in sorted(set(per_op) | {k for k in mine if mine[k] > base.get(k, 0)}):
        extra = mine.get(op, 0) - base.get(op, 0)
        if per_op.get(op) or extra > 0:
            print(f"| {op} | {per_op.get(op, 0)} | {extra} |")
    if args.overhead:
        site_overhead(args.model)


if __name__ == "__main__":
    main()
