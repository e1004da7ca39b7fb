"""Checkpoint pass vs its anchors: memory against step time (a Pareto plot) on the decoder and the U-Net.

    python benchmarks/checkpoint_pareto.py                 # small, fast default (a few minutes on 2 cores)
    python benchmarks/checkpoint_pareto.py --full          # 6-block decoder d=128 T=128 B=8, U-Net base 32
    python benchmarks/checkpoint_pareto.py --compile       # add torch.compile (activation_memory_budget) rows
                                                           # and fxmem's module under torch.compile (slow: cold
                                                           # compiles take 30 s to minutes each on CPU)
    python benchmarks/checkpoint_pareto.py --device cuda   # on a GPU: every method, torch.compile's included, at
                                                           # the batch whose estimated peak is 4 GiB, the CUDA
                                                           # allocator's peak for every row, under --time-limit
                                                           # (default 270 s); "no CUDA device" and exit 2 without one

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
  activation_memory_budget; the checkpoint regions and remat sites are recompute-tagged);
- fxmem@b+compile@b (--compile): the same under torch.compile at activation_memory_budget = b, both given the
  one budget: the partitioner honours fxmem's tags and chooses what else to recompute at its budget. Its goal:
  to dominate compile@b, no more activation bytes and no more than 2 points more step time;
- fxmem=c@b+compile (--compile): fxmem planned for the activation bytes compile@b kept (the row fxmem=c@b), under
  torch.compile at its default budget: fxmem's plan, sized to compile's bytes, executed by the compiler;
- fxmem<=c@b+compile (--compile): fxmem planned so that its compiled step saves no more than compile@b's
  (passes.checkpoint.compiled_activation_budget, both read off the compiler's partition by
  fxmem.costmodel.compiled_saves), under torch.compile at its default budget; "(flops)": the same with
  recomputation priced by FLOPs alone (passes.checkpoint.cost: flops); "(timed)": the same fitted at partitioner
  budgets 1, (1 + b) / 2 and b (passes.checkpoint.compiler_budgets), the fastest compiled step of the plans that fit
  kept (timed by the pass) and compiled at its budget.

--kinds runs a subset of the methods after eager, captured and uniform (compile,fit_stack,fit_timed: the fitted
rows and what they are compared with).

With --compile, the goal lines also give an eager floor per budget: the least recomputation time any eager plan
needs to keep no more activation bytes than compile@b (benchmarks/eager_floor.py: each recomputed op's inputs kept
or recomputed too, an op reading a kept input priced where backward runs it; the bound at forward times and the
older bound, each op dropped alone, beside it), to tell where the goal is out of reach for
eager execution itself and where it is fxmem's to close, and fxmem's recompute time at compile@b's bytes against
it (issue 33's goal: within 1.15x).

Also times the pass alone on a 12-layer decoder (the < 2 s goal; capture excluded).

Columns: measured peak (fxmem.measure: live storage bytes of a real steady-state step, params/grads/optimizer state
included), activation bytes after forward, step time ratio to eager, transform (fxmem: the pass, capture excluded)
or compile time. For compiled modules a dispatch-mode tracker cannot see inside the compiled graph, so their peak is
not measured (n/a) and activation bytes are the bytes of distinct storages autograd saved, counted with
saved_tensors_hooks (fxmem.measure.saved_bytes: parameters and buffers left out, as in fxmem.measure's activations);
fxmem rows state which method was used.

Writes benchmarks/results/checkpoint_pareto.md, .png and .svg (--device cuda: checkpoint_pareto_cuda.*;
benchmarks/checkpoint_pareto_cuda.py holds the device side).
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib
import statistics
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxmem  # noqa: E402
from fxmem.costmodel import estimate  # noqa: E402
from fxmem.compiled_budget import options_at  # noqa: E402
from fxmem.costmodel import compiled_saves  # noqa: E402
from fxmem.errors import BudgetError  # noqa: E402
from fxmem.measure import saved_bytes  # noqa: E402
from fxmem.pipeline import PassContext, long_lived_frozen, pass_module  # noqa: E402
from fxmem.step_timing import interleaved_times  # noqa: E402
from fxmem.units import Budget, format_bytes, parse_size  # noqa: E402

from benchmarks import checkpoint_pareto_cuda as cuda_side  # noqa: E402
from benchmarks.eager_floor import EagerFloor  # noqa: E402
from benchmarks.recompute_clock import clocked_seconds  # noqa: E402

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


def fxmem_module(program, base, loss_fn, frac, acts=None, **options):
    """The checkpoint pass at budget fraction `frac` (peak - (1 - frac) * activations), or, with `acts`, at the
    activation budget `acts` (bytes kept at the end of forward, no peak budget); `options`: more of its
    CheckpointOptions (frac and acts None: only the limits they set, compiled_activation_budget)."""
    ck = pass_module("checkpoint")
    budget = int(base.peak - (1 - frac) * base.activations) if acts is None and frac is not None else None
    opts = ck.CheckpointOptions(activation_budget=None if acts is None else Budget(bytes=int(acts)), **options)
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


def step_fn(model, x, loss_fn, after_forward=None):
    """One AdamW training step of `model` on `x`, as a closure; `after_forward()` runs once the loss is computed,
    before backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*x), x)
        if after_forward is not None:
            after_forward()
        loss.backward()
        opt.step()
    return step


