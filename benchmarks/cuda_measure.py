"""The measurement half of `benchmarks/cuda_check.py`: short CUDA measurements, each a list of table rows.

- `allocator_rows`: `fxmem.measure` on bundled examples beside the CUDA caching allocator on the same step, and the
  static estimate;
- `attention_rows`: one causal self-attention block (benchmarks/attention.py's) in bf16, eager manual attention vs
  the SDPA rewrite: fwd+bwd time (CUDA events, median), the allocator's peak above the step's start, the kernel;
- `offload_rows`: the decoder with activation offload to pinned host memory (tier auto on CUDA): step time, the
  device activations, how much of the copy time overlaps compute kernels on other streams, and where each step's
  time goes: the GPU's idle time and the host-side CUDA API calls taking the most time (one profiler trace).

Every function takes a `Deadline` and leaves out (with a note) what would start after it.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
import time
import warnings

from pathlib import Path

import torch
from torch.utils import _pytree as pytree

import fxmem
from fxmem.modelfile import load_model_file, split_inputs
from fxmem.units import format_bytes

DEVICE = torch.device("cuda")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_on_device(name: str, inputs: dict | None = None, **build_kwargs):
    """The bundled example `name` (its model file, as `fxmem optimize` loads it) on the GPU: (model, args, kwargs,
    loss_fn); `inputs` are keyword arguments for its example_inputs()."""
    mf = load_model_file(EXAMPLES / f"{name}.py", **build_kwargs)
    args, kwargs = mf.args, mf.kwargs
    if inputs is not None:
        args, kwargs = split_inputs(mf.module.example_inputs(**inputs))
    return mf.model.to(DEVICE), to_device(args), to_device(kwargs), mf.loss_fn


def to_device(tree, device=DEVICE):
    """`tree` with every tensor in it moved to `device`."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


class Deadline:
    """Wall-clock end of the run: `left()` seconds remain; `allows(s)` says whether s more seconds fit."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds


def gpu_ms(step, rounds: int) -> float:
    """Median wall time of `step()` on the GPU in ms (CUDA events), after one warm-up call."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_peak(step) -> int:
    """Bytes the allocator's peak rises above what is allocated when `step()` starts."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(DEVICE) - before


# ============================================================================================ measure vs allocator

def allocator_rows(names: list[str], deadline: Deadline) -> list[dict]:
    """One row per example: static estimate, fxmem's count and the allocator's counters on one AdamW step."""
    rows = []
    for name in names:
        if not deadline.allows(30):
            rows.append({"model": name, "note": "not run (time limit)"})
            continue
        model, args, kwargs, loss_fn = example_on_device(name)
        est = fxmem.estimate(fxmem.capture(model, args, kwargs), loss_fn=loss_fn)
        prof = fxmem.measure(model, args, kwargs, loss_fn=loss_fn)
        a = prof.allocator
        rows.append({"model": name, "estimate": est.peak, "fxmem": prof.peak, "activations": prof.activations,
                     "fxmem_step": prof.peak - a["tracked_start"],
                     "requested_step": a["requested_peak"] - a["requested_start"],
                     "allocated_step": a["allocated_peak"] - a["allocated_start"],
                     "allocated_peak": a["allocated_peak"], "reserved_peak": a["reserved_peak"]})
        del model, args, kwargs
        torch.cuda.empty_cache()
    return rows


# ============================================================================================ attention

def attention_rows(lengths: list[int], rounds: int, deadline: Deadline) -> list[dict]:
    """Eager manual attention and the SDPA rewrite in bf16 at each sequence length (batch 1, 8 heads x 64). A cell
    runs only if four times its method's cell at half the length (attention is quadratic) fits the time left."""
    from attention import CausalSelfAttention, build, loss_fn
    rows, last = [], {}
    for n in lengths:
        for method in ("eager", "sdpa"):
            if not deadline.allows(4 * last.get(method, 5.0)):
                rows.append({"N": n, "method": method, "note": "not run (time limit)"})
                continue
            t0 = time.monotonic()
            rows.append(_attention_cell(CausalSelfAttention, build, loss_fn, n, method, rounds))
            last[method] = time.monotonic() - t0
            torch.cuda.empty_cache()
    return rows


def _attention_cell(block_class, build, loss_fn, n: int, method: str, rounds: int) -> dict:
    torch.manual_seed(0)
    block = block_class(n_ctx=n).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, n, 512, device=DEVICE, dtype=torch.bfloat16)
    row = {"N": n, "method": method}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module, info = build(method, block, x, n, None)
        row["kernel"] = info.get("backend", "") if method == "sdpa" else "manual (matmul, softmax)"

        def step():
            for p in module.parameters():
                p.grad = None
            loss_fn(module(x), None).backward()
        row["ms"] = gpu_ms(step, rounds)
        row["peak"] = step_peak(step)
    except torch.cuda.OutOfMemoryError:
        row["note"] = "out of memory"
    return row


