"""Checkpoint pass vs its anchors: memory against step time (a Pareto plot) on the decoder and the U-Net.

    python benchmarks/checkpoint_pareto.py                 # small, fast default (a few minutes on 2 cores)
    python benchmarks/checkpoint_pareto.py --full          # 6-block decoder d=128 T=128 B=8, U-Net base 32
    python benchmarks/checkpoint_pareto.py --compile       # add torch.compile (activation_memory_budget) rows
                                                           # and fxmem's module under torch.compile (slow: cold
                                                           # compiles take 30 s to minutes each on CPU)

Methods, run interleaved (one step of each method per round, the order rotated every round; step time is the
best of the rounds, the table also gives the median):
- eager: the model as written;
- uniform: every block wrapped in torch.utils.checkpoint(use_reentrant=False) (HF gradient_checkpointing style);
- fxmem@b: the checkpoint pass with a budget allowing a fraction b of the baseline's activation bytes
  (budget = estimated peak - (1 - b) * estimated activations), as a target (budget_strict: false): when b is
  below what checkpointing reaches, the pass goes as low as it can in the same run (its best effort) and the row
  is marked "(min)";
- compile@b (--compile): torch.compile with torch._functorch.config.activation_memory_budget = b;
- fxmem@b+compile (--compile): fxmem's output module at budget b under torch.compile (its default
  activation_memory_budget; the checkpoint regions are recompute-tagged).

With --compile, the goal lines also give an eager floor per budget: the least recomputation time any eager plan
needs to keep no more activation bytes than compile@b (see `recompute_items`), to tell where the goal is out of
reach for eager execution itself and where it is fxmem's to close.

Also times the pass alone on a 12-layer decoder (the < 2 s goal; capture excluded).

Columns: measured peak (fxmem.measure: live storage bytes of a real steady-state step, params/grads/optimizer state
included), activation bytes after forward, step time ratio to eager, transform (fxmem: the pass, capture excluded)
or compile time. For compiled modules a dispatch-mode tracker cannot see inside the compiled graph, so their peak is
not measured (n/a) and activation bytes are the bytes of distinct storages autograd saved, counted with
saved_tensors_hooks (fxmem.measure.saved_bytes: parameters and buffers left out, as in fxmem.measure's activations);
fxmem rows state which method was used.

Writes benchmarks/results/checkpoint_pareto.md, .png and .svg.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxmem  # noqa: E402
from fxmem.costmodel import estimate, node_costs  # noqa: E402
from fxmem.errors import BudgetError  # noqa: E402
from fxmem.measure import saved_bytes  # noqa: E402
from fxmem.pipeline import PassContext, long_lived_frozen, pass_module  # noqa: E402
from fxmem.units import Budget, format_bytes  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


class Ckpt(nn.Module):
    """Uniform per-block checkpointing (the anchor)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)


def uniform(model, name):
    m = copy.deepcopy(model)
    if name == "gpt":
        for i in range(len(m.h)):
            m.h[i] = Ckpt(m.h[i])
    else:
        for attr in ("enc1", "enc2", "bottleneck", "dec2", "dec1"):
            setattr(m, attr, Ckpt(getattr(m, attr)))
    return m


def setup(name, full):
    ex = importlib.import_module(f"examples.{name}")
    if name == "gpt":
        kw = dict(n_layer=6, d_model=128, n_head=4, block_size=128) if full else \
            dict(n_layer=4, d_model=64, n_head=4, block_size=64)
        x = ex.example_inputs(batch=8, seq_len=128) if full else ex.example_inputs(batch=4, seq_len=64)
    else:
        kw = dict(base=32) if full else {}
        x = ex.example_inputs(batch=8, size=32) if full else ex.example_inputs()
    return ex, ex.build_model(**kw), x


