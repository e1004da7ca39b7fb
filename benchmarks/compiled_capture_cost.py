"""Does fxmem's capture change the compiled step? The model as written against its captured graph, both compiled.

    python benchmarks/compiled_capture_cost.py [--models unet,gpt] [--budget 0.2] [--rounds 40] [--out FILE.md]

A result that changes nothing is fxmem's captured graph, so "fxmem + compile@b" where the pass keeps the program as
given is compile@b of the captured graph, not of the model as written. For each model of checkpoint_pareto (--full
sizes): two copies of each, compiled at activation_memory_budget b (cold, caches off), their saved bytes (hooks) and
one AdamW training step each per round, interleaved with the order rotated: best and median step. Two copies of
the same thing show how far apart equal programs time on this machine. Writes
benchmarks/results/compiled_capture_cost.md.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch._functorch.config as functorch_config  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402

import fxmem  # noqa: E402
from fxmem.compiled_budget import options_at  # noqa: E402
from fxmem.measure import saved_bytes  # noqa: E402
from fxmem.step_timing import interleaved_times  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402
from benchmarks.checkpoint_pareto import own_code, setup, step_fn  # noqa: E402


def compiled_copies(name: str, budget: float) -> tuple[dict, tuple, object]:
    """Two compiled copies of the model as written and two of its captured graph, cold-compiled; (modules, inputs,
    loss)."""
    example, model, inputs = setup(name, True)
    program = fxmem.capture(model, inputs)
    program.refresh()
    sources = {"as written": lambda: own_code(copy.deepcopy(model)), "captured": lambda: program.snapshot().module}
    modules = {}
    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
        for copy_number in (1, 2):
            for label, make in sources.items():
                compiled = torch.compile(make(), options=options_at(budget))
                step_fn(compiled, inputs, example.loss_fn)()  # the cold compile
                modules[f"{label} #{copy_number}"] = compiled
    return modules, inputs, example.loss_fn


def rows(name: str, budget: float, rounds: int) -> list[str]:
    modules, inputs, loss_fn = compiled_copies(name, budget)
    times = interleaved_times({key: step_fn(module, inputs, loss_fn) for key, module in modules.items()}, rounds)
    return [f"| {name} | {key} | {format_bytes(saved_bytes(modules[key], inputs))} | "
            f"{min(times[key]) * 1e3:.2f} | {statistics.median(times[key]) * 1e3:.2f} |" for key in modules]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="unet,gpt")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled_capture_cost.md"))
    args = parser.parse_args(argv)
    lines = ["# The model as written against its captured graph, compiled", "",
             f"`python benchmarks/compiled_capture_cost.py --models {args.models} --budget {args.budget:g} --rounds "
             f"{args.rounds}` (torch {torch.__version__}, CPU, {torch.get_num_threads()} threads). Each compiled at "
             f"activation_memory_budget {args.budget:g}; saved bytes by the hooks; one AdamW step per round, "
             f"{args.rounds} interleaved rounds.", "",
             "| model | module | saved | best step ms | median step ms |", "|---|---|---|---|---|"]
    for name in args.models.split(","):
        lines += rows(name, args.budget, args.rounds)
        print("\n".join(lines[-4:]), flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
