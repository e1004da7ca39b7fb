"""Attention pass: eager manual attention vs the SDPA rewrite vs HybridAttention vs SemiseparableAttention.

    python benchmarks/attention.py                       # N = 256 ... 4096 (a few minutes on 2 cores)
    python benchmarks/attention.py --max-n 8192          # up to 8192 (eager needs ~10 GiB there)
    python benchmarks/attention.py --dropout 0.1         # attention dropout: in train mode the CPU flash kernel
                                                         # cannot drop, SDPA falls back to the math kernel

The model is one nanoGPT-style causal self-attention block (qkv Linear, manual q @ k^T * (1/sqrt(d)), masked_fill
with a sliced tril buffer, softmax, [dropout], @ v, output Linear), batch 1, 8 heads of 64 (d_model 512), fp32,
train mode, attention dropout 0 unless --dropout. For each sequence length N:

- eager: the nn.Module as written;
- sdpa: fxmem.capture + the attention pass (rewrite: sdpa), the exact rewrite (is_causal=True; CPU flash kernel);
- hab: rewrite: hab, top_k 64 per query, query blocks of 256;
- semi: rewrite: semiseparable, band 64, rank ceil(log2 N), fp32 low-rank factors.

Columns: fwd+bwd time (median over rounds, methods interleaved) and its ratio to eager; measured peak and bytes
saved for backward after forward (`fxmem.measure`: live storages of a real steady-state step; params, grads and
SGD state included in the peak); the saved-bytes ratio eager / method; relative output error vs eager on the same
input (||out - ref|| / ||ref||); which SDPA kernel runs (from the pass's report).

Writes benchmarks/results/attention_scaling.md, .json, .png and .svg.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxmem  # noqa: E402
from fxmem.pipeline import load_passes  # noqa: E402

load_passes()
from fxmem.passes.attention import AttentionOptions, rewrite_attention  # noqa: E402

OUT = ROOT / "benchmarks" / "results"


class CausalSelfAttention(nn.Module):
    def __init__(self, d=512, h=8, n_ctx=8192, dropout=0.0):
        super().__init__()
        self.h = h
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx, dtype=torch.bool)).view(1, 1, n_ctx, n_ctx),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        if getattr(self, "no_attention", False):  # the block without attention: the non-attention memory floor
            return self.c_proj((q + k + v).transpose(1, 2).contiguous().view(B, T, C))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def loss_fn(out, inputs):
    return out.float().square().mean()


def build(method, model, x, n, args):
    if method == "eager":
        return model, {}
    if method == "noattn":
        import copy
        m = copy.copy(model)
        m.no_attention = True
        return m, {}
    p = fxmem.capture(model, (x,), dynamic=False)
    p.refresh()
    if method == "sdpa":
        opts = AttentionOptions()
    elif method == "hab":
        opts = AttentionOptions(rewrite="hab", top_k=args.top_k, chunk_size=args.chunk, tolerance=1e9)
    else:
        opts = AttentionOptions(rewrite="semiseparable", band=args.band, rank=None, tolerance=1e9)
    res = rewrite_attention(p, opts)
    p.refresh()
    (c,) = res.changes
    info = {"kind": c.kind, "backend": (c.details.get("backend") or {}).get("summary", ""),
            "rank": c.details.get("rank"), "top_k": c.details.get("top_k")}
    return p.module, info


def step_time(m, x, rounds):
    def one():
        for p in m.parameters():
            p.grad = None
        t0 = time.perf_counter()
        loss_fn(m(x), None).backward()
        return time.perf_counter() - t0
    one()  # warm-up
    return [one() for _ in range(rounds)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-n", type=int, default=4096)
    ap.add_argument("--min-n", type=int, default=256)
    ap.add_argument("--eager-max-n", type=int, default=8192, help="skip eager (and its error) above this N")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--band", type=int, default=64)
    ap.add_argument("--methods", default="eager,sdpa,hab,semi,noattn")
    ap.add_argument("--tag", default="scaling")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    methods = args.methods.split(",")
    ns = []
    n = args.min_n
    while n <= args.max_n:
        ns.append(n)
        n *= 2
    rows = []
    for n in ns:
        torch.manual_seed(0)
        model = CausalSelfAttention(n_ctx=max(ns), dropout=args.dropout)
        x = torch.randn(1, n, 512)
        built = {}
        for m in methods:
            if m == "eager" and n > args.eager_max_n:
                continue
            t0 = time.perf_counter()
            built[m] = build(m, model, x, n, args)
            built[m][1]["transform_s"] = time.perf_counter() - t0
        # error vs eager (eval mode, no dropout), same weights
        ref = None
        with torch.no_grad():
            model.eval()
            ref = model(x) if "eager" in built else None
            errs = {}
            for m, (mod, _) in built.items():
                mod.eval()
                errs[m] = float((mod(x) - ref).norm() / ref.norm()) if ref is not None and m != "noattn" \
                    else float("nan")
                mod.train()
            model.train()
        # time, interleaved
        times = {m: [] for m in built}
        for _ in range(args.rounds):
            for m, (mod, _) in built.items():
                times[m] += step_time(mod, x, 1)
        # memory (a real steady-state step per method)
        mem = {}
        for m, (mod, _) in built.items():
            prof = fxmem.measure(mod, (x,), mode="train", optimizer="sgd", loss_fn=loss_fn)
            mem[m] = (prof.peak, prof.activations)
        for m in built:
            med = statistics.median(times[m])
            rows.append({"N": n, "method": m, "ms": med * 1e3, "peak": mem[m][0], "saved": mem[m][1],
                         "rel_error": errs[m], **{k: v for k, v in built[m][1].items()}})
        base = next((r for r in rows if r["N"] == n and r["method"] == "eager"), None)
        floor = next((r for r in rows if r["N"] == n and r["method"] == "noattn"), None)
        for r in rows:
            if r["N"] == n:
                r["time_ratio"] = r["ms"] / base["ms"] if base else float("nan")
                r["saved_ratio"] = base["saved"] / r["saved"] if base else float("nan")
                # attention memory: saved bytes above the same block without attention
                r["attn_saved"] = r["saved"] - floor["saved"] if floor else float("nan")
        for r in rows:
            if r["N"] == n and base and floor:
                r["attn_ratio"] = base["attn_saved"] / max(r["attn_saved"], 1)
        for r in [r for r in rows if r["N"] == n]:
            print(f"N={n:5d} {r['method']:6s} {r['ms']:9.1f} ms  x{r['time_ratio']:.2f}  peak {mib(r['peak']):9.1f} MiB  "
                  f"saved {mib(r['saved']):9.1f} MiB (eager/this {r['saved_ratio']:.1f})  err {r['rel_error']:.2e}  "
                  f"{r.get('backend', '')}", flush=True)
    write(rows, args)


def mib(b):
    return b / 2 ** 20


def write(rows, args):
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / f"attention_{args.tag}"
    cmd = "python benchmarks/attention.py" + (f" --min-n {args.min_n}" if args.min_n != 256 else "") + \
        (f" --max-n {args.max_n}" if args.max_n != 4096 else "") + \
        (f" --rounds {args.rounds}" if args.rounds != 3 else "") + \
        (f" --dropout {args.dropout}" if args.dropout else "") + (f" --tag {args.tag}" if args.tag != "scaling" else "")
    lines = [f"# Attention pass: eager vs SDPA rewrite vs HAB vs semiseparable ({args.tag})", "",
             f"Reproduce: `{cmd}` (torch {torch.__version__}, CPU, {torch.get_num_threads()} threads). One causal "
             f"self-attention block, batch 1, 8 heads x 64, fp32, train mode, attention dropout {args.dropout:g}; "
             f"fwd+bwd median of {args.rounds} interleaved rounds. HAB top_k {args.top_k} (query blocks "
             f"{args.chunk}); semiseparable band {args.band}, rank ceil(log2 N). Memory: `fxmem.measure` of a real "
             "step (peak includes params/grads/SGD state; saved = bytes kept for backward after forward). "
             "rel. error: ||out - eager|| / ||eager|| on the same input.", "",
             "attention saved = saved minus the saved bytes of the same block without attention (noattn row: "
             "qkv and output projections only).", "",
             "| N | method | fwd+bwd ms | time / eager | measured peak MiB | saved MiB | eager saved / saved "
             "| attention saved MiB | eager / this (attention) | rel. error | SDPA kernel |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] == "noattn":
            r = {**r, "attn_saved": float("nan"), "attn_ratio": float("nan")}
        lines.append(f"| {r['N']} | {r['method']} | {r['ms']:.1f} | {r['time_ratio']:.2f} | {mib(r['peak']):.1f} | "
                     f"{mib(r['saved']):.1f} | {r['saved_ratio']:.1f} | {mib(r.get('attn_saved', float('nan'))):.2f} | "
                     f"{r.get('attn_ratio', float('nan')):.1f} | {r['rel_error']:.2e} | "
                     f"{r.get('backend') or ''} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    matplotlib.rcParams["svg.hashsalt"] = "fxmem"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m in sorted({r["method"] for r in rows}, key=["eager", "sdpa", "hab", "semi", "noattn"].index):
        rs = [r for r in rows if r["method"] == m]
        axes[0].plot([r["N"] for r in rs], [mib(r["saved"]) for r in rs], "o-", label=m)
        axes[1].plot([r["N"] for r in rs], [r["ms"] for r in rs], "o-", label=m)
    for ax, t in zip(axes, ("saved for backward (MiB)", "fwd+bwd time (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_title(t)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    fig.savefig(stem.with_suffix(".svg"), metadata={"Date": None})
    print(f"wrote {stem}.md/.json/.png/.svg")


if __name__ == "__main__":
    main()