def fxmem_module(program, base, loss_fn, frac, acts=None):
    """The checkpoint pass at budget fraction `frac` (peak - (1 - frac) * activations), or, with `acts`, at the
    activation budget `acts` (bytes kept at the end of forward, no peak budget)."""
    ck = pass_module("checkpoint")
    budget = int(base.peak - (1 - frac) * base.activations) if acts is None else None
    opts = ck.CheckpointOptions(activation_budget=None if acts is None else Budget(bytes=int(acts)))
    note = ""
    t0 = time.perf_counter()
    # the budget as a target (budget_strict: false, as the presets set it): out of reach, the pass goes as low as
    # checkpointing does, in the same run, and says so (metrics["best_effort"])
    ctx = PassContext(policy=None, options=opts, mode="train", optimizer="adamw", budget=budget, baseline=base,
                      enabled=("checkpoint",), loss_fn=loss_fn, budget_strict=False)
    with long_lived_frozen():  # as the pass manager runs passes
        res = ck.CheckpointPass().run(program.snapshot(), ctx)
    if res.metrics.get("best_effort") is not None:
        note = "(min)"
    dt = time.perf_counter() - t0
    return res.program.module, dt, budget, note, res.metrics


_copies = iter(range(1, 1 << 30))


def own_code(model):
    """`model` with a forward of its own code object (same bytecode, a subclass per call): torch.compile caches
    compiled graphs per code object, so two copies of one class compiled under different
    activation_memory_budget values would share one graph."""
    cls = type(model)
    f = cls.forward
    code = f.__code__.replace(co_name=f"{f.__code__.co_name}_copy{next(_copies)}")
    fwd = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    model.__class__ = type(cls.__name__, (cls,), {"forward": fwd, "__module__": cls.__module__})
    return model


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def step_fn(model, x, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(*x), x).backward()
        opt.step()
    return step


def recompute_items(program, loss_fn):
    """What eager recomputation can trade: per graph node, (seconds it takes, bytes autograd saves of the storages it
    creates), and the bytes fxmem saves at no recompute at all (dropout masks kept as bool instead of float,
    compact_dropout). To keep fewer activation bytes, a plan without offload must run, in backward, the op that made
    every storage it does not keep, at least once: whatever else it does, it pays at least the cheapest such ops'
    forward time for the bytes it drops beyond the free ones (a fractional knapsack, `eager_floor`). Node times:
    the pass's own profiler (no_grad, median of 5 runs on the example inputs), less the interpreter's time per
    node. A floor for plans on this graph: rewrites that change what autograd saves (the attention pass's SDPA)
    are another pass's, and offload is left out (on a CPU host it copies to disk)."""
    ck = pass_module("checkpoint")
    kept = {n: c.kept_bytes for n, c in node_costs(program, "train", loss_fn).items()}
    times = ck.profile_nodes(program, repeats=5)
    overhead = min(times.values())  # the interpreter's own time per node (a getitem's): not the op's
    items = [(max(0.0, times[n] - overhead), b) for n, b in kept.items() if n in times and b > 0]
    free = sum(c.bytes_saved for c in ck.compact_dropout(program.snapshot()))
    return items, free


def eager_floor(items, free: int, drop: int) -> float:
    """Least seconds of recomputation that drops `drop` activation bytes (see `recompute_items`)."""
    need, secs = drop - free, 0.0
    for t, b in sorted(items, key=lambda tb: tb[0] / tb[1]):
        if need <= 0:
            break
        take = min(1.0, need / b)
        secs += take * t
        need -= take * b
    return secs if need <= 0 else float("inf")