@dataclass
class Bench:
    """One model's methods as they are built: per row key the module, its transform / compile seconds and a note;
    the pass's metrics per fxmem row; compiled rows' saved bytes (hooks), counted once; what fxmem.measure counts
    beyond the hooks on the captured graph (`offset`, for the rows at compile's bytes)."""
    model: nn.Module
    x: tuple
    loss_fn: Callable
    program: Any
    base: Any
    mods: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    compiled_acts: dict = field(default_factory=dict)
    offset: int | None = None


ROW_KEYS = {"fxmem": "fxmem@{0}", "compile": "compile@{0}", "stack": "fxmem@{0}+compile",
            "stack_at_b": "fxmem@{0}+compile@{0}", "bytes": "fxmem=c@{0}", "bytes_stack": "fxmem=c@{0}+compile",
            "fit_stack": "fxmem<=c@{0}+compile", "fit_stack_flops": "fxmem<=c@{0}+compile (flops)",
            "fit_timed": "fxmem<=c@{0}+compile (timed)"}
# the row a method is built from, at the same budget
NEEDS = {"stack": "fxmem", "stack_at_b": "fxmem", "bytes": "compile", "bytes_stack": "bytes"}


def row_key(kind: str, b: float) -> str:
    return ROW_KEYS[kind].format(b)


def jobs(budgets, do_compile: bool, by_budget: bool = False, kinds=None) -> list[tuple[str, float]]:
    """`jobs_all`'s (kind, budget) pairs, only of `kinds` when given (with compile@1.0, which the goal lines need,
    whenever compile is among them)."""
    out = jobs_all(budgets, do_compile, by_budget)
    if kinds is None:
        return out
    return [(kind, b) for kind, b in out if kind in kinds or (kind, b) == ("compile", 1.0) and "compile" in kinds]


def jobs_all(budgets, do_compile: bool, by_budget: bool = False) -> list[tuple[str, float]]:
    """(kind, budget) of every method after the anchors, in build order: fxmem at each budget, then torch.compile
    at each budget and 1.0, fxmem+compile (compile's default budget, then b), fxmem at compile's bytes; `by_budget`
    (a run under a time limit, which cuts the end): fxmem, compile@1.0, then compile@b and fxmem at its bytes budget
    by budget, fxmem+compile last."""
    out = [("fxmem", b) for b in budgets]
    if not do_compile:
        return out
    if not by_budget:
        compile_budgets = list(budgets) + ([1.0] if 1.0 not in budgets else [])
        return out + [("compile", b) for b in compile_budgets] + [("stack", b) for b in budgets] + \
            [("stack_at_b", b) for b in budgets] + [("bytes", b) for b in budgets] + \
            [("bytes_stack", b) for b in budgets] + [("fit_stack", b) for b in budgets] + \
            [("fit_stack_flops", b) for b in budgets] + [("fit_timed", b) for b in budgets]
    pairs = [(kind, b) for b in budgets for kind in ("compile", "bytes") if (kind, b) != ("compile", 1.0)]
    stacked = [(kind, b) for kind in ("stack", "stack_at_b", "bytes_stack", "fit_stack", "fit_stack_flops",
                                      "fit_timed") for b in budgets]
    return out + [("compile", 1.0)] + pairs + stacked


def add_fxmem(bench: Bench, b: float) -> None:
    mod, dt, _, note, metrics = fxmem_module(bench.program, bench.base, bench.loss_fn, b)
    bench.mods[f"fxmem@{b}"] = (mod, dt, note)
    bench.info[f"fxmem@{b}"] = metrics


def add_compile(bench: Bench, b: float) -> None:
    """torch.compile at activation_memory_budget b (budget 1.0 too: the goal measures torch.compile's overhead
    against its own unconstrained step). Each compiled copy gets its own forward code object (dynamo caches graphs
    per code object), so no copy reuses or, after a dynamo reset, silently recompiles another budget's graph; cold
    compiles, no on-disk cache."""
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg
    with fcfg.patch(activation_memory_budget=b, enable_autograd_cache=False), icfg.patch(fx_graph_cache=False):
        c = torch.compile(own_code(copy.deepcopy(bench.model)))
        t1 = time.perf_counter()
        step_fn(c, bench.x, bench.loss_fn)()  # cold compile
        bench.mods[f"compile@{b}"] = (c, time.perf_counter() - t1, "")


