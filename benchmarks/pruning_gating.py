"""Cold-neuron pruning and gated residual branches on real data that ships with the installed packages.

    python benchmarks/pruning_gating.py            # ~20 min on 2 busy CPU cores; writes benchmarks/results/
    python benchmarks/pruning_gating.py --quick --out /tmp/bench    # smaller sweeps (for a smoke run)

Models (trained here, on CPU, each in well under a minute):
- digits MLP: examples/mlp_digits.py (`build_model(trained=True)`: 64-256-256-10 ReLU MLP on sklearn's
  `load_digits`, images 0..1499 train, 1500.. held out);
- text model: examples/gpt.py at 2 layers / d_model 64 / 4 heads, trained on byte windows of Python standard
  library sources (the model file's calibration modules), evaluated on held-out stdlib text (argparse.py):
  next-byte accuracy and cross-entropy (nats/byte);
- residual digits MLP (for gating): Linear(64, 128) -> 4 x [x + MLP(LayerNorm(x))] -> Linear(128, 10).

Pruning (passes/pruning.py via its Pass API, calibration = the model file's `calibration_data()`):
a raw sweep of `fraction` 0..0.5 with the guard off (`guard: false`: accuracy, parameters / FLOPs removed, forward
time ratio), then each of `fraction` 0.25 / 0.5 / 0.9 under the guard's defaults (fxmem/lossguard.py), judged by
top-1 agreement on held-out calibration items and, in a second row, by the held-out accuracy (`evaluate`, higher
is better, drop at most 1 pt): each row says what was asked, what was achieved and what stopped it
(`fxmem.intent`). No retraining anywhere.

Gating (passes/gating.py + fxmem.gating_loss): gates inserted exactly open, then the gated model (base + gates) is
fine-tuned for a few epochs with task loss + lambda * gating_loss; evaluated in eval mode with hard gates
(threshold 0.5, per-sample skipping). Skip rate = share of branch rows not computed (all branches have equal cost
in the residual MLP; in the GPT, attention and MLP branches are reported together).

Forward time ratios are best-of-N wall-clock times on a shared machine: indicative only; FLOPs are the measure.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxmem  # noqa: E402
from fxmem.intent import intent_line  # noqa: E402
from fxmem.lossguard import Evaluator  # noqa: E402
from fxmem.nn.gating import gates, gating_loss, reset_skip_stats, skip_stats  # noqa: E402
from fxmem.pipeline import PassContext, load_passes  # noqa: E402

load_passes()
from fxmem.passes.gating import GatingOptions, GatingPass  # noqa: E402
from fxmem.passes.pruning import PruningOptions, PruningPass  # noqa: E402

import examples.gpt as gpt_ex  # noqa: E402
import examples.mlp_digits as digits_ex  # noqa: E402

OUT = ROOT / "benchmarks" / "results"


# ============================================================================================ helpers
def fwd_time(module, x, reps=40) -> float:
    """Best-of-`reps` eval forward time (the minimum is the least disturbed by other load on the machine)."""
    module.eval()
    with torch.no_grad():
        for _ in range(3):
            module(x)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            module(x)
            ts.append(time.perf_counter() - t0)
    return min(ts)


def ctx(opts, calibration, evaluate=None, mode="inference"):
    return PassContext(policy=None, options=opts, mode=mode, optimizer="none", budget=None, baseline=None,
                       enabled=(), calibration=calibration, evaluate=evaluate)


def prune(program, opts, calibration, evaluate=None):
    r = PruningPass().run(program.snapshot(), ctx(opts, calibration, evaluate))
    if r.modified:
        r.program.refresh()
    return r


def asked_vs_achieved(r) -> str:
    """The pass's intent line without the pass name: asked, achieved, and what stopped it when short."""
    return "; ".join(intent_line("pruning", it.to_dict()).removeprefix("pruning: ") for it in r.intents) or "-"


# ============================================================================================ text model
def train_gpt(steps: int, seed=0):
    torch.manual_seed(seed)
    model = gpt_ex.build_model(n_layer=2, d_model=64, n_head=4, block_size=64, dropout=0.0)
    data = gpt_ex._text_bytes(gpt_ex._CALIB_MODULES)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - 65, (16,), generator=g)
        x = torch.stack([data[s:s + 64] for s in starts])
        loss = gpt_ex.loss_fn(model(x), (x,))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def gpt_eval(module, n_batches=8):
    """(next-byte accuracy, cross-entropy nats/byte) on held-out stdlib text (argparse.py)."""
    module.eval()
    correct = total = 0
    losses = []
    for (x,) in gpt_ex._windows(gpt_ex._text_bytes(gpt_ex._HELDOUT_MODULES), n_batches, 8, 64):
        out = module(x)
        losses.append(gpt_ex.loss_fn(out, (x,)).item())
        pred = out[:, :-1].argmax(-1)
        correct += (pred == x[:, 1:]).sum().item()
        total += pred.numel()
    return correct / total, sum(losses) / len(losses)