def run_model(name, full, budgets, rounds, do_compile):
    ex, model, x = setup(name, full)
    loss_fn = ex.loss_fn
    torch.manual_seed(0)
    t0 = time.perf_counter()
    program = fxmem.capture(model, x)
    program.refresh()
    capture_s = time.perf_counter() - t0
    base = estimate(program, mode="train", loss_fn=loss_fn)
    floor_items = recompute_items(program, loss_fn) if do_compile else None
    rows = {}
    mods = {"eager": (copy.deepcopy(model), 0.0, ""), "captured": (program.snapshot().module, 0.0, ""),
            "uniform": (uniform(model, name), 0.0, "")}
    info = {}
    compiled_acts: dict[str, int] = {}  # compiled rows' saved bytes (hooks), counted once
    offset = None
    for b in budgets:
        mod, dt, budget, note, metrics = fxmem_module(program, base, loss_fn, b)
        mods[f"fxmem@{b}"] = (mod, dt, note)
        info[f"fxmem@{b}"] = metrics
    if do_compile:
        import torch._functorch.config as fcfg
        import torch._inductor.config as icfg
        # budget 1.0 too: the goal measures torch.compile's overhead against its own unconstrained step. Each
        # compiled copy gets its own forward code object (dynamo caches graphs per code object), so no copy reuses
        # or, after a dynamo reset, silently recompiles another budget's graph; cold compiles, no on-disk cache.
        for b in list(budgets) + ([1.0] if 1.0 not in budgets else []):
            with fcfg.patch(activation_memory_budget=b, enable_autograd_cache=False), \
                    icfg.patch(fx_graph_cache=False):
                c = torch.compile(own_code(copy.deepcopy(model)))
                t1 = time.perf_counter()
                step_fn(c, x, loss_fn)()  # cold compile
                mods[f"compile@{b}"] = (c, time.perf_counter() - t1, "")
        # fxmem's output stacked with torch.compile (default budget 1.0: the checkpoint regions' recompute tags
        # decide); every GraphModule copy has its own generated forward, hence its own dynamo cache entry
        for b in budgets:
            fm = torch.compile(copy.deepcopy(mods[f"fxmem@{b}"][0]))
            t1 = time.perf_counter()
            with fcfg.patch(enable_autograd_cache=False), icfg.patch(fx_graph_cache=False):
                step_fn(fm, x, loss_fn)()
            mods[f"fxmem@{b}+compile"] = (fm, time.perf_counter() - t1, "")
            info[f"fxmem@{b}+compile"] = info[f"fxmem@{b}"]
        # fxmem (eager) asked for compile@b's activation bytes, as an activation budget: fxmem's b above is a peak
        # budget (a share of the peak's activations), compile's a share of what its partitioner may save, so the
        # same b asks fxmem for fewer bytes than compile keeps (U-Net b=0.5: 7.19 vs 10.3 MiB); this row asks for
        # the bytes compile@b kept, the goal's memory side and no more. Compiled rows count saved storages
        # (hooks); fxmem.measure counts every storage live after forward, which on the captured graph is `offset`
        # more (outputs, the loss): the target is compile's count plus that
        cap = mods["captured"][0]
        offset = fxmem.measure(copy.deepcopy(cap), x, loss_fn=loss_fn).activations - saved_bytes(copy.deepcopy(cap), x)
        for b in budgets:
            acts = compiled_acts[f"compile@{b}"] = saved_bytes(mods[f"compile@{b}"][0], x)
            mod, dt, budget, note, metrics = fxmem_module(program, base, loss_fn, None, acts=acts + offset)
            mods[f"fxmem=c@{b}"] = (mod, dt, note)
            info[f"fxmem=c@{b}"] = metrics
    graphs_compiled = _unique_graphs()
    # memory
    for k, (mod, dt, note) in mods.items():
        if "compile" in k:
            # the compiled graph saves what its partitioner chose (for fxmem+compile: honouring the checkpoint
            # regions' recompute tags); saved-tensor hooks see those saves
            acts = compiled_acts[k] if k in compiled_acts else saved_bytes(mod, x)
            rows[k] = {"peak": None, "acts": acts, "acts_method": "hooks", "setup_s": dt, "note": note}
        else:
            prof = fxmem.measure(copy.deepcopy(mod), x, loss_fn=loss_fn)
            rows[k] = {"peak": prof.peak, "acts": prof.activations, "acts_method": "measure", "setup_s": dt,
                       "note": note}
            if k in ("eager", "captured"):  # the hooks count of the same model, to compare with compiled rows
                rows[k]["hooks"] = saved_bytes(copy.deepcopy(mod), x)
                rows[k]["note"] = f"(hooks: {format_bytes(rows[k]['hooks'])})"
    # interleaved timing
    steps = {k: step_fn(copy.deepcopy(m) if "compile" not in k else m, x, loss_fn) for k, (m, _, _) in
             mods.items()}
    times = {k: [] for k in mods}
    for s in steps.values():
        s()  # warm-up
    keys = list(steps)
    for i in range(rounds):
        for k in keys[i % len(keys):] + keys[:i % len(keys)]:  # rotate the order every round
            s = steps[k]
            t1 = time.perf_counter()
            s()
            times[k].append(time.perf_counter() - t1)
    if _unique_graphs() != graphs_compiled:
        raise RuntimeError(f"{name}: compiled modules recompiled after their cold compile "
                           f"({graphs_compiled} -> {_unique_graphs()} graphs): a row would not be the budget it names")
    # best of the rounds: on a shared machine the minimum is the least noisy estimate of a step's own cost
    eager_t = min(times["eager"])
    for k in mods:
        rows[k]["step_s"] = min(times[k])
        rows[k]["step_median_s"] = statistics.median(times[k])
        rows[k]["ratio"] = rows[k]["step_s"] / eager_t
    return {"name": name, "rows": rows, "capture_s": capture_s, "base": base, "info": info,
            "params": sum(p.numel() for p in model.parameters()), "floor_items": floor_items, "offset": offset}


