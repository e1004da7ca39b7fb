"""`fxmem.costmodel.compiled_saves` against the real compiled step, on the model survey's zoo (CPU, inductor).

    python benchmarks/compiled_saves_zoo.py [--models mistral,distilbert,...] [--out FILE.md]

For each model (benchmarks/survey_models.py: library classes, small random configs) and for the checkpoint pass's
result at a 40% activation budget: the saved bytes compiled_saves reads off the compiler's partition (no code
generated, nothing run) beside `fxmem.measure.saved_bytes` of the same module really compiled by inductor and run
one training forward (hooks), and the time each took. Writes benchmarks/results/compiled_saves_zoo.md.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch._functorch.config as functorch_config  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402

import fxmem  # noqa: E402
from fxmem.costmodel import compiled_saves, estimate  # noqa: E402
from fxmem.measure import saved_bytes  # noqa: E402
from fxmem.pipeline import PassContext, long_lived_frozen, pass_module  # noqa: E402
from fxmem.units import Budget, format_bytes  # noqa: E402
from checkpoint_pareto import own_code  # noqa: E402
from survey_models import MODELS  # noqa: E402

DEFAULT = ("mistral,gpt_neox,falcon,distilbert,bart,convnext,mobilenet_v2,swin,segformer,wav2vec2,clip,pyg_gin_bn,"
           "pyg_gat_jk")


def really_compiled(module, args, kwargs) -> int:
    """saved_bytes of `module` compiled by inductor, cold, with a forward code object of its own."""
    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
        return saved_bytes(torch.compile(own_code(copy.deepcopy(module))), args, kwargs)


def checkpointed(model, args, kwargs, loss_fn):
    """The checkpoint pass's result at 40% of the baseline's activations (a target)."""
    program = fxmem.capture(model, args, kwargs)
    program.refresh()
    base = estimate(program, mode="train", loss_fn=loss_fn)
    checkpoint = pass_module("checkpoint")
    options = checkpoint.CheckpointOptions(activation_budget=Budget(bytes=int(0.4 * base.activations)))
    ctx = PassContext(policy=None, options=options, mode="train", optimizer="adamw", budget=None, baseline=base,
                      enabled=("checkpoint",), loss_fn=loss_fn, budget_strict=False)
    with long_lived_frozen():
        return checkpoint.CheckpointPass().run(program.snapshot(), ctx).program.module.train()


def row(name: str, label: str, module, args, kwargs) -> str:
    started = time.perf_counter()
    predicted = compiled_saves(module, args, kwargs)
    predict_s = time.perf_counter() - started
    started = time.perf_counter()
    real = really_compiled(module, args, kwargs)
    real_s = time.perf_counter() - started
    same = "equal" if predicted.total == real else f"differs by {predicted.total - real:+,} B"
    return (f"| {name} | {label} | {predicted.total:,} B ({format_bytes(predicted.layout_copies)} layout copies) | "
            f"{real:,} B | {same} | {predict_s:.1f} / {real_s:.1f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled_saves_zoo.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    lines = ["# compiled_saves against the real compiled step", "",
             f"`python benchmarks/compiled_saves_zoo.py --models {args.models}` (torch {torch.__version__}, CPU). "
             "Saved bytes: distinct storages, parameters and buffers left out; predicted by "
             "`fxmem.costmodel.compiled_saves` (inductor's partition, before code generation), real by "
             "`fxmem.measure.saved_bytes` of the module compiled by inductor. fxmem 40%: the checkpoint pass's "
             "result at 40% of the baseline's activations.", "",
             "| model | module | predicted | real | | seconds (predicted / real compile and forward) |",
             "|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        model, model_args, model_kwargs, loss_fn = MODELS[name]()
        for label in ("model", "fxmem 40%"):
            try:
                module = model if label == "model" else checkpointed(model, model_args, model_kwargs, loss_fn)
                lines.append(row(name, label, module, model_args, model_kwargs))
            except Exception as error:  # noqa: BLE001 - one model failing must not lose the others' rows
                lines.append(f"| {name} | {label} | {type(error).__name__}: {str(error).splitlines()[0][:120]} "
                             "| | | |")
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
