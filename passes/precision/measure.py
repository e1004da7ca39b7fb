"""Errors the precision pass measures: each site's own error (for the order the guard backs off in), the whole
model's output deviation and its losses after a few training steps (report figures)."""
from __future__ import annotations

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxmem import ops as optable
from fxmem.compare import deviation
from fxmem.optim import make_optimizer
from fxmem.program import deep_copy
from fxmem.step import compute_loss

from .plan import BATCH_NORMS

aten = torch.ops.aten


class _Recorder(fx.Interpreter):
    """Runs the graph, keeping the values of the nodes named in `keep`."""

    def __init__(self, gm, keep: set):
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, object] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.keep:
            # a copy: later in-place ops (relu_) must not change what was recorded
            self.values[n.name] = pytree.tree_map(
                lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)
        return out


def record_values(gm: fx.GraphModule, inputs: list[tuple[tuple, dict]], keep: set) -> list[dict]:
    was = gm.training
    gm.eval()
    res = []
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
                r = _Recorder(gm, keep)
                r.run(*flat, enable_io_processing=False)
                res.append(r.values)
    finally:
        gm.train(was)
    return res


def _err(ref, got) -> tuple[float, float]:
    d = deviation(ref, got)
    return d.max_abs, d.rel


def site_error_compute(n: fx.Node, values: list[dict], dt: torch.dtype, seed: int = 0) -> tuple[float, float]:
    """Error of running node `n` with its float inputs in `dt` (vs its fp32 outputs), over the recorded batches."""
    mx, rels = 0.0, []
    bn = optable.packet(n.target) in BATCH_NORMS
    for vals in values:
        if n.name not in vals:
            continue

        def get(a, cast_to):
            if isinstance(a, fx.Node):
                v = vals[a.name]
                if cast_to is not None and isinstance(v, torch.Tensor) and v.is_floating_point() \
                        and not (bn and a is not n.args[0]):
                    return v.to(cast_to)
                return v
            return a
        args = fx.node.map_aggregate(n.args, lambda a: get(a, dt) if isinstance(a, fx.Node) else a)
        kwargs = fx.node.map_aggregate(n.kwargs, lambda a: get(a, dt) if isinstance(a, fx.Node) else a)
        if n.target in (aten.softmax.int, aten.log_softmax.int) and len(args) > 2 and args[2] == torch.float32:
            args = args[:2] + (None,) + tuple(args[3:])
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            got = n.target(*args, **kwargs)
        got = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, got)
        m, r = _err(vals[n.name], got)
        mx, rels = max(mx, m), rels + [r]
    return mx, (max(rels) if rels else 0.0)


def site_error_module(n: fx.Node, mod: nn.Module, values: list[dict], x_node: fx.Node | None = None) \
        -> tuple[float, float]:
    mx, rels = 0.0, []
    x_node = x_node if x_node is not None else n.args[0]
    for vals in values:
        x = vals.get(x_node.name)
        if x is None or n.name not in vals:
            continue
        with torch.no_grad():
            got = mod(x)
        m, r = _err(vals[n.name], got)
        mx, rels = max(mx, m), rels + [r]
    return mx, (max(rels) if rels else 0.0)


def output_deviation(ref_gm, gm, inputs) -> dict:
    mx, rel = 0.0, 0.0
    for args, kwargs in inputs:
        outs = []
        for m in (ref_gm, gm):
            was = m.training
            m.eval()
            try:
                with torch.no_grad():
                    outs.append(m(*args, **kwargs))
            finally:
                m.train(was)
        d = deviation(*outs)
        mx, rel = max(mx, d.max_abs), max(rel, d.rel)
    return {"max_abs": mx, "rel": rel}


def losses_after_steps(gm: fx.GraphModule, args, kwargs, loss_fn, steps: int, seed: int = 0) -> list[float]:
    """Losses of `steps` training steps (AdamW, lr 1e-3) on a deep copy (the module is not changed)."""
    m = deep_copy(gm)
    m.train()
    opt = make_optimizer(m, "adamw", lr=1e-3)
    out = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps + 1):
            loss = compute_loss(loss_fn, m(*args, **kwargs), args, kwargs)
            out.append(float(loss.detach()))
            if len(out) > steps:
                break
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return out