def transform_time_12_layers(budgets=(0.1, 0.2, 0.3, 0.5, 0.7), repeats: int = 5) -> str:
    """The pass's own time (capture excluded) on a 12-layer decoder at each peak budget b (as the fxmem rows: peak
    - (1 - b) * activations), with and without the verify estimate. The budget is a target (budget_strict: false,
    as the policy presets set it): out of reach, the pass goes as low as it can in the same run; a required budget
    out of reach raises instead (timed too)."""
    ex = importlib.import_module("examples.gpt")
    model = ex.build_model(n_layer=12, d_model=128, n_head=4, block_size=128)
    x = ex.example_inputs(batch=8, seq_len=128)
    program = fxmem.capture(model, x)
    program.refresh()
    base = estimate(program, mode="train", loss_fn=ex.loss_fn)
    ck = pass_module("checkpoint")

    def timed(b, verify, strict):
        times, res = [], None
        for _ in range(repeats):  # best of `repeats`: one run is at the mercy of GC and load
            ctx = PassContext(policy=None, options=ck.CheckpointOptions(verify=verify), mode="train",
                              optimizer="adamw", budget=int(base.peak - (1 - b) * base.activations), baseline=base,
                              enabled=("checkpoint",), loss_fn=ex.loss_fn, budget_strict=strict)
            t0 = time.perf_counter()
            try:
                with long_lived_frozen():  # as the pass manager runs passes
                    res = ck.CheckpointPass().run(program.snapshot(), ctx)
            except BudgetError:
                res = None
            times.append(time.perf_counter() - t0)
        return min(times), max(times), res

    lines = ["Transform time, 12-layer decoder d=128 T=128 B=8 (capture excluded; best / worst of "
             f"{repeats}), the budget as a target:", "",
             "| b | with verify | without verify | solver | regions recomputed | budget reached | "
             "required budget out of reach: error after |", "|---|---|---|---|---|---|---|"]
    for b in budgets:
        lo, hi, res = timed(b, True, False)
        lo2, hi2, _ = timed(b, False, False)
        out_of_reach = res.metrics.get("best_effort") is not None
        err = ""
        if out_of_reach:
            elo, ehi, _ = timed(b, True, True)
            err = f"{elo:.2f} / {ehi:.2f} s"
        plan = res.metrics.get("plan", {})
        lines.append(f"| {b} | {lo:.2f} / {hi:.2f} s | {lo2:.2f} / {hi2:.2f} s | {res.metrics.get('solver') or '-'} | "
                     f"{sum(c != 'keep' for c in plan.values())} of {len(plan)} | "
                     f"{'no (as low as it goes)' if out_of_reach else 'yes'} | {err or '-'} |")
    return "\n".join(lines)


