"""The static estimate against the traced one, op by op, where an op's backward is the step's peak.

    python benchmarks/static_backward_ops.py [--out benchmarks/results]

Each row is a tiny model, Linear(32, 512) followed by one op on its output (batch 256), and a loss. The op's
backward runs first in backward and on the largest tensors, so it is where the step peaks. The traced estimate
runs the real backward formulas on fake tensors, and it equals fxmem.measure to the byte on every bundled example
(costmodel_accuracy.py). So the difference is what the static walk misses (negative) or adds (positive) at that
op's backward, in units of the op's output (256 x 512 fp32, 512 KiB).

Two losses: `mean`, whose backward makes a real output-sized gradient, and `sum`, whose backward hands the op an
expanded scalar (0 bytes), which the static walk counts as a full gradient. The last column is what the op's
backward formula holds above the gradients it makes (fxmem.costmodel.formula_temps: the real formula run once on
fake tensors with the call's shapes and requires-grad flags), which the static walk adds at that op's backward.
Writes benchmarks/results/static_backward_ops.md.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fxmem  # noqa: E402
from fxmem.costmodel import formula_temps, trace_forward  # noqa: E402

F = nn.functional
# (name, the op on the linear's output, the overload(s) it runs): the estimates run on fake tensors, so values that
# would be NaN (a square root of a negative number) do not matter
OPS = [
    ("tanh", torch.tanh), ("sigmoid", torch.sigmoid), ("exp", torch.exp), ("log", torch.log),
    ("silu", F.silu), ("softplus", F.softplus), ("mish", F.mish), ("elu", F.elu), ("leaky_relu", F.leaky_relu),
    ("hardswish", F.hardswish), ("softmax", lambda y: torch.softmax(y, -1)),
    ("log_softmax", lambda y: torch.log_softmax(y, -1)),
    ("mse_loss (none)", lambda y: F.mse_loss(y, torch.zeros_like(y), reduction="none")),
    ("smooth_l1 (none)", lambda y: F.smooth_l1_loss(y, torch.zeros_like(y), reduction="none")),
    ("square", torch.square), ("pow 3", lambda y: y.pow(3)), ("sqrt", torch.sqrt), ("rsqrt", torch.rsqrt),
    ("abs", torch.abs), ("sin", torch.sin), ("cos", torch.cos), ("reciprocal", torch.reciprocal),
    ("erf", torch.erf), ("cumsum", lambda y: y.cumsum(-1)),
    ("clamp", lambda y: y.clamp(-0.5, 0.5)), ("div (both need grad)", lambda y: y / y.exp()),
    ("x / x.norm(dim)", lambda y: y / y.norm(dim=-1, keepdim=True)),
    ("x - x.var(dim)", lambda y: y - y.var(-1, keepdim=True)),
    ("pow (tensor exponent)", lambda y: y.pow(y.exp())), ("atan2", lambda y: torch.atan2(y, y.exp())),
    ("maximum", lambda y: torch.maximum(y, y.flip(-1))), ("prod", lambda y: y * y.prod(-1, keepdim=True)),
]


class _Op(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.lin = nn.Linear(32, 512)
        self.f = f

    def forward(self, x):
        return self.f(self.lin(x))


def one_op_program(f, x):
    """Linear(32, 512) then `f`, captured on `x` (tests/test_costmodel.py checks the counted ops with it)."""
    program = fxmem.capture(_Op(f), (x,))
    program.refresh()
    return program


def estimates(program, loss: str):
    """(static, traced) estimates of a training step with loss = out.mean() or out.sum()."""
    def loss_fn(out, inputs):
        return getattr(out, loss)()
    return (fxmem.estimate(program, mode="train", loss_fn=loss_fn),
            fxmem.estimate(program, mode="train", loss_fn=loss_fn, method="traced"))


def row(name, f, x, out_bytes):
    program = one_op_program(f, x)
    cells = []
    for loss in ("mean", "sum"):
        st, tr = estimates(program, loss)
        cells.append(f"{(st.peak - tr.peak) / out_bytes:+.2f}")
    held = [f"{str(r.func).removeprefix('aten.')} {temps / out_bytes:.2f}" for r, temps in _formulas(program, x)
            if temps]
    return f"| {name} | {cells[0]} | {cells[1]} | {', '.join(held) or '-'} |"


def _formulas(program, x):
    """(record, bytes its formula holds) for every op after the linear layer, its first output's gradient made."""
    rec = trace_forward(program, (x,), {}, "train").recorder
    return [(r, formula_temps(r.call, (True,) + (False,) * (len(r.out_keys) - 1))) for r in rec.records
            if r.node != "lin" and r.call is not None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    out_bytes = 256 * 512 * 4
    lines = ["# Static estimate vs traced, op by op, at the op's backward", "",
             f"Reproduce: `python benchmarks/static_backward_ops.py` (torch {torch.__version__}). Static peak minus "
             "traced peak, in units of the op's output (256 x 512 fp32); the traced estimate runs the real backward "
             "formulas on fake tensors. Negative: the static estimate is low there.", "",
             "| op after Linear(32, 512) | loss = out.mean() | loss = out.sum() "
             "| what the formula holds above its gradients (formula_temps, in outputs) |", "|---|---|---|---|"]
    for name, f in OPS:
        lines.append(row(name, f, x, out_bytes))
        print(lines[-1], flush=True)
    path = pathlib.Path(a.out) / "static_backward_ops.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
