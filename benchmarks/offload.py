"""Offload pass: measured peak and step time with and without offload, alone and with checkpointing.

    python benchmarks/offload.py            # reference decoder (examples/gpt.py), 8 blocks d=64, B=32 T=128
    python benchmarks/offload.py --small    # a quick run (4 blocks d=64, B=8 T=64)

Rows (all on the captured GraphModule, dropout 0 so gradients can be compared bit for bit):
- captured: no pass;
- offload@50%: activation offload only (tier auto = disk on this CPU host), budget 50% of the estimated peak;
- checkpoint (min): the checkpoint pass alone at the lowest peak it reaches (every block recomputed);
- checkpoint@B: the checkpoint pass alone at B = 93% of the lowest peak it reaches -> BudgetError (it cannot);
- checkpoint+offload@B: both passes at the same budget B: checkpoint recomputes blocks and offload moves the
  blocks' saved inputs to disk, prefetched one block ahead in backward;
- on a CUDA host also offload with tier cpu (pinned host memory, side stream) on the GPU.

Columns: measured peak and activation bytes after forward (fxmem.measure: live tensor storages of a real
steady-state step, params/grads/optimizer state included), the cost model's static estimate, step time (median
over interleaved rounds) and its ratio to captured, bytes offloaded per step, and whether the gradients of one
step equal the captured module's bit for bit. "Activation" memory on a CPU host means resident tensor storage:
offloaded bytes are in a scratch file (which the OS page cache may still hold; not counted).

Writes benchmarks/results/offload_gpt.md, .png and .svg.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxmem  # noqa: E402
from fxmem.costmodel import estimate  # noqa: E402
from fxmem.errors import BudgetError  # noqa: E402
from fxmem.nn.offload import OffloadRegion  # noqa: E402
from fxmem.program import Program  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _loss(out):
    return out.float().pow(2).mean()


def _grads(gm, x):
    gm = copy.deepcopy(gm)
    gm.train()
    _loss(gm(*x)).backward()
    return {n: p.grad.clone() for n, p in gm.named_parameters()}


def _offloaded_bytes(gm, x):
    gm = copy.deepcopy(gm)
    gm.train()
    regions = [m for m in gm.modules() if isinstance(m, OffloadRegion)]
    if not regions:
        return 0
    _loss(gm(*x)).backward()
    return regions[0].runtime.last_step_bytes


def _transform(model, x, passes, budget):
    t0 = time.perf_counter()
    res = fxmem.transform(copy.deepcopy(model), x, policy={"version": 1, "optimizer": "adamw", "passes": passes},
                          budget=budget, loss_fn=lambda o, i: _loss(o))
    return res, time.perf_counter() - t0


def _estimate(gm, x):
    p = Program(gm, x, {}, "train")
    p.refresh()
    return estimate(p, loss_fn=lambda o, i: _loss(o))


def _time_steps(mods: dict, x, rounds: int) -> dict:
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in mods.items()}
    times = {k: [] for k in mods}
    for r in range(rounds + 1):
        for k, m in mods.items():
            t0 = time.perf_counter()
            _loss(m(*x)).backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            if r:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--distributed", action="store_true",
                    help="instead: DDP/FSDP2 on 2 gloo processes, per-rank estimate vs measured peak")
    a = ap.parse_args()
    if a.distributed:
        return distributed()
    torch.set_num_threads(2)
    import examples.gpt as ex
    cfg = dict(n_layer=4, n_head=2, d_model=64, dropout=0.0) if a.small else \
        dict(n_layer=8, n_head=2, d_model=64, dropout=0.0)
    inp = dict(batch=8, seq_len=64) if a.small else dict(batch=32, seq_len=128)
    torch.manual_seed(0)
    model = ex.build_model(**cfg)
    x = ex.example_inputs(**inp)
    rows = []
    mods = {}

    t0 = time.perf_counter()
    captured = fxmem.capture(copy.deepcopy(model), x).module
    cap_s = time.perf_counter() - t0
    mods["captured"] = captured
    ref_grads = _grads(captured, x)

    def add(name, gm, transform_s, note=""):
        meas = fxmem.measure(copy.deepcopy(gm), x, loss_fn=lambda o, i: _loss(o))
        est = _estimate(gm, x)
        g = _grads(gm, x)
        exact = g.keys() == ref_grads.keys() and all(torch.equal(g[k], ref_grads[k]) for k in g)
        rows.append(dict(name=name, peak=meas.peak, act=meas.activations, est_peak=est.peak,
                         est_act=est.activations, offloaded=_offloaded_bytes(gm, x), exact=exact,
                         transform_s=transform_s, note=note))
        mods[name] = gm
        print(f"{name}: peak {format_bytes(meas.peak)} act {format_bytes(meas.activations)} exact {exact}",
              flush=True)

    add("captured", captured, 0.0)

    res, s = _transform(model, x, {"offload": {}}, "50%")
    add("offload@50%", res.module, s, _notes(res, "offload"))

    # checkpoint alone at its lowest: with offload enabled but doing nothing, the checkpoint pass recomputes
    # every block (its best effort) instead of raising
    res, s = _transform(model, x, {"checkpoint": {}, "offload": {"activations": False}}, "1%")
    add("checkpoint (min)", res.module, s, _notes(res, "checkpoint"))
    ck_min = min(_planned_min(res), _estimate(res.module, x).peak)
    budget = int(0.93 * ck_min)  # below the lowest peak checkpointing reaches
    try:
        _transform(model, x, {"checkpoint": {}}, budget)
        ck_alone = "reached (unexpected)"
    except BudgetError as e:
        ck_alone = "BudgetError: " + str(e).split(". ")[0]
    rows.append(dict(name=f"checkpoint@{format_bytes(budget)}", peak=None, act=None, est_peak=None, est_act=None,
                     offloaded=None, exact=None, transform_s=None, note=ck_alone))
    res, s = _transform(model, x, {"checkpoint": {}, "offload": {}}, budget)
    add(f"checkpoint+offload@{format_bytes(budget)}", res.module, s, _notes(res, "offload"))

    if torch.cuda.is_available():
        gmodel = copy.deepcopy(model).cuda()
        gx = tuple(t.cuda() for t in x)
        r0 = fxmem.transform(gmodel, gx, policy={"version": 1, "passes": {"offload": {"tier": "cpu"}}},
                             budget="50%")
        rows.append(dict(name="cuda offload@50% (tier cpu)", peak=None, act=None, est_peak=None, est_act=None,
                         offloaded=None, exact=None, transform_s=None, note=str(r0.report.passes[-1].notes)))

    times = _time_steps(mods, x, a.rounds)
    for r in rows:
        r["ms"] = times.get(r["name"], None)
        r["ms"] = None if r["ms"] is None else r["ms"] * 1e3
    base_ms = times["captured"] * 1e3
    write(rows, base_ms, cfg, inp, cap_s, a)


def distributed():
    """2 processes (gloo, 127.0.0.1): the offloaded decoder under DDP, FSDP2, FSDP2 + CPUOffloadPolicy; per-rank
    estimate (fxmem.distributed.estimate_rank) vs measured (measure_rank); equality with one process."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from tests.test_distributed import CFG, INPUTS, STEPS, WORLD, _build, _build_checkpointed, _train, _worker
    tmp = Path(tempfile.mkdtemp(prefix="fxmem-bench-dist-"))
    try:
        res, x = _build()
        res.save(tmp / "module")
        _build_checkpointed("sub-block").save(tmp / "checkpointed")
        _build_checkpointed("auto").save(tmp / "segments")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(port, str(tmp / "module"), x, str(tmp / "r.pt"), str(tmp / "checkpointed"),
                                          str(tmp / "segments")), nprocs=WORLD, join=True, start_method="spawn")
        spawn_s = time.perf_counter() - t0
        got = torch.load(tmp / "r.pt", weights_only=False)
        ref = copy.deepcopy(res.module)
        losses, grads = _train(ref, x, torch.optim.SGD(ref.parameters(), lr=0.1))
    finally:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    lines = ["# Offloaded decoder under torch.distributed (2 processes, gloo, CPU)", "",
             "Reproduce: `python benchmarks/offload.py --distributed` (the same worker as tests/test_distributed.py).",
             f"Model: examples/gpt.py {CFG}, inputs {INPUTS} split over {WORLD} ranks, activation offload regions "
             f"(disk), SGD, {STEPS} steps; spawn + run {spawn_s:.1f} s. fsdp-checkpointed / fsdp-segments: the same "
             "model checkpointed at 60% of its peak instead, with regions inside the blocks (granularity sub-block: "
             "outlined with their blocks) / with regions joining one block's MLP to the next block's first norm "
             "(granularity auto: no block is one call, every parameter is sharded with the root).", "",
             "| mode | max abs loss diff vs 1 process | max abs grad diff | per-rank estimate | measured per-rank "
             "peak | estimate / measured | sharded blocks |", "|---|---|---|---|---|---|---|"]
    ref_loss = torch.stack(losses)
    for mode, r in got.items():
        dl = (r["loss"] - ref_loss).abs().max().item()
        dg = max((r["grads"][n] - grads[n]).abs().max().item() for n in grads)
        est = r["est"]["peak"] if r["est"] else None
        meas = r["meas"]["peak"] if r["meas"] else None
        ratio = f"{est / meas:.2f}" if est and meas else "—"
        lines.append(f"| {mode} | {dl:.2e} | {dg:.2e} | {_fmt(est)} | {_fmt(meas)} | {ratio} | "
                     f"{r['blocks'] or '—'} |")
    lines += ["", "Per-rank estimate = the cost model with world_size/zero_stage (DDP 0, FSDP 3) plus DDP's gradient "
              "buckets, or FSDP2's unsharded root parameters, two unsharded blocks (of those distribute makes), "
              "with regions a block's all-gather output (with checkpoint regions a margin), and the unsharded "
              "gradients of the largest block or the root with their reduce-scatter copy "
              "(fxmem.distributed.estimate_rank). Measured = live tensor "
              "storages on rank 0 over one steady-state step (local shards of parameters and optimizer state "
              "seeded)."]
    (RESULTS / "offload_distributed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _planned_min(res) -> int:
    """The checkpoint pass's own 'lowest peak checkpointing reaches, about X' (from its note), else a large number."""
    import re

    from fxmem.units import parse_size
    for n in [p for p in res.report.passes if p.name == "checkpoint"][0].notes:
        m = re.search(r"lowest peak checkpointing reaches, about ([0-9.]+ [KMG]iB)", n)
        if m:
            return parse_size(m.group(1).replace(" ", ""))
    return 1 << 62


def _notes(res, name):
    rec = [p for p in res.report.passes if p.name == name]
    return "; ".join(rec[0].notes)[:300] if rec else ""


def _fmt(b):
    return "—" if b is None else format_bytes(b)


def write(rows, base_ms, cfg, inp, cap_s, a):
    RESULTS.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/offload.py" + (" --small" if a.small else "")
    base = rows[0]
    lines = [
        "# Offload pass: measured peak and step time",
        "",
        f"Reproduce: `{cmd}` (torch {torch.__version__}, CPU, 2 threads, no GPU: tier auto = disk, a scratch "
        f"file per step; the CUDA path (tier cpu) runs only where a GPU exists and is not in this table).",
        f"Model: examples/gpt.py {cfg}, inputs {inp}, optimizer AdamW; capture {cap_s:.1f} s.",
        "Memory = fxmem.measure (live tensor storages of a real steady-state step, params, grads and optimizer "
        "state included). On this CPU host offloaded bytes live in a scratch file: resident tensor memory drops, "
        "the OS page cache may still hold the file's pages (not counted). est = the cost model's static "
        "estimate. Step time: median of interleaved rounds on a shared 2-core machine (ratios are indicative).",
        "",
        "| method | measured peak | vs captured | activations after forward | vs captured | est. peak | "
        "est. activations | offloaded / step | step ms | time ratio | grads bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["peak"] is None:
            lines.append(f"| {r['name']} | — | — | — | — | — | — | — | — | — | {r['note']} |")
            continue
        pr = r["peak"] / base["peak"]
        ar = r["act"] / base["act"] if base["act"] else float("nan")
        lines.append(
            f"| {r['name']} | {_fmt(r['peak'])} | {pr:.2f}x | {_fmt(r['act'])} | {ar:.2f}x | {_fmt(r['est_peak'])} | "
            f"{_fmt(r['est_act'])} | {_fmt(r['offloaded'])} | {r['ms']:.1f} | {r['ms'] / base_ms:.2f} | "
            f"{'yes' if r['exact'] else 'NO'} |")
    lines.append("")
    lines.append("Notes from the passes:")
    lines.append("")
    for r in rows:
        if r["note"]:
            lines.append(f"- {r['name']}: {r['note']}")
    out = RESULTS / "offload_gpt.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        done = [r for r in rows if r["peak"] is not None]
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        names = [r["name"] for r in done]
        ax[0].barh(names, [r["peak"] / 2 ** 20 for r in done], label="measured peak")
        ax[0].barh(names, [r["act"] / 2 ** 20 for r in done], label="activations after forward")
        ax[0].set_xlabel("MiB")
        ax[0].invert_yaxis()
        ax[0].legend(fontsize=8)
        ax[0].set_title("memory (fxmem.measure)")
        ax[1].barh(names, [r["ms"] / base_ms for r in done], color="tab:gray")
        ax[1].axvline(1.0, color="k", lw=0.8)
        ax[1].set_xlabel("step time / captured")
        ax[1].invert_yaxis()
        ax[1].set_yticklabels([])
        ax[1].set_title("step time ratio")
        fig.tight_layout()
        for ext in ("png", "svg"):
            fig.savefig(RESULTS / f"offload_gpt.{ext}", metadata={"Date": None} if ext == "svg" else None)
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