def table(res) -> str:
    lines = [f"### {res['name']} ({res['params'] / 1e6:.2f} M params; capture {res['capture_s']:.2f} s, "
             f"estimated baseline peak {format_bytes(res['base'].peak)}, activations "
             f"{format_bytes(res['base'].activations)})", "",
             "| method | measured peak | activation bytes after forward | step time ratio | step ms (best / median) | "
             "transform / compile s | plan |", "|---|---|---|---|---|---|---|"]
    for k, r in res["rows"].items():
        plan = res["info"].get(k, {}).get("plan", {})
        plan_s = " ".join(f"{p}:{c[0]}" for p, c in plan.items() if c != "keep") or ("-" if k.startswith("fxmem")
                                                                                   else "")
        acts = format_bytes(r["acts"]) + (" (hooks)" if r["acts_method"] == "hooks" else "") \
            if r["acts"] is not None else "n/a"
        lines.append(f"| {k} {r['note']} | {format_bytes(r['peak']) if r['peak'] else 'n/a'} | {acts} | "
                     f"{r['ratio']:.2f} | {r['step_s'] * 1000:.1f} / {r['step_median_s'] * 1000:.1f} | {r['setup_s']:.2f} | "
                     f"{plan_s} |")
    lines.append("")
    lines.append("plan: region:s = selective (matmul outputs kept), region:f = full recompute. "
                 "captured = fxmem.capture without passes (the graph fxmem starts from).")
    rows = res["rows"]
    u = rows["uniform"]
    dom = [k for k, r in rows.items() if k.startswith("fxmem@") and "compile" not in k
           and r["acts"] <= u["acts"] and r["ratio"] <= u["ratio"]]
    lines.append("")
    lines.append(f"fxmem points with activation bytes <= uniform's and step ratio <= uniform's: "
                 f"{', '.join(dom) or 'none'}.")
    dom_peak = [k for k, r in rows.items() if k.startswith("fxmem@") and "compile" not in k and r["peak"]
                and u["peak"] and r["peak"] <= u["peak"] and r["ratio"] <= u["ratio"]]
    lines.append(f"fxmem points with measured peak <= uniform's and step ratio <= uniform's: "
                 f"{', '.join(dom_peak) or 'none'}.")
    c1 = rows.get("compile@1.0")
    if c1 is not None:
        lines.append("")
        lines.append("Goal per budget b: activation bytes <= compile@b's, and overhead over eager <= compile@b's overhead "
                     "over compile@1.0 plus 5 points. Eager floor: the least time any eager recompute plan on this "
                     "graph spends to keep no more activation bytes than compile@b (saved-tensor hooks on both sides): "
                     "the forward time of the cheapest ops per byte covering the bytes to drop, after those dropped "
                     "for free (bool dropout masks); above the allowed overhead, no eager plan meets the goal. "
                     "\"At compile@b's bytes\": fxmem with an activation budget of the bytes compile@b kept "
                     "(passes.checkpoint.activation_budget, what activation_memory_budget bounds; fxmem's b above is "
                     "a peak budget, which asks for fewer bytes at the same b), its bytes given in the hooks' count "
                     "(measured, less what fxmem.measure counts beyond the hooks on the captured graph: "
                     f"{format_bytes(res['offset'] or 0)}).")
    for k, r in rows.items():
        if not k.startswith("compile@") or k == "compile@1.0" or c1 is None:
            continue
        b = k.split("@")[1]
        allowed = r["ratio"] / c1["ratio"] - 1 + 0.05
        parts = []
        offset = res["offset"] or 0  # what fxmem.measure counts beyond the hooks (captured graph: outputs, the loss)
        for label, f in (("fxmem (eager)", rows.get(f"fxmem@{b}")), ("fxmem+compile", rows.get(f"fxmem@{b}+compile")),
                         ("fxmem (eager) at compile@b's bytes", rows.get(f"fxmem=c@{b}"))):
            if f is None or f["acts"] is None:
                continue
            mine = f["acts"] - offset if label.endswith("bytes") else f["acts"]  # in the hooks' count, as compile's
            ok = mine <= r["acts"] and f["ratio"] - 1 <= allowed
            part = f"{label} {format_bytes(mine)}, {(f['ratio'] - 1) * 100:+.0f}% ({'met' if ok else 'not met'}"
            if label == "fxmem+compile":
                # the same executor as compile@b: its overhead over compile@1.0 against compile@b's, plus 5 points
                own = f["ratio"] / c1["ratio"] - 1
                same = f["acts"] <= r["acts"] and own <= allowed
                part += f"; {own * 100:+.0f}% over compile@1.0: {'met' if same else 'not met'} compiled vs compiled"
            parts.append(part + ")")
        if res.get("floor_items") is not None:
            # the least any eager recompute plan pays to keep no more than compile@b (hooks counts on both sides)
            items, free = res["floor_items"]
            drop = rows["captured"]["hooks"] - r["acts"]
            secs = eager_floor(items, free, drop)
            fl = secs / rows["eager"]["step_s"]
            parts.append(f"eager floor: dropping {format_bytes(max(0, drop))} ({format_bytes(min(free, max(0, drop)))} "
                         f"of it free) costs any eager recompute plan at least {secs * 1000:.1f} ms, "
                         f"{fl * 100:+.0f}% ({'unreachable in eager' if fl > allowed else 'reachable in principle'})")
        lines.append(f"- budget {b}: torch.compile {format_bytes(r['acts'])}, {(r['ratio'] - 1) * 100:+.0f}% over eager "
                     f"({(r['ratio'] / c1['ratio'] - 1) * 100:+.0f}% over compile@1.0, so at most "
                     f"{allowed * 100:+.0f}% allowed); " + "; ".join(parts))
    return "\n".join(lines)


