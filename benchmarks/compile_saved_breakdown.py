"""What torch.compile's saved bytes are made of, on the checkpoint benchmark's models (CPU).

    python benchmarks/compile_saved_breakdown.py [--models gpt,unet] [--budgets 0.1,0.3,0.5,1.0] [--out FILE.md]

checkpoint_pareto.py compares fxmem's activation bytes with torch.compile's, counted as the distinct storages the
compiled graph saves for backward, parameters and buffers left out (`fxmem.measure.saved_bytes`). On CPU,
inductor copies each convolution weight into channels-last layout in forward and saves the copy for backward:
memory held from forward to backward like an activation, but not one, and the same at every budget. This script
splits compile's count into those weight-layout copies (saved tensors shaped like a convolution weight, in
channels-last strides, that are not the parameter) and the rest.
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from checkpoint_pareto import own_code, setup  # noqa: E402
from fxmem.measure import saved_tensors  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402


def breakdown(model, x) -> tuple[int, int]:
    """(saved bytes as saved_bytes counts them, of which channels-last copies of convolution weights), one forward."""
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 4}  # convolution weights
    saved = saved_tensors(model, x)
    copies = [t for t in saved if tuple(t.shape) in shapes and not t.is_contiguous()
              and t.is_contiguous(memory_format=torch.channels_last)]
    return (sum(t.untyped_storage().nbytes() for t in saved), sum(t.untyped_storage().nbytes() for t in copies))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,unet")
    ap.add_argument("--budgets", default="0.1,0.3,0.5,1.0")
    ap.add_argument("--out", default=None, help="also write the table, with how to reproduce it, to this file")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    lines = ["| model | compile budget | saved (as checkpoint_pareto counts) | of which weight-layout copies "
             "| the rest |", "|---|---|---|---|---|"]
    print("\n".join(lines))
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg
    for name in a.models.split(","):
        ex, model, x = setup(name, True)
        for b in (float(v) for v in a.budgets.split(",")):
            # as checkpoint_pareto compiles: its own code object (its own graph), cold, no on-disk cache
            with fcfg.patch(activation_memory_budget=b, enable_autograd_cache=False), \
                    icfg.patch(fx_graph_cache=False):
                m = torch.compile(own_code(copy.deepcopy(model)))
                ex.loss_fn(m(*x), x).backward()
                total, copies = breakdown(m, x)
            lines.append(f"| {name} | {b} | {format_bytes(total)} | {format_bytes(copies)} | "
                         f"{format_bytes(total - copies)} |")
            print(lines[-1], flush=True)
    if a.out:
        cmd = "python benchmarks/compile_saved_breakdown.py" + "".join(
            f" --{k} {v}" for k, v in (("models", a.models), ("budgets", a.budgets)))
        head = (f"# torch.compile's saved bytes, split\n\nReproduce: `{cmd}` (torch {torch.__version__}, CPU, "
                f"{torch.get_num_threads()} threads; the checkpoint benchmark's full sizes). \"Saved\" is what "
                "checkpoint_pareto.py's compile rows report (saved storages, parameters and buffers left out); "
                "weight-layout copies are the channels-last copies of convolution weights that inductor makes on CPU "
                "in each forward and saves for backward.\n\n")
        pathlib.Path(a.out).write_text(head + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
