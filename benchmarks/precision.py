"""Precision pass benchmark: memory, speed and error of each precision mode, as ratios to fp32.

    python benchmarks/precision.py [--examples gpt,hf_llama,...] [--steps 5] [--out benchmarks/results]

Per example and mode (measured with fxmem.measure, real steps on this machine's CPU):
- train modes (`bf16`: bf16 compute with fp32 master parameters, compact islands; `bf16-autocast`: torch.autocast
  semantics; `bf16-params`: bf16 parameters + fxmem.make_optimizer's fp32 master weights): activation bytes at the
  end of forward, parameter bytes, optimizer-state bytes, step time, relative output error vs fp32;
- inference modes (`int8`, `nf4`: bitsandbytes weights on aten.linear sites, fp32 compute): bytes of the swapped
  linears' weights vs their fp32 weights, all parameter+buffer bytes, forward time, relative output error;
- `adamw8bit`: bitsandbytes AdamW8bit optimizer-state bytes vs torch AdamW on the fp32 model.
Every mode runs with the guard's defaults (fxmem/lossguard.py, judged on the example inputs: these example models
are random-weight, where predictions flip easily; `nf4 (guard off)` shows what 4-bit weights would save there); each
row says what the setting asked and what the pass achieved (`fxmem.intent`), and what stopped it when it fell short.
Writes benchmarks/results/precision_modes.md (table), .json, and .png / .svg (`--out` elsewhere for a trial run;
`--quick`: mlp_digits for training, gpt and mlp_digits for inference, 2 steps).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import fxmem  # noqa: E402
from fxmem.compare import deviation  # noqa: E402
from fxmem.intent import intent_line  # noqa: E402
from fxmem.optim import make_optimizer, optimizer_state_bytes  # noqa: E402
from fxmem.pipeline import PassContext, pass_module  # noqa: E402
from fxmem.step import compute_loss  # noqa: E402


P = pass_module("precision")
TRAIN_MODES = {"bf16": dict(compute="bf16"), "bf16-autocast": dict(compute="bf16", islands="autocast"),
               "bf16-params": dict(compute="bf16", params="bf16")}
INFER_MODES = {"int8": dict(compute="fp32", weights="int8"), "nf4": dict(compute="fp32", weights="nf4"),
               "nf4 (guard off)": dict(compute="fp32", weights="nf4", guard=False)}


def example(name, mode):
    ex = importlib.import_module(f"examples.{name}")
    torch.manual_seed(0)
    m = ex.build_model()
    a = ex.example_inputs()
    args, kwargs = (a, {}) if isinstance(a, tuple) else ((), a)
    prog = fxmem.capture(m, args, kwargs, mode=mode)
    prog.refresh()
    return ex, prog


def run_pass(prog, mode, loss_fn, **opts):
    o = P.PrecisionOptions(loss_steps=0, report_estimate=False, **opts)
    ctx = PassContext(policy=None, options=o, mode=mode, optimizer="adamw", budget=None, baseline=None,
                      enabled=("precision",), loss_fn=loss_fn)
    return P.PrecisionPass().run(prog.snapshot(), ctx)


def asked_vs_achieved(res) -> str:
    """Each explicit setting's line: what it asked, what was achieved, and what stopped it when short."""
    return "; ".join(intent_line("precision", it.to_dict()).removeprefix("precision: ") for it in res.intents) or "-"


def out_error(ref, gm, prog):
    outs = []
    for m in (ref, gm):
        m.eval()
        with torch.no_grad():
            outs.append(m(*prog.example_args, **prog.example_kwargs))
    return deviation(*outs).rel


