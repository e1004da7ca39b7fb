"""How often backward recomputes each remat'd op: every remat site the checkpoint pass finds, applied alone.

    python benchmarks/remat_recompute_count.py            # the U-Net at the checkpoint benchmark's full size
    python benchmarks/remat_recompute_count.py --model gpt

Counts the ops of one backward (a dispatch mode) of the remat'd module and of the captured one. The difference is
what remat recomputes. A recipe nested in another (a batch norm -> ReLU chain that a skip concatenation reads) is
recomputed at each of the outer recipe's unpacks, unless they run right next to its own saves (a max pooling's:
then its value is shared), so an op can run more often than it has sites. The table lists the sites per op and the
extra calls of that op in backward.
"""
from __future__ import annotations

import argparse
import collections
import sys
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="unet", choices=["unet", "gpt"])
    args = ap.parse_args()
    ck = pass_module("checkpoint")
    ex, model, x = setup(args.model, True)
    program = fxmem.capture(model, x)
    program.refresh()
    traced = trace_forward(program, program.example_args, program.example_kwargs, "train", ex.loss_fn)
    sites = ck.remat_sites(program, traced, ck.default_balance(program))
    remat = program.snapshot()
    ck.apply_remat(remat, sites)
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


if __name__ == "__main__":
    main()