def add_stacked(bench: Bench, b: float, kind: str = "stack") -> None:
    """An fxmem row stacked with torch.compile: kind "stack", fxmem@b at compile's default budget 1.0 (the recompute
    tags of the checkpoint regions and remat sites decide); "stack_at_b", fxmem@b at activation_memory_budget b as
    well; "bytes_stack", fxmem=c@b (planned for compile@b's bytes) at the default budget. Every GraphModule copy has
    its own generated forward, hence its own dynamo cache entry."""
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg
    source = row_key(NEEDS[kind], b)
    fm = torch.compile(copy.deepcopy(bench.mods[source][0]))
    budget = {"activation_memory_budget": b} if kind == "stack_at_b" else {}
    t1 = time.perf_counter()
    with fcfg.patch(enable_autograd_cache=False, **budget), icfg.patch(fx_graph_cache=False):
        step_fn(fm, bench.x, bench.loss_fn)()
    bench.mods[row_key(kind, b)] = (fm, time.perf_counter() - t1, "")
    bench.info[row_key(kind, b)] = bench.info[source]


def add_at_compile_bytes(bench: Bench, b: float) -> None:
    """fxmem (eager) asked for compile@b's activation bytes, as an activation budget: fxmem's b is a peak budget (a
    share of the peak's activations), compile's a share of what its partitioner may save, so the same b asks fxmem
    for fewer bytes than compile keeps (U-Net b=0.5: 7.19 vs 10.3 MiB); this row asks for the bytes compile@b kept,
    the goal's memory side and no more. Compiled rows count saved storages (hooks); fxmem.measure counts every
    storage live after forward, which on the captured graph is `offset` more (outputs, the loss): the target is
    compile's count plus that."""
    mod, dt, _, note, metrics = fxmem_module(bench.program, bench.base, bench.loss_fn, None,
                                             acts=compile_bytes_target(bench, b))
    bench.mods[f"fxmem=c@{b}"] = (mod, dt, note)
    bench.info[f"fxmem=c@{b}"] = metrics


def add_fit_stacked(bench: Bench, b: float, cost: str = "roofline", compiler_budgets=None) -> None:
    """fxmem planned so that its step under torch.compile (default budget) saves no more than compile@b's does
    (passes.checkpoint.compiled_activation_budget, both counted by `fxmem.costmodel.compiled_saves`, the compiler's
    own partition: compile@b's bytes taken from the model as compiled in the compile@b row), its recomputation
    priced by `cost` (passes.checkpoint.cost: "flops" leaves pointwise ops nearly free, as inductor's fused
    recomputation makes them: the fit_stack_flops row); then compiled. With `compiler_budgets` ("auto": b, halfway
    to 1, and 1; the fit_timed row) the plan is fitted at each partitioner budget and the fastest compiled step of
    those that fit is kept (measured by the pass), then compiled at the budget chosen (fxmem.compile_options)."""
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg
    target = compiled_saves(bench.model, bench.x, activation_memory_budget=b).total
    if compiler_budgets == "auto":  # what the option's "auto" is for the fraction b (the target here is bytes)
        compiler_budgets = [1.0, (1.0 + b) / 2, b]
    mod, search_s, _, note, metrics = fxmem_module(bench.program, bench.base, bench.loss_fn, None,
                                                   compiled_activation_budget=Budget(bytes=target), cost=cost,
                                                   compiler_budgets=compiler_budgets)
    chosen = metrics.get("compiler_budget")
    fm = torch.compile(copy.deepcopy(mod), options=options_at(chosen))
    t1 = time.perf_counter()
    with fcfg.patch(enable_autograd_cache=False), icfg.patch(fx_graph_cache=False):
        step_fn(fm, bench.x, bench.loss_fn)()
    key = row_key("fit_timed" if compiler_budgets else "fit_stack" if cost == "roofline" else f"fit_stack_{cost}",
                  b)
    # what compiled_saves read off the partition against the hooks' count of the real compiled step, to the byte
    predicted, measured = metrics["compiled"]["saves"], saved_bytes(fm, bench.x)
    bench.compiled_acts[key] = measured
    check = "compiled_saves = hooks" if predicted == measured else \
        f"compiled_saves {predicted:,} B, hooks {measured:,} B"
    at = "" if chosen is None else f"compiled at {chosen:g}, "
    bench.mods[key] = (fm, search_s + time.perf_counter() - t1, f"{note} ({at}{check})".strip())
    bench.info[key] = metrics


def compile_bytes_target(bench: Bench, b: float) -> int:
    """The activation budget that asks fxmem for compile@b's bytes (built already): the storages its compiled step
    saves (hooks), plus what fxmem.measure counts beyond the hooks on the captured graph (`hooks_offset`)."""
    acts = bench.compiled_acts[f"compile@{b}"] = saved_bytes(bench.mods[f"compile@{b}"][0], bench.x)
    return acts + hooks_offset(bench)


