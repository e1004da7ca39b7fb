"""`passes.checkpoint.compiler_budgets: auto` through `fxmem.transform` on library models, against torch.compile alone.

    python benchmarks/compiler_budgets_zoo.py [--models convnext,distilbert,...] [--budget 0.3] [--out FILE.md]

For each model (benchmarks/survey_models.py: library classes, small random configs): `fxmem.transform` with policy
low, the checkpoint pass enabled, `compiled_activation_budget` b (a target) and `compiler_budgets: auto`; the
partitioner budget it chose and what its compiled step saves by plan, beside the saved bytes of `fxmem.compile` of
the result really compiled (hooks) and those of the model as written under torch.compile at
activation_memory_budget b (the user's alternative); then one training step each (forward, loss, backward), timed
in interleaved rounds (median); the candidates the pass timed (its own medians) and the transform's seconds. Writes benchmarks/results/compiler_budgets_zoo.md.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch._functorch.config as functorch_config  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402

import fxmem  # noqa: E402
from fxmem.compiled_budget import options_at  # noqa: E402
from fxmem.measure import saved_bytes  # noqa: E402
from fxmem.step import compute_loss  # noqa: E402
from fxmem.step_timing import interleaved_times  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402
from checkpoint_pareto import own_code  # noqa: E402
from survey_models import MODELS  # noqa: E402

DEFAULT = "convnext,mobilenet_v2,distilbert,mistral,pyg_gin_bn"
ROUNDS = 15


def transformed(model, args, kwargs, loss_fn, b: float):
    """fxmem.transform with the compiled fit at b over the partitioner budgets `auto` picks; (result, seconds)."""
    started = time.perf_counter()
    result = fxmem.transform(model, args, kwargs, policy="low", loss_fn=loss_fn, budget_strict=False,
                             overrides=["passes.checkpoint.enabled=true",
                                        f"passes.checkpoint.compiled_activation_budget={b}",
                                        "passes.checkpoint.compiler_budgets=auto"])
    return result, time.perf_counter() - started


def compiled_alone(model, b: float):
    """The model as written under torch.compile at activation_memory_budget b (its own code object, cold)."""
    return torch.compile(own_code(copy.deepcopy(model)), options=options_at(b))


def step_times(modules: dict, args, kwargs, loss_fn) -> dict[str, float]:
    """Median seconds of one training step (forward, loss, backward) per module, interleaved, the order rotated."""
    def step(module):
        loss = compute_loss(loss_fn, module(*args, **kwargs), args, kwargs)
        loss.backward()
        for parameter in module.parameters():
            parameter.grad = None
    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
        for module in modules.values():
            step(module)  # cold compiles
    times = interleaved_times({key: functools.partial(step, module) for key, module in modules.items()}, ROUNDS)
    return {key: statistics.median(seconds) for key, seconds in times.items()}


def row(name: str, b: float) -> str:
    model, args, kwargs, loss_fn = MODELS[name]()
    result, transform_s = transformed(model, args, kwargs, loss_fn, b)
    record = next(r for r in result.records if r.name == "checkpoint")
    planned = record.metrics.get("compiled") or {}
    chosen = planned.get("compiler_budget")
    ours = fxmem.compile(result.module)
    alone = compiled_alone(model, b)
    real, alone_bytes = saved_bytes(ours, args, kwargs), saved_bytes(alone, args, kwargs)
    same = "=" if real == planned.get("saves") else f"planned {planned.get('saves'):,} B"
    times = step_times({"fxmem": ours, "alone": alone}, args, kwargs, loss_fn)
    plan = f"{len(record.changes)} change(s)" if record.status == "applied" else "the program as given"
    candidates = ", ".join(_candidate(fit) for fit in planned.get("fits", []))
    return (f"| {name} | {record.status} | {'default' if chosen is None else f'{chosen:g}'} ({plan}) | {format_bytes(planned.get('target', 0))} | "
            f"{format_bytes(real)} ({same}) | {format_bytes(alone_bytes)} | "
            f"{times['fxmem'] * 1e3:.1f} / {times['alone'] * 1e3:.1f} ms ({times['fxmem'] / times['alone']:.2f}x) | "
            f"{candidates} | {transform_s:.0f} |")


def _candidate(fit: dict) -> str:
    """One partitioner budget the pass tried: its compiled saves, and its timed step when it fit."""
    at = f"{fit['compiler_budget']:g}: {format_bytes(fit['saves'])}"
    if not fit["fits"]:
        return f"{at} (over)"
    return at if fit.get("step_s") is None else f"{at}, {fit['step_s'] * 1e3:.2f} ms"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiler_budgets_zoo.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    lines = ["# The compiled fit over partitioner budgets on library models", "",
             f"`python benchmarks/compiler_budgets_zoo.py --models {args.models} --budget {args.budget:g}` (torch "
             f"{torch.__version__}, CPU, 2 threads). fxmem.transform, policy low with the checkpoint pass, "
             f"compiled_activation_budget {args.budget:g} (what torch.compile alone saves at that budget for the "
             "program the pass gets, a target), compiler_budgets auto; compiled with fxmem.compile. Saved bytes: "
             "distinct storages autograd saved in the real compiled step (hooks; = when equal to the plan's "
             f"compiled_saves). Alone: the model as written under torch.compile at activation_memory_budget "
             f"{args.budget:g}. Step: forward, loss and backward, median of {ROUNDS} interleaved rounds.", "",
             "| model | pass | partitioner budget chosen | target | fxmem compiled saves | alone saves | "
             "step fxmem / alone | the pass's candidates (budget: saves, timed step) | transform s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        try:
            lines.append(row(name, args.budget))
        except Exception as error:  # noqa: BLE001 - one model failing must not lose the others' rows
            lines.append(f"| {name} | {type(error).__name__}: {str(error).splitlines()[0][:160]} | | | | | | | |")
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