# ============================================================================================ offload

OFFLOAD_MODEL = dict(n_layer=8, n_head=4, d_model=256, dropout=0.0, block_size=256)
OFFLOAD_INPUTS = dict(batch=16, seq_len=256)


def offload_rows(rounds: int, deadline: Deadline) -> list[dict]:
    """The decoder as captured and with activation offload at a 50% budget (tier auto: pinned host memory)."""
    if not deadline.allows(90):  # capture, transform and two measurements: CPU-bound, about a minute
        return [{"model": "gpt", "note": "not run (time limit)"}]
    model, x, _, _ = example_on_device("gpt", OFFLOAD_INPUTS, **OFFLOAD_MODEL)
    captured = fxmem.capture(copy.deepcopy(model), x).module
    res = fxmem.transform(model, x, policy={"version": 1, "verify": {"enabled": False},
                                            "passes": {"offload": {"min_bytes": 0}}}, budget="50%")
    rows = []
    for name, module in (("captured", captured), ("offload@50%", res.module)):
        prof = fxmem.measure(copy.deepcopy(module), x, loss_fn=lambda out, inputs: out.float().pow(2).mean())

        def step(module=module):
            module.train()
            for p in module.parameters():
                p.grad = None
            module(*x).float().pow(2).mean().backward()
        row = {"model": name, "activations": prof.activations, "peak": prof.peak, "ms": gpu_ms(step, rounds)}
        events = traced_events(step)
        row.update(time_breakdown(events))
        if name != "captured":
            row.update(copy_overlap(events))
            row["tier"] = next(m.runtime.tier for m in module.modules() if hasattr(m, "runtime"))
        rows.append(row)
    return rows


STEP_MARK = "fxmem_traced_step"  # the record_function around the traced step: the trace's window for it
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of work on the device
HOST_API = ("cuda_runtime", "cuda_driver")  # trace categories of host-side CUDA API calls


def traced_events(step) -> list[dict]:
    """The profiler's Chrome-trace events of one `step()` (CPU and CUDA activity), the step and the wait for the
    GPU to finish it inside a `STEP_MARK` annotation."""
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(STEP_MARK):
            step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(path)
        return load_trace(path)


def load_trace(path) -> list[dict]:
    """The events of a Chrome-trace JSON file (the profiler's export)."""
    with open(path) as f:
        return json.load(f).get("traceEvents", [])


def copy_overlap(events: list[dict]) -> dict:
    """Per copy direction (device to host, host to device) in a trace: the copy time and the share of it during
    which a kernel runs on another stream."""
    kernels = [(e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream")) for e in events
               if e.get("cat") == "kernel" and "dur" in e]
    out = {}
    for direction in ("DtoH", "HtoD"):
        copies = [(e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream")) for e in events
                  if e.get("cat") == "gpu_memcpy" and direction in e.get("name", "") and "dur" in e]
        total = sum(end - start for start, end, _ in copies)
        hidden = sum(_covered(start, end, [(a, b) for a, b, s in kernels if s != stream])
                     for start, end, stream in copies)
        out[f"{direction}_ms"] = total / 1e3
        out[f"{direction}_overlap"] = hidden / total if total else None
        out[f"{direction}_streams"] = sorted({str(s) for *_, s in copies})
    return out


def time_breakdown(events: list[dict], top: int = 5) -> dict:
    """Where a traced step's time goes: the `STEP_MARK` window (ms), the GPU's busy time in it (the union of
    kernels, copies and memsets on every stream) and its idle time (the rest), and the `top` host-side CUDA API
    calls in it by total time: [(name, total ms, calls)]."""
    mark = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == STEP_MARK and "dur" in e]
    if not mark:
        raise ValueError(f"the trace has no {STEP_MARK!r} annotation (traced_events makes one)")
    start, end = mark[0]["ts"], mark[0]["ts"] + mark[0]["dur"]
    busy = _covered(start, end, [(e["ts"], e["ts"] + e["dur"]) for e in events
                                 if e.get("cat") in GPU_WORK and "dur" in e])
    calls: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") in HOST_API and "dur" in e and start <= e["ts"] <= end:
            calls.setdefault(e.get("name", "?"), []).append(e["dur"])
    ranked = sorted(((name, sum(durs) / 1e3, len(durs)) for name, durs in calls.items()), key=lambda c: -c[1])
    return {"traced_ms": (end - start) / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_idle_ms": (end - start - busy) / 1e3,
            "api_calls": ranked[:top]}


def _covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Length of [start, end] covered by the union of `intervals`."""
    spans = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    covered, reach = 0.0, start
    for a, b in spans:
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered


def mib(nbytes) -> str:
    return "" if nbytes is None else format_bytes(nbytes)
