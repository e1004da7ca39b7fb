"""The precision pass on every example: bf16 compute, fp32 islands, tolerance, finite gradients."""
from __future__ import annotations

import copy
import importlib
import warnings
from pathlib import Path

import pytest
import torch

import fxmem
from fxmem.pipeline import PassContext, pass_module
from fxmem.program import Program

ROOT = Path(__file__).resolve().parent.parent
warnings.filterwarnings("ignore")

P = pass_module("precision")

ALL = ["gpt", "hf_llama", "hf_gpt2", "hf_bert", "gcn", "gat", "gnn_stan", "unet", "vit", "mlp_digits"]
# hf_gpt2's Conv1D layers are aten.addmm(bias, x, W): swapped too
WITH_LINEARS = ["gpt", "hf_llama", "hf_gpt2", "hf_bert", "gnn_stan", "vit", "mlp_digits"]
SMALL = {"gpt": dict(n_layer=1)}


_CACHE: dict = {}


def _example(name, mode="train"):
    """(example module, captured Program), cached: passes never mutate the Program they get a snapshot of;
    tests that train a result train a deep copy."""
    key = (name, mode)
    if key not in _CACHE:
        _CACHE[key] = _capture(name, mode)
    return _CACHE[key]


def _capture(name, mode):
    ex = importlib.import_module(f"examples.{name}")
    torch.manual_seed(0)
    model = ex.build_model(**SMALL.get(name, {}))
    a = ex.example_inputs()
    args, kwargs = (a, {}) if isinstance(a, tuple) else ((), a)
    prog = fxmem.capture(model, args, kwargs, mode=mode)
    prog.refresh()
    return ex, prog


def _run(prog: Program, mode="train", loss_fn=None, **opts):
    opts.setdefault("loss_steps", 0)
    opts.setdefault("report_estimate", False)  # the cost model's view is tested in test_precision.py
    ctx = PassContext(policy=None, options=P.PrecisionOptions(**opts), mode=mode, optimizer="adamw", budget=None,
                      baseline=None, enabled=("precision",), loss_fn=loss_fn)
    snap = prog.snapshot()
    return P.PrecisionPass().run(snap, ctx)  # the pass refreshes the program it returns


def _float_in_dtypes(node):
    out = []
    for a in P.node_args(node):
        v = a.meta.get("fxmem_val")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out.append(v.dtype)
    return out


def _call(prog, m=None):
    m = m or prog.module
    return m(*prog.example_args, **prog.example_kwargs)


@pytest.mark.parametrize("name", ALL)
def test_bf16_every_example(name):
    ex, prog = _example(name)
    res = _run(prog, loss_fn=getattr(ex, "loss_fn", None))
    gm = res.program.module
    # every matmul-class op reads bf16 inputs; graph outputs keep their original dtype
    n_low = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and fxmem.ops.category(n.target) in (fxmem.ops.MATMUL, fxmem.ops.ATTENTION):
            assert set(_float_in_dtypes(n)) <= {torch.bfloat16}, (n.name, _float_in_dtypes(n))
            n_low += 1
    assert n_low > 0
    # outputs within tolerance of fp32
    dev = res.metrics["output_deviation"]
    assert dev["rel"] <= 1e-2, dev
    ref = prog.module
    gm.eval(), ref.eval()
    with torch.no_grad():
        a, b = _call(prog, ref), _call(prog, gm)
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            assert y.dtype == x.dtype
    # gradients finite, every trainable parameter gets one
    gm = copy.deepcopy(gm)
    gm.train()
    out = _call(prog, gm)
    from fxmem.step import compute_loss
    loss = compute_loss(getattr(ex, "loss_fn", None), out, prog.example_args, prog.example_kwargs)
    loss.backward()
    grads = [(k, p.grad) for k, p in gm.named_parameters() if p.requires_grad]
    assert grads and all(torch.isfinite(g).all() for _, g in grads if g is not None)
    assert sum(g is not None for _, g in grads) >= len(grads) * 0.9
    assert res.metrics["sites"] and all(not s["reverted"] for s in res.metrics["sites"])
