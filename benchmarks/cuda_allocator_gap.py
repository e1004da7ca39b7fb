"""Where the CUDA allocator's step peak rises above what fxmem.measure counts (issue 34, docs/benchmarks.md#cuda).

checkpoint_pareto --device cuda found the U-Net's checkpointed steps peaking 0.5-0.6 GiB above fxmem.measure in the
allocator, its eager step not. This script runs one AdamW step of a model under a dispatch mode that reads the
allocator around every op, forward and backward: an op's transient is the allocator's peak while it runs above
what is allocated before and after it (memory the op takes and gives back: kernel workspaces, cuDNN's among them,
which are no tensors and so not in fxmem.measure or the cost model). It writes, per method (eager, and fxmem's
checkpoint pass at peak budget fraction 0.1), the step's allocator peak above its start beside fxmem.measure's, the
op during which the step peaks with its transient, and the ops with the largest transients.

    python benchmarks/cuda_allocator_gap.py                 # U-Net base 64, 128x128, batch 53 (pareto's size)
    python benchmarks/cuda_allocator_gap.py --model gpt --batch 18

Writes benchmarks/results/cuda_allocator_gap.md; without a CUDA device prints "no CUDA device" and exits 2.
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxmem  # noqa: E402
from benchmarks.checkpoint_pareto import fxmem_module, step_fn  # noqa: E402
from benchmarks.checkpoint_pareto_cuda import SHAPES  # noqa: E402
from benchmarks.cuda_measure import to_device  # noqa: E402
from fxmem.costmodel import estimate  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402

TOP = 8


class CudaAllocator:
    """The allocator's counters the probe reads (a stand-in with the same three methods can replace it)."""

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()


@dataclass
class OpTransients(TorchDispatchMode):
    """Per op: the allocator's peak during it above max(allocated before, allocated after); and the step's peak
    (the highest of those peaks) with the op it happened in."""
    memory: object
    transients: dict = field(default_factory=dict)  # op name -> (largest transient, calls)
    step_peak: int = 0
    peak_op: tuple = ("", 0)  # (op name, its transient) where the step peaked

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.memory.allocated()
        self.memory.reset_peak()
        out = func(*args, **(kwargs or {}))
        peak, after = self.memory.peak(), self.memory.allocated()
        transient = peak - max(before, after)
        name = str(func.overloadpacket.__name__)
        largest, calls = self.transients.get(name, (0, 0))
        self.transients[name] = (max(largest, transient), calls + 1)
        if peak > self.step_peak:
            self.step_peak, self.peak_op = peak, (name, transient)
        return out


def probe(module, x, loss_fn, memory) -> dict:
    """One warm step, then one probed step of `module`: allocator peak above the step's start, the op at the
    peak, the largest transients; and fxmem.measure's peak above the same kind of start."""
    step = step_fn(module, x, loss_fn)
    step()
    module.zero_grad(set_to_none=True)
    start = memory.allocated()
    with OpTransients(memory) as ops:
        step()
    module.zero_grad(set_to_none=True)
    measured = fxmem.measure(module, x, mode="train", optimizer="adamw", loss_fn=loss_fn)
    top = sorted(ops.transients.items(), key=lambda kv: -kv[1][0])[:TOP]
    counters = measured.allocator or {}
    backward = sum(calls for op, (_, calls) in ops.transients.items() if "backward" in op)
    return {"ops": sum(calls for _, calls in ops.transients.values()), "backward_ops": backward,
            "allocator": ops.step_peak - start, "live": measured.peak - counters.get("tracked_start", 0),
            "measure_allocator": counters.get("allocated_peak", 0) - counters.get("allocated_start", 0),
            "activations": measured.activations, "peak_op": ops.peak_op, "top": top}


def methods(name: str, batch: int, device):
    """(label, module) for eager and fxmem@0.1, the model's inputs and loss."""
    import importlib
    ex = importlib.import_module(f"examples.{name}")
    model_kwargs, input_kwargs = SHAPES[name]
    torch.manual_seed(0)
    model = ex.build_model(**model_kwargs).to(device)
    x = to_device(ex.example_inputs(batch=batch, **input_kwargs), device)
    program = fxmem.capture(model, x)
    program.refresh()
    base = estimate(program, mode="train", loss_fn=ex.loss_fn)
    planned, *_ = fxmem_module(program, base, ex.loss_fn, 0.1)
    return [("eager", copy.deepcopy(model)), ("fxmem@0.1", planned)], x, ex.loss_fn


COLUMNS = ("method", "ops probed (backward ones)", "allocator step peak (probed)", "same, fxmem.measure's step",
           "fxmem.measure live tensors (activations)", "op at the step's peak (its transient)",
           "largest transients: op (calls)")


def report(name: str, batch: int, rows: list[tuple[str, dict]]) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [f"# Allocator peak vs fxmem.measure, op by op ({name}, batch {batch})", "",
             f"`python benchmarks/cuda_allocator_gap.py --model {name} --batch {batch}` on {device}, torch "
             f"{torch.__version__}. Allocator: the step's peak above what was allocated when it began (no gradients "
             "then); live tensors: fxmem.measure's count above the same kind of start. Transient: the allocator's "
             "peak during an op above what was allocated before and after it.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for label, r in rows:
        top = ", ".join(f"{op} {format_bytes(t)} ({calls})" for op, (t, calls) in r["top"] if t > 0)
        op, transient = r["peak_op"]
        cells = [label, f"{r['ops']} ({r['backward_ops']})", format_bytes(r["allocator"]),
                 format_bytes(r["measure_allocator"]), f"{format_bytes(r['live'])} ({format_bytes(r['activations'])})",
                 f"{op} ({format_bytes(transient)})", top or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="unet", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=None, help="default: 53 for the U-Net, 18 for gpt (pareto's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_allocator_gap.md"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    batch = a.batch or {"unet": 53, "gpt": 18}[a.model]
    mods, x, loss_fn = methods(a.model, batch, torch.device("cuda"))
    rows = [(label, probe(module, x, loss_fn, CudaAllocator())) for label, module in mods]
    text = report(a.model, batch, rows)
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