def step_time(gm, prog, loss_fn, opt, steps):
    gm.train()
    ts = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        loss = compute_loss(loss_fn, gm(*prog.example_args, **prog.example_kwargs), prog.example_args,
                            prog.example_kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ts.append(time.perf_counter() - t)
    return sorted(ts[1:])[len(ts[1:]) // 2]


def fwd_time(gm, prog, steps):
    gm.eval()
    ts = []
    with torch.no_grad():
        for _ in range(steps + 1):
            t = time.perf_counter()
            gm(*prog.example_args, **prog.example_kwargs)
            ts.append(time.perf_counter() - t)
    return sorted(ts[1:])[len(ts[1:]) // 2]


def bench_train(name, steps):
    ex, prog = example(name, "train")
    loss_fn = getattr(ex, "loss_fn", None)
    rows = []
    base_gm = copy.deepcopy(prog.module)
    base = fxmem.measure(copy.deepcopy(base_gm), prog.example_args, prog.example_kwargs, mode="train",
                         optimizer="adamw", loss_fn=loss_fn)
    opt = make_optimizer(base_gm, "adamw")
    t_base = step_time(base_gm, prog, loss_fn, opt, steps)
    base_state = optimizer_state_bytes(opt)
    rows.append(dict(example=name, mode="fp32", params=base.params, activations=base.activations,
                     opt_state=base_state, time=t_base, rel_err=0.0))
    for mode, o in TRAIN_MODES.items():
        res = run_pass(prog, "train", loss_fn, **o)
        gm = copy.deepcopy(res.program.module)
        opt = make_optimizer(gm, "adamw")
        prof = fxmem.run_profiled_step if hasattr(fxmem, "run_profiled_step") else None
        del prof
        from fxmem.measure import run_profiled_step
        mgm = copy.deepcopy(res.program.module)
        mopt = make_optimizer(mgm, "adamw")
        meas = run_profiled_step(mgm, prog.example_args, prog.example_kwargs, mode="train", optimizer_name="adamw",
                                 loss_fn=loss_fn, optimizer=mopt)
        err = out_error(prog.module, res.program.module, prog)
        t = step_time(gm, prog, loss_fn, opt, steps)
        rows.append(dict(example=name, mode=mode, params=meas.params, activations=meas.activations,
                         opt_state=optimizer_state_bytes(opt), time=t, rel_err=err,
                         reverted=res.metrics.get("sites_reverted", 0), intent=asked_vs_achieved(res)))
    # 8-bit optimizer on the fp32 model
    gm = copy.deepcopy(prog.module)
    opt = make_optimizer(gm, "adamw8bit")
    t = step_time(gm, prog, loss_fn, opt, steps)
    rows.append(dict(example=name, mode="adamw8bit", params=base.params, activations=base.activations,
                     opt_state=optimizer_state_bytes(opt), time=t, rel_err=0.0))
    return rows


def bench_infer(name, steps):
    ex, prog = example(name, "inference")
    rows = []
    base_gm = copy.deepcopy(prog.module)
    t_base = fwd_time(base_gm, prog, steps)
    mb = fxmem.measure(copy.deepcopy(prog.module), prog.example_args, prog.example_kwargs, mode="inference")
    rows.append(dict(example=name, mode="fp32-inference", weights=mb.params + mb.buffers, linear_dense=None,
                     linear_quant=None, time=t_base, rel_err=0.0))
    for mode, o in INFER_MODES.items():
        res = run_pass(prog, "inference", None, **o)
        q = [c for c in res.changes if c.kind == "precision.quantize"]
        dense = sum(c.details["dense_bytes"] for c in q)
        qb = sum(c.details["quant_bytes"] for c in q)
        mm = fxmem.measure(copy.deepcopy(res.program.module), prog.example_args, prog.example_kwargs,
                           mode="inference")
        t = fwd_time(res.program.module, prog, steps)
        rows.append(dict(example=name, mode=mode, weights=mm.params + mm.buffers, linear_dense=dense,
                         linear_quant=qb, time=t, rel_err=out_error(prog.module, res.program.module, prog),
                         n_linears=len(q), intent=asked_vs_achieved(res)))
    return rows


def fmt_ratio(a, b):
    return f"{a / b:.3f}x" if b else "-"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", default="gpt,hf_llama,hf_bert,vit,unet,mlp_digits")
    ap.add_argument("--infer-examples", default="gpt,hf_llama,hf_bert,vit,mlp_digits")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--quick", action="store_true", help="mlp_digits (train), gpt and mlp_digits (inference), 2 steps")
    a = ap.parse_args(argv)
    if a.quick:
        a.examples, a.infer_examples, a.steps = "mlp_digits", "gpt,mlp_digits", 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    train, infer = [], []
    for name in [x for x in a.examples.split(",") if x]:
        print(f"[train] {name}", flush=True)
        train.extend(bench_train(name, a.steps))
    for name in [x for x in a.infer_examples.split(",") if x]:
        print(f"[inference] {name}", flush=True)
        infer.extend(bench_infer(name, a.steps))
    lines = ["# Precision pass: measured memory, time and error vs fp32", "",
             f"Command: `python benchmarks/precision.py --examples {a.examples} --infer-examples "
             f"{a.infer_examples} --steps {a.steps}` (torch {torch.__version__}, CPU, "
             f"{torch.get_num_threads()} threads; machine shared with other jobs, so times are noisy).", "",
             "## Training step (fxmem.measure; optimizer AdamW unless the mode says otherwise)", "",
             "| example | mode | activations | params | optimizer state | step time | rel. output error | "
             "asked vs achieved |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    bases = {r["example"]: r for r in train if r["mode"] == "fp32"}
    for r in train:
        b = bases[r["example"]]
        lines.append(f"| {r['example']} | {r['mode']} | {fmt_ratio(r['activations'], b['activations'])} "
                     f"({r['activations'] / 2**20:.2f} MiB) | {fmt_ratio(r['params'], b['params'])} | "
                     f"{fmt_ratio(r['opt_state'], b['opt_state'])} | {fmt_ratio(r['time'], b['time'])} | "
                     f"{r['rel_err']:.2e} | {r.get('intent', '-')} |")
    lines += ["", "## Inference forward (bitsandbytes weights on aten.linear sites; fp32 compute)", "",
              "| example | mode | swapped linears: weight bytes | all params+buffers | forward time | "
              "rel. output error | asked vs achieved |", "| --- | --- | --- | --- | --- | --- | --- |"]
    ibases = {r["example"]: r for r in infer if r["mode"] == "fp32-inference"}
    for r in infer:
        b = ibases[r["example"]]
        lin = fmt_ratio(r["linear_quant"], r["linear_dense"]) + f" ({r.get('n_linears', 0)} linears)" \
            if r["linear_dense"] else "-"
        lines.append(f"| {r['example']} | {r['mode']} | {lin} | {fmt_ratio(r['weights'], b['weights'])} | "
                     f"{fmt_ratio(r['time'], b['time'])} | {r['rel_err']:.2e} | {r.get('intent', '-')} |")
    lines += ["", "Notes: `bf16` keeps fp32 master parameters; with `recast_params` (default) backward casts them (and "
              "fp32 inputs) to bf16 again instead of saving the copies; `bf16-autocast` islands as torch.autocast. "
              "`bf16-params` stores parameters in bf16 and its optimizer keeps fp32 master weights (counted in "
              "optimizer state). On CPU, bitsandbytes int8/nf4 matmuls dequantize and are slower than fp32."]
    md = "\n".join(lines) + "\n"
    (out / "precision_modes.md").write_text(md)
    (out / "precision_modes.json").write_text(json.dumps({"train": train, "inference": infer}, indent=1))
    print(md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        names = list(bases)
        modes = [m for m in ("bf16", "bf16-autocast", "bf16-params") ]
        w = 0.8 / len(modes)
        for i, m in enumerate(modes):
            vals = [next(r["activations"] for r in train if r["example"] == n and r["mode"] == m)
                    / bases[n]["activations"] for n in names]
            axes[0].bar([j + i * w for j in range(len(names))], vals, w, label=m)
        axes[0].axhline(0.52, color="k", ls="--", lw=0.8, label="goal 0.52x")
        axes[0].set_xticks([j + w for j in range(len(names))], names, rotation=30)
        axes[0].set_ylabel("activations / fp32")
        axes[0].legend(fontsize=8)
        inames = list(ibases)
        for i, m in enumerate(("int8", "nf4 (guard off)")):
            vals = [next(((r["linear_quant"] / r["linear_dense"]) for r in infer if r["example"] == n
                          and r["mode"] == m and r["linear_dense"]), 1.0) for n in inames]  # 1.0: none swapped
            axes[1].bar([j + i * 0.4 for j in range(len(inames))], vals, 0.4, label=m)
        axes[1].set_xticks([j + 0.2 for j in range(len(inames))], inames, rotation=30)
        axes[1].set_ylabel("linear weight bytes / fp32")
        axes[1].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "precision_modes.png", dpi=120)
        fig.savefig(out / "precision_modes.svg")
    except Exception as e:  # noqa: BLE001
        print(f"plot not written: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