def plot(results, path_stem):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
    if len(results) == 1:
        axes = [axes]
    for ax, res in zip(axes, results):
        for k, r in res["rows"].items():
            if r["acts"] is None:
                continue
            kind = "fxmem+compile" if k.endswith("+compile") else k.split("@")[0]
            marker = {"eager": "s", "uniform": "^", "fxmem": "o", "compile": "x", "fxmem+compile": "d",
                      "fxmem=c": "P"}.get(kind, "v")
            color = {"eager": "k", "uniform": "tab:orange", "fxmem": "tab:blue", "compile": "tab:red",
                     "fxmem+compile": "tab:purple", "fxmem=c": "tab:green"}.get(kind, "tab:gray")
            ax.scatter(r["ratio"], r["acts"] / 2 ** 20, marker=marker, color=color)
            ax.annotate(k.replace("fxmem=c@", "=c").replace("fxmem@", "").replace("compile@", "c"),
                        (r["ratio"], r["acts"] / 2 ** 20),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("step time / eager")
        ax.set_ylabel("activation MiB after forward")
        ax.set_title(res["name"])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(path_stem) + ".png", dpi=120)
    fig.savefig(str(path_stem) + ".svg")


def _loadavg() -> str:
    try:
        import os
        return f"; load average {os.getloadavg()[0]:.1f} at the end"
    except (OSError, AttributeError):
        return ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--models", default="gpt,unet")
    ap.add_argument("--budgets", default="0.1,0.2,0.3,0.5,0.7")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-transform-time", action="store_true", help="skip the 12-layer transform timing")
    ap.add_argument("--transform-time-only", action="store_true",
                    help="only the 12-layer transform timing, written to <out>_transform_time.md")
    ap.add_argument("--out", default=str(RESULTS / "checkpoint_pareto"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.transform_time_only:
        text = (f"# Checkpoint pass: transform time\n\nReproduce: `python benchmarks/checkpoint_pareto.py "
                f"--transform-time-only` (torch {torch.__version__}, CPU, {torch.get_num_threads()} threads"
                f"{_loadavg()}).\n\n" + transform_time_12_layers(budgets) + "\n")
        out = Path(args.out + "_transform_time.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(text)
        return
    results = [run_model(n, args.full, budgets, args.rounds, args.compile) for n in args.models.split(",")]
    cmd = "python benchmarks/checkpoint_pareto.py" + (" --full" if args.full else "") + \
        (" --compile" if args.compile else "")
    load = _loadavg()
    md = [f"# Checkpoint pass: memory vs step time\n\nReproduce: `{cmd}` (torch {torch.__version__}, CPU, "
          f"{torch.get_num_threads()} threads{load}). Budgets b: fxmem gets peak - (1 - b) * activations "
          f"(estimated); torch.compile gets activation_memory_budget = b. Memory columns are deterministic; "
          f"step times depend on machine load.\n"]
    md += [table(r) + "\n" for r in results]
    if not args.no_transform_time:
        md.append(transform_time_12_layers() + "\n")
    text = "\n".join(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    plot(results, out)
    print(text)


if __name__ == "__main__":
    main()