def hooks_offset(bench: Bench) -> int:
    """What fxmem.measure counts beyond the saved-tensor hooks on the captured graph (outputs, the loss), once."""
    if bench.offset is None:
        cap = bench.mods["captured"][0]
        bench.offset = fxmem.measure(copy.deepcopy(cap), bench.x, loss_fn=bench.loss_fn).activations - \
            saved_bytes(copy.deepcopy(cap), bench.x)
    return bench.offset


BUILDERS = {"fxmem": add_fxmem, "compile": add_compile, "stack": add_stacked,
            "stack_at_b": functools.partial(add_stacked, kind="stack_at_b"), "bytes": add_at_compile_bytes,
            "bytes_stack": functools.partial(add_stacked, kind="bytes_stack"), "fit_stack": add_fit_stacked,
            "fit_stack_flops": functools.partial(add_fit_stacked, cost="flops"),
            "fit_timed": functools.partial(add_fit_stacked, compiler_budgets="auto")}


def build_methods(bench: Bench, todo, planner=None) -> dict[str, str]:
    """Build each (kind, budget) of `todo` into bench.mods. With a `planner` (a run under a time limit:
    `allows(kind, rows)`, `record(kind, seconds)`), a method it does not allow, one whose base row is missing, or
    one that fails is left out: {row key: why}."""
    left_out = {}
    for kind, b in todo:
        key, base = row_key(kind, b), NEEDS.get(kind)
        if planner is None:
            BUILDERS[kind](bench, b)
            continue
        if base is not None and row_key(base, b) not in bench.mods:
            left_out[key] = f"not run ({row_key(base, b)} was not)"
        elif not planner.allows(kind, len(bench.mods) + 1):
            left_out[key] = "not run (time limit)"
        else:
            left_out.update(planner.timed(kind, key, lambda: BUILDERS[kind](bench, b)))
    return left_out


def memory_rows(bench: Bench, extra=None) -> dict:
    """Per row: peak and activation bytes (fxmem.measure; compiled rows, whose insides a dispatch-mode tracker
    cannot see: the distinct storages autograd saved, counted with saved-tensor hooks), and the columns
    `extra(key, module)` adds (CUDA: the allocator's)."""
    rows = {}
    for k, (mod, dt, note) in bench.mods.items():
        if "compile" in k:
            # the compiled graph saves what its partitioner chose (for fxmem+compile: honouring the checkpoint
            # regions' recompute tags); saved-tensor hooks see those saves
            acts = bench.compiled_acts[k] if k in bench.compiled_acts else saved_bytes(mod, bench.x)
            rows[k] = {"peak": None, "acts": acts, "acts_method": "hooks", "setup_s": dt, "note": note}
        else:
            rows[k] = measured_row(k, mod, dt, note, bench)
        if extra is not None:
            rows[k].update(extra(k, mod))
    return rows


def measured_row(key: str, mod, setup_s: float, note: str, bench: Bench) -> dict:
    """fxmem.measure's peak and activations of one row (on CUDA also its peak above the step's start)."""
    prof = fxmem.measure(copy.deepcopy(mod), bench.x, loss_fn=bench.loss_fn)
    row = {"peak": prof.peak, "acts": prof.activations, "acts_method": "measure", "setup_s": setup_s, "note": note}
    if prof.allocator:
        row["measure_step"] = prof.peak - prof.allocator["tracked_start"]
    if key in ("eager", "captured"):  # the hooks count of the same model, to compare with compiled rows
        row["hooks"] = saved_bytes(copy.deepcopy(mod), bench.x)
        row["note"] = f"(hooks: {format_bytes(row['hooks'])})"
    return row


def step_times(bench: Bench, rounds: int, sync=lambda: None) -> dict[str, list[float]]:
    """Interleaved timing: after a warm-up step each, one step of each method per round, the order rotated every
    round; `sync()` (CUDA: synchronize) runs before and after each timed step."""
    steps = {k: step_fn(copy.deepcopy(m) if "compile" not in k else m, bench.x, bench.loss_fn)
             for k, (m, _, _) in bench.mods.items()}
    for s in steps.values():
        s()  # warm-up
    return interleaved_times(steps, rounds, sync)


