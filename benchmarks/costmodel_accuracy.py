"""How close the cost model is to measurement, on every bundled example, in train and inference mode.

    python benchmarks/costmodel_accuracy.py [--examples gpt,unet] [--zoo all|t5,mixtral] [--optimizer adamw]
                                            [--out benchmarks/results]

For each example: the static and traced estimates of the peak (and of the activations) next to fxmem.measure on
the same captured program, with their ratios, in train and inference mode, and in train mode once more after the
checkpoint pass at the lowest peak it reaches ("train, checkpointed": recompute regions, remat sites, draw tapes,
the estimates the pass plans with). Goal: static within 5% of measured, traced within 1%.
Writes a markdown table to benchmarks/results/costmodel_accuracy.md. `--zoo` adds the test model zoo
(`tests/zoo.py`: Hugging Face, torchvision-style, PyG and LSTM models from small configs) and, with `--examples ""`,
covers it alone (written to costmodel_accuracy_zoo.md).
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import shlex
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fxmem  # noqa: E402
from fxmem.modelfile import load_model_file  # noqa: E402
from fxmem.pipeline import PassContext, pass_module  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402
from tests.zoo import BUILDERS  # noqa: E402

DEFAULT = ["gpt", "hf_llama", "hf_gpt2", "hf_bert", "gcn", "gat", "gnn_stan", "unet", "vit", "mlp_digits"]


def checkpointed(program, loss_fn, optimizer):
    """The checkpoint pass on `program` at the lowest peak it reaches (a budget below it, as a target), or None
    when it changes nothing."""
    ck = pass_module("checkpoint")
    base = fxmem.estimate(program, mode="train", optimizer=optimizer, loss_fn=loss_fn)
    ctx = PassContext(policy=None, options=ck.CheckpointOptions(), mode="train", optimizer=optimizer,
                      budget=int(base.peak - 0.9 * base.activations), baseline=base,
                      enabled=("checkpoint", "offload"), loss_fn=loss_fn, budget_strict=False)
    res = ck.CheckpointPass().run(program.snapshot(), ctx)
    if not res.modified:
        return None
    res.program.refresh()
    return res.program


def cases(examples: str, zoo: str):
    """(name, model, args, kwargs, loss_fn) for each named example, then each named zoo model ("all": every one)."""
    for name in filter(None, examples.split(",")):
        mf = load_model_file(ROOT / "examples" / f"{name}.py")
        yield name, mf.model, mf.args, mf.kwargs, mf.loss_fn
    for name in (BUILDERS if zoo == "all" else filter(None, zoo.split(","))):
        yield (f"zoo:{name}", *BUILDERS[name]())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", default=",".join(DEFAULT))
    ap.add_argument("--zoo", default="", help='test zoo models: "all" or names from tests/zoo.py')
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    rows = []
    for name, model, args, kwargs, loss_fn in cases(a.examples, a.zoo):
        for mode in ("train", "inference", "train, checkpointed"):
            p = fxmem.capture(model, args, kwargs, mode=mode.split(",")[0])
            p.refresh()
            if mode == "train, checkpointed":
                p = checkpointed(p, loss_fn, a.optimizer)
                if p is None:
                    print(f"{name:11s} the checkpoint pass changes nothing", flush=True)
                    continue
                mode_arg = "train"
            else:
                mode_arg = mode
            t0 = time.perf_counter()
            s = fxmem.estimate(p, mode=mode_arg, optimizer=a.optimizer, loss_fn=loss_fn)
            ts = time.perf_counter() - t0
            t0 = time.perf_counter()
            tr = fxmem.estimate(p, mode=mode_arg, optimizer=a.optimizer, loss_fn=loss_fn, method="traced")
            tt = time.perf_counter() - t0
            m = fxmem.measure(copy.deepcopy(p.module), args, kwargs, mode=mode_arg, optimizer=a.optimizer,
                              loss_fn=loss_fn)
            rows.append((name, mode, s.peak, tr.peak, m.peak, s.activations, tr.activations, m.activations, ts, tt))
            print(f"{name:11s} {mode:19s} static {s.peak / m.peak:.4f} traced {tr.peak / m.peak:.4f} "
                  f"(measured {format_bytes(m.peak)})", flush=True)
    lines = [
        "| example | mode | static peak | traced peak | measured peak | static/measured | traced/measured "
        "| static act./measured | static s | traced s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst_s = worst_t = 0.0
    for name, mode, sp, tp, mp, sa, ta, ma, ts, tt in rows:
        worst_s = max(worst_s, abs(sp / mp - 1))
        worst_t = max(worst_t, abs(tp / mp - 1))
        act = f"{sa / ma:.4f}" if ma else "-"
        lines.append(f"| {name} | {mode} | {format_bytes(sp)} | {format_bytes(tp)} | {format_bytes(mp)} | "
                     f"{sp / mp:.4f} | {tp / mp:.4f} | {act} | {ts:.2f} | {tt:.2f} |")
    exact = sum(tp == mp for _, _, _, tp, mp, *_ in rows)
    summary = (f"\nWorst static error {worst_s * 100:.2f}% (goal <= 5%), worst traced error {worst_t * 100:.2f}% "
               f"(goal <= 1%); traced = measured to the byte in {exact} of {len(rows)} cases. "
               f"optimizer={a.optimizer}, torch {torch.__version__}, CPU.\n")
    command = " ".join(["python benchmarks/costmodel_accuracy.py", *map(shlex.quote, argv or sys.argv[1:])])
    text = (f"# Cost model accuracy\n\nReproduce: `{command}`. Peak = live tensor "
            "bytes including parameters, optimizer state and inputs, over one steady-state step; measured with "
            "fxmem.measure on the same captured program.\n\n" + "\n".join(lines) + "\n" + summary)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    zoo_only = a.zoo and not a.examples
    (out / ("costmodel_accuracy_zoo.md" if zoo_only else "costmodel_accuracy.md")).write_text(text)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
