"""Linears and convolutions (or attention softmaxes) as remat sites: the pass's plans with and without, timed.

Issue 33 §1: at torch.compile's bytes, fxmem's plans on the reference decoder recomputed 2-4x the eager floor at mid
budgets, because whole-module regions rerun the ops that save what they recompute (an MLP region's second linear,
only to re-pack its input). `passes.checkpoint.remat_products` lets remat take an MLP's first linear (under its
GELU), or a convolution (under its batch norm), instead: alone where remat then reaches the budget, else with
regions planned over them (the attention blocks' where the MLPs' linears are sites). This
script asks the pass for the activation bytes torch.compile keeps at each budget b (as `checkpoint_pareto.py`'s
"fxmem=c@b" rows do), once with the option and once without, and times both plans against the captured graph in
the same process, interleaved: per round one step of each, their recompute time the median over rounds of the step
less the captured graph's in that round. The models and sizes are checkpoint_pareto's `--full` ones.

    python benchmarks/remat_products.py            # gpt and unet, budgets 0.1-0.7; 40 rounds
    python benchmarks/remat_products.py --models gpt --budgets 0.5 --rounds 20

`--option remat_scores` compares the plans with and without `passes.checkpoint.remat_scores` instead (attention
softmaxes recomputed with their scores from the copies of q and k that matmul saves anyway; results in
results/remat_scores.md).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxmem  # noqa: E402
from fxmem.costmodel import estimate  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402

from benchmarks.checkpoint_pareto import (Bench, add_compile, compile_bytes_target, fxmem_module,  # noqa: E402
                                          hooks_offset, paired_difference, plan_string, setup, step_times)

RESULTS = Path(__file__).resolve().parent / "results"


# the options this script compares: CheckpointOptions field -> what its rows are called
OPTIONS = {"remat_products": "products", "remat_scores": "softmax sites"}


def plans(budgets, bench: Bench, option: str = "remat_products") -> dict[str, tuple]:
    """Per budget, the pass's module at compile@b's bytes with and without `option` (matrix-product sites, or
    softmax sites): {row key: (module, plan note, activation bytes kept and asked for, both in the hooks'
    count)}."""
    rows = {}
    for b in budgets:
        add_compile(bench, b)
        target = compile_bytes_target(bench, b)
        for on in (True, False):
            mod, _, _, _, metrics = fxmem_module(bench.program, bench.base, bench.loss_fn, None, acts=target,
                                                 **{option: on})
            kept = fxmem.measure(copy.deepcopy(mod), bench.x, loss_fn=bench.loss_fn).activations
            rows[f"{'with' if on else 'without'} {OPTIONS[option]} @{b}"] = (
                mod, plan_note(metrics), kept - hooks_offset(bench), target - hooks_offset(bench))
    return rows


def plan_note(metrics: dict) -> str:
    """Regions recomputed and remat sites, how many of them products."""
    remat = metrics.get("remat", {})
    products, softmaxes = remat.get("products", 0), remat.get("softmaxes", 0)
    return f"{plan_string(metrics.get('plan', {})) or 'no region'}; {remat.get('sites', 0)} remat sites" + \
        (f", {products} of them products" if products else "") + \
        (f", {softmaxes} softmaxes" if softmaxes else "")


def model_section(name: str, budgets, rounds: int, option: str = "remat_products") -> str:
    """One model's table: its plans at compile@b's bytes per budget, with and without the option, timed
    interleaved against the captured graph (checkpoint_pareto's `step_times`)."""
    ex, model, x = setup(name, True)
    torch.manual_seed(0)
    program = fxmem.capture(model, x)
    program.refresh()
    bench = Bench(model, x, ex.loss_fn, program, estimate(program, mode="train", loss_fn=ex.loss_fn))
    bench.mods["captured"] = (program.snapshot().module, 0.0, "")
    rows = plans(budgets, bench, option)
    timing = Bench(model, x, ex.loss_fn, program, bench.base,
                   mods={"captured": bench.mods["captured"], **{k: (r[0], 0.0, "") for k, r in rows.items()}})
    times = step_times(timing, rounds)
    return f"### {name} (captured graph's best step {min(times['captured']) * 1000:.1f} ms)\n\n" + \
        table(rows, times) + "\n"


def table(rows: dict, times: dict) -> str:
    lines = ["| method | compile@b's bytes | kept (hooks' count) | recompute ms: median (quartiles) | plan |",
             "|---|---|---|---|---|"]
    for key, (_, note, kept, target) in rows.items():
        mid, low, high = paired_difference(times[key], times["captured"])
        lines.append(f"| {key} | {format_bytes(target)} | {format_bytes(kept)} | {mid * 1000:.1f} ({low * 1000:.1f} - "
                     f"{high * 1000:.1f}) | {note} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,unet")
    ap.add_argument("--budgets", default="0.1,0.2,0.3,0.5,0.7")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--option", choices=sorted(OPTIONS), default="remat_products")
    ap.add_argument("--out", default=None, help="default: results/<option>.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    budgets = [float(b) for b in args.budgets.split(",")]
    sections = [model_section(name, budgets, args.rounds, args.option) for name in args.models.split(",")]
    title = "Linears and convolutions" if args.option == "remat_products" else "Attention softmaxes"
    text = (f"# {title} as remat sites (passes.checkpoint.{args.option})\n\nReproduce: `python "
            f"benchmarks/remat_products.py --option {args.option} --models {args.models} --budgets {args.budgets} "
            f"--rounds {args.rounds}` "
            f"(torch {torch.__version__}, CPU, 2 threads). checkpoint_pareto's `--full` models, the pass asked for "
            f"the activation bytes torch.compile kept at budget b. Recompute: a plan's step less the captured "
            f"graph's in the same round, median (quartiles) over {args.rounds} rounds.\n\n" + "\n".join(sections))
    write_results(text, Path(args.out or RESULTS / f"{args.option}.md"))
    return 0


def write_results(text: str, out: Path) -> None:
    """`text` to `out` (its folder made if need be), and to stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