# ============================================================================================ pruning
def mlp_params(gm, names) -> int:
    return sum(p.numel() for n, p in gm.named_parameters() if any(n.startswith(k) for k in names))


def pruning_rows(label, program, evaluate, calibration, mlp_names, fractions, guarded, x_time):
    rows = []
    base_mlp = mlp_params(program.module, mlp_names)
    base_metric = evaluate(program.module)
    t0 = fwd_time(program.module, x_time)

    def row(setting, fraction, r):
        m = evaluate(r.program.module) if r.modified else base_metric
        return dict(model=label, setting=setting, fraction=fraction, metric=m, drop=base_metric - m,
                    mlp_removed=(1 - mlp_params(r.program.module, mlp_names) / base_mlp) if r.modified else 0.0,
                    params_removed=r.metrics.get("params_removed", 0),
                    flops_removed=r.metrics.get("flops_removed_share", 0.0),
                    time_ratio=fwd_time(r.program.module, x_time) / t0 if r.modified else 1.0,
                    intent=asked_vs_achieved(r))
    for f in fractions:
        if f == 0:
            rows.append(dict(model=label, setting="fraction 0 (original)", fraction=0.0, metric=base_metric,
                             drop=0.0, mlp_removed=0.0, params_removed=0, flops_removed=0.0, time_ratio=1.0,
                             intent="-"))
            continue
        rows.append(row(f"fraction {f:.1f} (guard off)", f, prune(
            program, PruningOptions(fraction=f, min_keep=1, guard=False), calibration)))
    for f in guarded:
        for judge, ev in (("top-1 agreement", None), ("evaluate", Evaluator(evaluate, "max"))):
            r = prune(program, PruningOptions(fraction=f, min_keep=1), calibration, ev)
            rows.append(row(f"fraction {f:.2f}, guard: {judge}", float("nan"), r))
    return rows


# ============================================================================================ gating
class ResDigits(nn.Module):
    def __init__(self, d=128, n=4):
        super().__init__()
        self.inp = nn.Linear(64, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.ReLU(),
                                                  nn.Linear(2 * d, d)) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def digits_data():
    x, y = digits_ex._load()
    return x[:1500], y[:1500], x[1500:], y[1500:]