def run_model(name, full, budgets, rounds, do_compile, device_run=None, kinds=None):
    """Every method on one model: memory, then interleaved step times. `device_run`
    (checkpoint_pareto_cuda.DeviceRun): the model at the size its estimate picks, a time limit, synchronized timing
    and the allocator's columns; None: the CPU run at `full`'s size."""
    ex, model, x, size_note = (*setup(name, full), "") if device_run is None else device_run.setup(name)
    loss_fn = ex.loss_fn
    torch.manual_seed(0)
    t0 = time.perf_counter()
    program = fxmem.capture(model, x)
    program.refresh()
    capture_s = time.perf_counter() - t0
    base = estimate(program, mode="train", loss_fn=loss_fn)
    # the eager floor times nodes with the pass's profiler: host time, which on CUDA is the kernels' launch only
    floor = EagerFloor.of(program, loss_fn) if do_compile and device_run is None else None
    bench = Bench(model, x, loss_fn, program, base)
    bench.mods.update({"eager": (copy.deepcopy(model), 0.0, ""), "captured": (program.snapshot().module, 0.0, ""),
                       "uniform": (uniform(model, name), 0.0, "")})
    if device_run is not None:
        device_run.calibrate(step_fn(copy.deepcopy(model), x, loss_fn))
    left_out = build_methods(bench, jobs(budgets, do_compile, by_budget=device_run is not None, kinds=kinds),
                             device_run)
    graphs_compiled = _unique_graphs()
    rows = memory_rows(bench, None if device_run is None else device_run.allocator_extra(bench, step_fn))
    times = step_times(bench, rounds, device_run.sync if device_run is not None else lambda: None)
    if _unique_graphs() != graphs_compiled:
        raise RuntimeError(f"{name}: compiled modules recompiled after their cold compile "
                           f"({graphs_compiled} -> {_unique_graphs()} graphs): a row would not be the budget it names")
    # best of the rounds: on a shared machine the minimum is the least noisy estimate of a step's own cost
    eager_t = min(times["eager"])
    for k in bench.mods:
        rows[k]["step_s"] = min(times[k])
        rows[k]["step_median_s"] = statistics.median(times[k])
        rows[k]["rounds_s"] = times[k]  # one step per round, the rounds in the same order for every row
        rows[k]["ratio"] = rows[k]["step_s"] / eager_t
    if floor is not None:  # (the rows the floor is compared with: their recomputation clocked where it runs)
        for k, (module, _, _) in bench.mods.items():
            if k.startswith("fxmem=c@"):
                rows[k]["clocked_s"] = clocked_seconds(module, step_fn(module, x, loss_fn), max(10, rounds // 2))[0]
    order = ["eager", "captured", "uniform"] + [row_key(kind, b) for kind, b in jobs(budgets, do_compile, kinds=kinds)]
    return {"name": name, "rows": {k: rows[k] for k in order if k in rows}, "capture_s": capture_s, "base": base,
            "info": bench.info, "params": sum(p.numel() for p in model.parameters()), "floor": floor,
            "offset": bench.offset, "left_out": left_out, "size_note": size_note,
            "device": "cpu" if device_run is None else device_run.device.type}


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


# CUDA runs add these columns (row key): the allocator's count for every row, fxmem.measure's beside it
CUDA_COLUMNS = (("allocator peak above step start", "alloc_peak"),
                ("fxmem.measure peak above step start", "measure_step"),
                ("allocator after forward, above step start", "alloc_acts"))


def table(res) -> str:
    return "\n".join(method_lines(res) + dominance_lines(res["rows"]) + goal_lines(res))


def method_lines(res) -> list[str]:
    """The title and one table row per method (then those left out, and why), with the plan legend."""
    extra = CUDA_COLUMNS if res.get("device") == "cuda" else ()
    size = f"{res['size_note']}; " if res.get("size_note") else ""
    lines = [f"### {res['name']} ({res['params'] / 1e6:.2f} M params; {size}capture {res['capture_s']:.2f} s, "
             f"estimated baseline peak {format_bytes(res['base'].peak)}, activations "
             f"{format_bytes(res['base'].activations)})", "",
             "| method | measured peak | " + "".join(f"{title} | " for title, _ in extra) +
             "activation bytes after forward | step time ratio | step ms (best / median) | "
             "transform / compile s | plan |", "|---" * (7 + len(extra)) + "|"]
    for k, r in res["rows"].items():
        plan_s = plan_string(res["info"].get(k, {}).get("plan", {})) or ("-" if k.startswith("fxmem") else "")
        acts = format_bytes(r["acts"]) + (" (hooks)" if r["acts_method"] == "hooks" else "") \
            if r["acts"] is not None else "n/a"
        cells = "".join(f"{format_bytes(r[key]) if r.get(key) is not None else 'n/a'} | " for _, key in extra)
        lines.append(f"| {k} {r['note']} | {format_bytes(r['peak']) if r['peak'] else 'n/a'} | {cells}{acts} | "
                     f"{r['ratio']:.2f} | {r['step_s'] * 1000:.1f} / {r['step_median_s'] * 1000:.1f} | {r['setup_s']:.2f} | "
                     f"{plan_s} |")
    lines += [f"| {k} {why} |" + " |" * (6 + len(extra)) for k, why in res.get("left_out", {}).items()]
    lines.append("")
    lines.append("plan: region:s = selective (matmul outputs kept), region:f = full recompute. "
                 "captured = fxmem.capture without passes (the graph fxmem starts from).")
    return lines


def plan_string(plan: dict) -> str:
    """The regions a plan recomputes, as "module path:choice initial" (region:s selective, region:f full)."""
    return " ".join(f"{path}:{choice[0]}" for path, choice in plan.items() if choice != "keep")


def dominance_lines(rows) -> list[str]:
    """Which fxmem points are at least as good as uniform checkpointing on both axes."""
    u = rows["uniform"]
    dom = [k for k, r in rows.items() if k.startswith("fxmem@") and "compile" not in k
           and r["acts"] <= u["acts"] and r["ratio"] <= u["ratio"]]
    dom_peak = [k for k, r in rows.items() if k.startswith("fxmem@") and "compile" not in k and r["peak"]
                and u["peak"] and r["peak"] <= u["peak"] and r["ratio"] <= u["ratio"]]
    return ["", f"fxmem points with activation bytes <= uniform's and step ratio <= uniform's: "
                f"{', '.join(dom) or 'none'}.",
            f"fxmem points with measured peak <= uniform's and step ratio <= uniform's: "
            f"{', '.join(dom_peak) or 'none'}."]


def goal_lines(res) -> list[str]:
    """The goal against torch.compile, one line per budget compiled (needs compile@1.0)."""
    rows = res["rows"]
    c1 = rows.get("compile@1.0")
    if c1 is None:
        return []
    lines = ["", "Goal per budget b: activation bytes <= compile@b's, and overhead over eager <= compile@b's overhead "
             "over compile@1.0 plus 5 points. Eager floor: the least time any eager recompute plan on this "
             "graph spends to keep no more activation bytes than compile@b (saved-tensor hooks on both sides): "
             "the time of the ops it must run again, each recomputed op's inputs kept or recomputed "
             "too, an op that reads a kept input at its time where backward runs it (benchmarks/backward_times.py), "
             "one inside a recomputed chain at its forward time, dropout masks kept packed or drawn again "
             "(benchmarks/eager_floor.py; the floor at forward times alone in brackets; \"each op dropped "
             "alone\": the cheapest ops per byte at forward time, inputs ignored); above the allowed overhead, no "
             "eager plan "
             "meets the goal. fxmem's recompute time: its step at compile@b's bytes less the captured graph's (the "
             "program fxmem starts from) in the same round, median over the rounds (and quartiles); and clocked: "
             "its recomputations timed where they run in backward, each one's least over half as many steps as "
             "rounds, summed (benchmarks/recompute_clock.py; the floor's estimator, apart from the step noise), "
             "which the 1.15x verdict reads. "
             "\"At compile@b's bytes\": fxmem with an activation budget of the bytes compile@b kept "
             "(passes.checkpoint.activation_budget, what activation_memory_budget bounds; fxmem's b above is "
             "a peak budget, which asks for fewer bytes at the same b), its bytes given in the hooks' count "
             "(measured, less what fxmem.measure counts beyond the hooks on the captured graph: "
             f"{format_bytes(res['offset'] or 0)})."]
    return lines + [goal_line(res, k, r, c1) for k, r in rows.items()
                    if k.startswith("compile@") and k != "compile@1.0"]


def goal_line(res, key: str, r: dict, c1: dict) -> str:
    """Budget b's line: compile@b against fxmem (eager), fxmem+compile, fxmem at compile@b's bytes, whether each
    stacked row dominates compile@b, the floor."""
    rows = res["rows"]
    b = key.split("@")[1]
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
    for label, stacked in (("fxmem, then compiled at its default budget", f"fxmem@{b}+compile"),
                           ("fxmem+compile@b", f"fxmem@{b}+compile@{b}"),
                           ("fxmem at compile@b's bytes, then compiled", f"fxmem=c@{b}+compile"),
                           ("fxmem fitted to compile@b's compiled saves, then compiled", f"fxmem<=c@{b}+compile"),
                           ("the same priced by FLOPs", f"fxmem<=c@{b}+compile (flops)"),
                           ("the same fitted at partitioner budgets 1, halfway and b, the fastest compiled step kept "
                            "(timed)", f"fxmem<=c@{b}+compile (timed)")):
        if rows.get(stacked) is not None:
            parts.append(stacked_part(label, rows[stacked], r))
    if res.get("floor") is not None:
        parts.append(floor_part(res, r, allowed, b))
    return (f"- budget {b}: torch.compile {format_bytes(r['acts'])}, {(r['ratio'] - 1) * 100:+.0f}% over eager "
            f"({(r['ratio'] / c1['ratio'] - 1) * 100:+.0f}% over compile@1.0, so at most "
            f"{allowed * 100:+.0f}% allowed); " + "; ".join(parts))


def stacked_part(label: str, stacked: dict, r: dict) -> str:
    """A stacked row against compile@b: dominance is no more activation bytes and no more than 2 points more step
    time (ratios to eager)."""
    ok = stacked["acts"] <= r["acts"] and stacked["ratio"] <= r["ratio"] + 0.02
    return (f"{label} {format_bytes(stacked['acts'])}, {(stacked['ratio'] - 1) * 100:+.0f}% "
            f"({'dominates' if ok else 'does not dominate'} compile@b: bytes <= its, at most 2 points slower)")


def floor_part(res, r: dict, allowed: float, b: str) -> str:
    """The least any eager recompute plan pays to keep no more than compile@b (hooks counts on both sides), and
    fxmem's recompute time at compile@b's bytes against it (issue 33's goal: within 1.15x)."""
    rows = res["rows"]
    floor = res["floor"]
    drop = rows["captured"]["hooks"] - r["acts"]
    secs, loose = floor.seconds(drop), floor.knapsack_seconds(drop)
    eager = rows["eager"]["step_s"]
    fl = secs / eager
    part = (f"eager floor: dropping {format_bytes(max(0, drop))} ({format_bytes(min(floor.free, max(0, drop)))} "
            f"of it free) costs any eager recompute plan at least {secs * 1000:.1f} ms "
            f"({floor.forward_seconds(drop) * 1000:.1f} at forward times), {fl * 100:+.0f}% "
            f"({'unreachable in eager' if fl > allowed else 'reachable in principle'}; {loose * 1000:.1f} ms with "
            f"each op dropped alone)")
    at_bytes = rows.get(f"fxmem=c@{b}")
    if at_bytes is not None and secs > 0:
        spent, low, high = paired_difference(at_bytes["rounds_s"], rows["captured"]["rounds_s"])
        part += (f"; fxmem at compile@b's bytes recomputes for {spent * 1000:.1f} ms (quartiles {low * 1000:.1f}-"
                 f"{high * 1000:.1f}), {spent / secs:.2f}x the floor")
        clocked = at_bytes.get("clocked_s")
        if clocked is not None:
            part += (f"; clocked in backward {clocked * 1000:.1f} ms, {clocked / secs:.2f}x the floor "
                     f"({'within' if clocked <= 1.15 * secs else 'above'} 1.15x)")
    return part


def paired_difference(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of one row's step time less another's in the same round: steps timed next to each
    other share the machine's state, so their difference is steadier than a difference of bests (the two bests
    can come from rounds minutes apart)."""
    diffs = sorted(t - b for t, b in zip(times, base))
    quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
    return quartiles[1], quartiles[0], quartiles[2]


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


CUDA_BUDGETS = "0.1,0.3,0.5,0.7"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the methods, torch.compile's included, at sizes the estimate picks, with the "
                         "CUDA allocator's counts, under --time-limit")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--models", default="gpt,unet")
    ap.add_argument("--budgets", default=None,
                    help=f"fractions b (default 0.1,0.2,0.3,0.5,0.7; with --device cuda {CUDA_BUDGETS})")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--kinds", default=None,
                    help=f"only these methods after eager, captured and uniform (comma-separated, of "
                         f"{','.join(ROW_KEYS)}; compile brings compile@1.0), e.g. compile,fit_stack")
    ap.add_argument("--no-transform-time", action="store_true", help="skip the 12-layer transform timing")
    ap.add_argument("--transform-time-only", action="store_true",
                    help="only the 12-layer transform timing, written to <out>_transform_time.md")
    ap.add_argument("--time-limit", type=float, default=None,
                    help=f"--device cuda: seconds for the whole run (default {cuda_side.TIME_LIMIT_S:.0f}); what "
                         "would start after it is left out, with a note")
    ap.add_argument("--target", default=None,
                    help=f"--device cuda: the estimated eager peak each model's batch is chosen for (default "
                         f"{cuda_side.TARGET})")
    ap.add_argument("--out", default=None, help="output path without suffix (default benchmarks/results/"
                                                "checkpoint_pareto, with --device cuda checkpoint_pareto_cuda)")
    args = ap.parse_args(argv)
    if args.device == "cpu" and (args.time_limit is not None or args.target is not None):
        ap.error("--time-limit and --target apply to --device cuda")
    if args.device == "cuda" and (args.full or args.transform_time_only):
        ap.error("--full and --transform-time-only apply to CPU runs (on CUDA the estimate picks the sizes)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        return main_cuda(args)
    torch.set_num_threads(2)
    budgets = [float(b) for b in (args.budgets or "0.1,0.2,0.3,0.5,0.7").split(",")]
    out = Path(args.out or RESULTS / "checkpoint_pareto")
    if args.transform_time_only:
        text = (f"# Checkpoint pass: transform time\n\nReproduce: `python benchmarks/checkpoint_pareto.py "
                f"--transform-time-only` (torch {torch.__version__}, CPU, {torch.get_num_threads()} threads"
                f"{_loadavg()}).\n\n" + transform_time_12_layers(budgets) + "\n")
        out = Path(str(out) + "_transform_time.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(text)
        return 0
    kinds = None if args.kinds is None else set(args.kinds.split(","))
    results = [run_model(n, args.full, budgets, args.rounds, args.compile, kinds=kinds)
               for n in args.models.split(",")]
    cmd = "python benchmarks/checkpoint_pareto.py" + (" --full" if args.full else "") + \
        (" --compile" if args.compile else "") + (f" --rounds {args.rounds}" if args.rounds != 9 else "") + \
        (" --no-transform-time" if args.no_transform_time else "") + \
        (f" --kinds {args.kinds}" if args.kinds else "") + (f" --budgets {args.budgets}" if args.budgets else "") + \
        (f" --models {args.models}" if args.models != "gpt,unet" else "")
    load = _loadavg()
    md = [f"# Checkpoint pass: memory vs step time\n\nReproduce: `{cmd}` (torch {torch.__version__}, CPU, "
          f"{torch.get_num_threads()} threads{load}). Budgets b: fxmem gets peak - (1 - b) * activations "
          f"(estimated); torch.compile gets activation_memory_budget = b. Memory columns are deterministic; "
          f"step times depend on machine load.\n"]
    md += [table(r) + "\n" for r in results]
    if not args.no_transform_time:
        md.append(transform_time_12_layers() + "\n")
    write_outputs("\n".join(md), results, out)
    return 0


def write_outputs(text: str, results, out: Path) -> None:
    """`out`.md with `text`, the Pareto plot of the models that ran as .png and .svg; `text` printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    plot([r for r in results if "rows" in r], out)
    print(text)


def main_cuda(args) -> int:
    """--device cuda: every method at sizes the estimate picks, under the time limit; exit 2 without a CUDA
    device, 1 when a model failed (its section says how; the other's is written)."""
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    started = time.monotonic()
    run = cuda_side.DeviceRun("cuda", args.time_limit or cuda_side.TIME_LIMIT_S, rounds=args.rounds,
                              target=parse_size(args.target or cuda_side.TARGET))
    budgets = [float(b) for b in (args.budgets or CUDA_BUDGETS).split(",")]
    names = args.models.split(",")
    results = [model_on_device(run, name, len(names) - i, budgets, args.rounds) for i, name in enumerate(names)]
    sections = [table(r) if "rows" in r else f"### {r['name']}\n\n{r['not_run']}" for r in results]
    text = "\n".join([cuda_header(args, run, budgets, time.monotonic() - started)] + [s + "\n" for s in sections])
    write_outputs(text, results, Path(args.out or RESULTS / "checkpoint_pareto_cuda"))
    return 1 if any(r.get("not_run", "").startswith("failed") for r in results) else 0


def model_on_device(run, name: str, models_left: int, budgets, rounds: int) -> dict:
    """run_model on the device with its share of the time left, or {"name", "not_run": why}."""
    if not run.start_model(models_left):
        return {"name": name, "not_run": "not run (time limit)"}
    try:
        return run_model(name, False, budgets, rounds, True, run)
    except Exception as e:  # noqa: BLE001 - the report says what broke; the next model still runs
        traceback.print_exc()
        return {"name": name, "not_run": f"failed: {cuda_side.one_line(e)}"}


def cuda_header(args, run, budgets, seconds: float) -> str:
    props = torch.cuda.get_device_properties(0)
    cmd = "python benchmarks/checkpoint_pareto.py --device cuda" + \
        (f" --time-limit {args.time_limit:g}" if args.time_limit else "") + \
        (f" --target {args.target}" if args.target else "") + (f" --budgets {args.budgets}" if args.budgets else "")
    return (f"# Checkpoint pass on CUDA: memory vs step time\n\nReproduce: `{cmd}` ({torch.cuda.get_device_name(0)}, "
            f"{props.total_memory / 2 ** 30:.1f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}; time "
            f"limit {args.time_limit or cuda_side.TIME_LIMIT_S:.0f} s, took {seconds:.0f} s). Each model runs at the "
            f"largest batch whose estimated eager training peak (fxmem.estimate, AdamW) is at most "
            f"{format_bytes(run.target)}. Budgets b ({', '.join(map(str, budgets))}): fxmem gets peak - (1 - b) * "
            "activations (estimated); torch.compile gets activation_memory_budget = b.\n\n"
            "Memory: measured peak and activation bytes as on CPU (fxmem.measure; compiled rows: the storages "
            "autograd saved, by saved-tensor hooks). Allocator peak above step start: "
            "torch.cuda.max_memory_allocated over one steady-state step less what was allocated when it began "
            "(parameters and optimizer state of every method built, no gradients), for every row, compiled ones "
            "included; fxmem.measure peak above step start: fxmem's live-tensor count over its own step, from "
            "the same kind of start; allocator after forward: allocated once the loss is computed, above the "
            "step's start. Step time: wall time with the device synchronized before and after each step, one "
            f"step of each method per round, the order rotated every round, best / median of {args.rounds}. "
            "A method that would start after the model's share of the time limit is listed as not run; one "
            "running is not stopped. The eager floor (CPU runs) is left out: the pass's node profiler times "
            "the host, which on CUDA is the kernels' launch.\n")


if __name__ == "__main__":
    sys.exit(main())