def fit(model, x, y, epochs, lr, lam=0.0, gated=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(x.shape[0], generator=g)
        for s in range(0, x.shape[0], 64):
            idx = perm[s:s + 64]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            if gated and lam:
                loss = loss + lam * gating_loss(model)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


@torch.no_grad()
def accuracy(model, x, y):
    model.eval()
    return (model(x).argmax(-1) == y).float().mean().item()


def total_skip(gm) -> float:
    st = skip_stats(gm)
    rows = sum(v["rows"] for v in st.values())
    return sum(v["rows_skipped"] for v in st.values()) / rows if rows else 0.0


def gating_digits(lams, epochs):
    xtr, ytr, xte, yte = digits_data()
    torch.manual_seed(0)
    base = fit(ResDigits(), xtr, ytr, epochs=20, lr=3e-3)
    acc0 = accuracy(base, xte, yte)
    t_base = fwd_time(base, xte)
    rows = [dict(model="residual digits MLP", lam="-", threshold="-", metric=acc0, drop=0.0, skip=0.0,
                 time_ratio=1.0, note="original")]
    p = fxmem.capture(base, (xtr[:32],), mode="train")
    p.refresh()
    r = GatingPass().run(p.snapshot(), ctx(GatingOptions(targets=["blocks.*"]), None, mode="train"))
    r.program.refresh()
    gm0 = r.program.module
    assert len(gates(gm0)) == 4
    assert accuracy(gm0, xte, yte) == acc0  # exactly open at insertion
    rows.append(dict(model="residual digits MLP", lam="-", threshold=0.5, metric=acc0, drop=0.0, skip=0.0,
                     time_ratio=1.0, note="gates inserted (exactly open)"))
    import copy
    for lam in lams:
        gm = copy.deepcopy(gm0)
        fit(gm, xtr, ytr, epochs=epochs, lr=1e-3, lam=lam, gated=True)
        for thr in (0.5,):
            for m in gates(gm).values():
                m.threshold = thr
            reset_skip_stats(gm)
            acc = accuracy(gm, xte, yte)
            skip = total_skip(gm)
            rows.append(dict(model="residual digits MLP", lam=lam, threshold=thr, metric=acc, drop=acc0 - acc,
                             skip=skip, time_ratio=fwd_time(gm, xte) / t_base,
                             note=f"fine-tuned {epochs} epochs with gates"))
    return rows


def gating_gpt(base, lams, steps):
    acc0, ce0 = gpt_eval(base)
    x_time = gpt_ex._windows(gpt_ex._text_bytes(gpt_ex._HELDOUT_MODULES), 1, 8, 64)[0][0]
    t_base = fwd_time(base, x_time, reps=10)
    rows = [dict(model="GPT (bytes)", lam="-", threshold="-", metric=acc0, drop=0.0, skip=0.0, time_ratio=1.0,
                 note=f"original, CE {ce0:.3f}")]
    p = fxmem.capture(base, gpt_ex.example_inputs(batch=8, seq_len=64), mode="train")
    p.refresh()
    r = GatingPass().run(p.snapshot(), ctx(GatingOptions(), None, mode="train"))
    r.program.refresh()
    gm0 = r.program.module
    import copy
    data = gpt_ex._text_bytes(gpt_ex._CALIB_MODULES)
    for lam in lams:
        gm = copy.deepcopy(gm0)
        opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        gm.train()
        for _ in range(steps):
            starts = torch.randint(0, data.numel() - 65, (16,), generator=g)
            x = torch.stack([data[s:s + 64] for s in starts])
            loss = gpt_ex.loss_fn(gm(x), (x,)) + lam * gating_loss(gm)
            opt.zero_grad()
            loss.backward()
            opt.step()
        reset_skip_stats(gm)
        acc, ce = gpt_eval(gm)
        per = ", ".join(f"{k.replace('h.', '')} {100 * v['skip_rate']:.0f}%" for k, v in skip_stats(gm).items())
        rows.append(dict(model="GPT (bytes)", lam=lam, threshold=0.5, metric=acc, drop=acc0 - acc,
                         skip=total_skip(gm), time_ratio=fwd_time(gm, x_time, reps=10) / t_base,
                         note=f"fine-tuned {steps} steps, CE {ce:.3f}; skipped: {per}"))
    return rows


# ============================================================================================ output
def md_table(rows, cols, fmt):
    head = "| " + " | ".join(c for c, _ in cols) + " |"
    sep = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append("| " + " | ".join(fmt.get(k, str)(r[k]) for _, k in cols) + " |")
    return "\n".join(lines)


def pct(x):
    return "-" if x != x else f"{100 * x:.1f}%"


def plot_pruning(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    for label in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == label and r["fraction"] == r["fraction"]]
        ax[0].plot([100 * r["fraction"] for r in rs], [100 * r["metric"] for r in rs], "o-", label=label)
        ax[1].plot([100 * r["mlp_removed"] for r in rs], [100 * r["drop"] for r in rs], "o-", label=label)
    ax[0].set_xlabel("fraction of each group's units pruned (%)")
    ax[0].set_ylabel("held-out accuracy (%)")
    ax[1].set_xlabel("MLP parameters removed (%)")
    ax[1].set_ylabel("accuracy drop (pt)")
    ax[1].axhline(0.5, color="gray", ls=":", lw=1)
    ax[1].axvline(20, color="gray", ls=":", lw=1)
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_gating(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for label in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == label and r["lam"] != "-"]
        ax.plot([100 * r["skip"] for r in rs], [100 * r["drop"] for r in rs], "o-", label=label)
        for r in rs:
            ax.annotate(f"λ={r['lam']}", (100 * r["skip"], 100 * r["drop"]), fontsize=7)
    ax.set_xlabel("branch compute skipped (%)")
    ax.set_ylabel("accuracy drop (pt)")
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.axvline(30, color="gray", ls=":", lw=1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _save(fig, stem: Path):
    import matplotlib
    import matplotlib.pyplot as plt
    with matplotlib.rc_context({"svg.hashsalt": "fxmem-bench"}):
        fig.savefig(stem.with_suffix(".png"), dpi=110, metadata={"Software": None})
        fig.savefig(stem.with_suffix(".svg"), metadata={"Date": None})
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpt-steps", type=int, default=300)
    ap.add_argument("--out", default=str(OUT), help="where the tables and plots go (default benchmarks/results)")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fractions = [0.0, 0.2, 0.5] if a.quick else [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    t_all = time.perf_counter()

    # ---- pruning: digits
    print("training digits MLP ...", flush=True)
    dm = digits_ex.build_model(trained=True)
    dp = fxmem.capture(dm, digits_ex.example_inputs(), mode="inference")
    dp.refresh()
    x_time = digits_ex._load()[0][1500:1756]
    guarded = [0.25, 0.9] if a.quick else [0.25, 0.5, 0.9]
    rows = pruning_rows("digits MLP (ReLU)", dp, digits_ex.evaluate, digits_ex.calibration_data(n_batches=16),
                        ["net."], fractions, guarded, x_time)
    # ---- pruning: text
    print("training byte-level GPT ...", flush=True)
    t0 = time.perf_counter()
    gm_text = train_gpt(a.gpt_steps // (4 if a.quick else 1))
    print(f"  trained in {time.perf_counter() - t0:.0f} s; held-out accuracy/CE {gpt_eval(gm_text)}", flush=True)
    tp = fxmem.capture(gm_text, gpt_ex.example_inputs(batch=4, seq_len=64), mode="inference")
    tp.refresh()
    xt = gpt_ex._windows(gpt_ex._text_bytes(gpt_ex._HELDOUT_MODULES), 1, 8, 64)[0][0]
    rows += pruning_rows("GPT bytes (GELU)", tp, lambda m: gpt_eval(m)[0],
                         gpt_ex.calibration_data(n_batches=16, batch=4, seq_len=64),
                         [f"h.{i}.mlp." for i in range(2)], fractions, guarded, xt)
    cols = [("model", "model"), ("setting", "setting"), ("held-out accuracy", "metric"), ("drop (pt)", "drop"),
            ("MLP params removed", "mlp_removed"), ("params removed", "params_removed"),
            ("fwd FLOPs removed", "flops_removed"), ("fwd time ratio", "time_ratio"),
            ("asked vs achieved", "intent")]
    fmt = {"metric": lambda v: f"{100 * v:.2f}%", "drop": lambda v: f"{100 * v:+.2f}",
           "mlp_removed": pct, "flops_removed": pct, "time_ratio": lambda v: f"{v:.2f}"}
    table_p = md_table(rows, cols, fmt)
    print(table_p)
    plot_pruning(rows, out / "pruning_accuracy")

    # ---- gating
    print("gating: residual digits MLP ...", flush=True)
    lams = [0.0, 0.02] if a.quick else [0.0, 0.005, 0.01, 0.02, 0.05]
    grows = gating_digits(lams, epochs=4 if a.quick else 6)
    print("gating: GPT ...", flush=True)
    grows += gating_gpt(gm_text, [0.0, 0.05] if a.quick else [0.0, 0.02, 0.1], 40 if a.quick else 80)
    gcols = [("model", "model"), ("lambda", "lam"), ("threshold", "threshold"), ("held-out accuracy", "metric"),
             ("drop vs original (pt)", "drop"), ("drop vs λ=0 fine-tune (pt)", "drop_ft"), ("branch rows skipped", "skip"), ("fwd time ratio", "time_ratio"),
             ("note", "note")]
    gfmt = {"metric": lambda v: f"{100 * v:.2f}%", "drop": lambda v: f"{100 * v:+.2f}", "skip": pct,
            "drop_ft": lambda v: "-" if v != v else f"{100 * v:+.2f}",
            "time_ratio": lambda v: f"{v:.2f}", "lam": str, "threshold": str}
    for model in dict.fromkeys(r["model"] for r in grows):
        ft0 = [r for r in grows if r["model"] == model and r["lam"] == 0.0]
        for r in grows:
            if r["model"] == model:
                r["drop_ft"] = (ft0[0]["metric"] - r["metric"]) if ft0 and r["lam"] != "-" else float("nan")
    table_g = md_table(grows, gcols, gfmt)
    print(table_g)
    plot_gating(grows, out / "gating_tradeoff")
    cmd = "python benchmarks/pruning_gating.py" + (" --quick" if a.quick else "")
    hdr = (f"Reproduce: `{cmd}` (torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; "
           f"total {time.perf_counter() - t_all:.0f} s on a shared machine; time ratios are best-of-N wall clock, indicative only)\n\n")
    (out / "pruning_table.md").write_text(
        "# Cold-neuron pruning, no retraining\n\n" + hdr + table_p + "\n\n![](pruning_accuracy.png)\n")
    (out / "gating_table.md").write_text(
        "# Gated residual branches (hard gates at inference, per-sample skipping)\n\n" + hdr + table_g
        + "\n\n![](gating_tradeoff.png)\n")
    print(f"wrote {out}/pruning_table.md, gating_table.md and plots", flush=True)


if __name__ == "__main__":
    main()
