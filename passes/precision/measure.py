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

    def __init__(self, graph_module, keep: set):
        super().__init__(graph_module)
        self.keep = keep
        self.values: dict[str, object] = {}

    def run_node(self, node):
        out = super().run_node(node)
        if node.name in self.keep:
            # a copy: later in-place ops (relu_) must not change what was recorded
            self.values[node.name] = pytree.tree_map(
                lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)
        return out


def record_values(graph_module: fx.GraphModule, inputs: list[tuple[tuple, dict]], keep: set) -> list[dict]:
    was = graph_module.training
    graph_module.eval()
    res = []
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
                recorder = _Recorder(graph_module, keep)
                recorder.run(*flat, enable_io_processing=False)
                res.append(recorder.values)
    finally:
        graph_module.train(was)
    return res


def _err(ref, got) -> tuple[float, float]:
    difference = deviation(ref, got)
    return difference.max_abs, difference.rel


def site_error_compute(node: fx.Node, values: list[dict], dtype: torch.dtype, seed: int = 0) -> tuple[float, float]:
    """Error of running `node` with its float inputs in `dtype` (vs its fp32 outputs), over the recorded batches."""
    worst_abs, rels = 0.0, []
    batch_norm = optable.packet(node.target) in BATCH_NORMS
    for vals in values:
        if node.name not in vals:
            continue

        def get(arg, cast_to):
            if isinstance(arg, fx.Node):
                value = vals[arg.name]
                if cast_to is not None and isinstance(value, torch.Tensor) and value.is_floating_point() \
                        and not (batch_norm and arg is not node.args[0]):
                    return value.to(cast_to)
                return value
            return arg
        args = fx.node.map_aggregate(node.args, lambda a: get(a, dtype) if isinstance(a, fx.Node) else a)
        kwargs = fx.node.map_aggregate(node.kwargs, lambda a: get(a, dtype) if isinstance(a, fx.Node) else a)
        if node.target in (aten.softmax.int, aten.log_softmax.int) and len(args) > 2 and args[2] == torch.float32:
            args = args[:2] + (None,) + tuple(args[3:])
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            got = node.target(*args, **kwargs)
        got = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, got)
        batch_abs, batch_rel = _err(vals[node.name], got)
        worst_abs, rels = max(worst_abs, batch_abs), rels + [batch_rel]
    return worst_abs, (max(rels) if rels else 0.0)


def site_error_module(node: fx.Node, mod: nn.Module, values: list[dict], x_node: fx.Node | None = None) \
        -> tuple[float, float]:
    worst_abs, rels = 0.0, []
    x_node = x_node if x_node is not None else node.args[0]
    for vals in values:
        x_value = vals.get(x_node.name)
        if x_value is None or node.name not in vals:
            continue
        with torch.no_grad():
            got = mod(x_value)
        batch_abs, batch_rel = _err(vals[node.name], got)
        worst_abs, rels = max(worst_abs, batch_abs), rels + [batch_rel]
    return worst_abs, (max(rels) if rels else 0.0)


def output_deviation(reference, transformed, inputs) -> dict:
    worst_abs, worst_rel = 0.0, 0.0
    for args, kwargs in inputs:
        outs = []
        for module in (reference, transformed):
            was = module.training
            module.eval()
            try:
                with torch.no_grad():
                    outs.append(module(*args, **kwargs))
            finally:
                module.train(was)
        difference = deviation(*outs)
        worst_abs, worst_rel = max(worst_abs, difference.max_abs), max(worst_rel, difference.rel)
    return {"max_abs": worst_abs, "rel": worst_rel}


def losses_after_steps(graph_module: fx.GraphModule, args, kwargs, loss_fn, steps: int, seed: int = 0) -> list[float]:
    """Losses of `steps` training steps (AdamW, lr 1e-3) on a deep copy (the module is not changed)."""
    trained = deep_copy(graph_module)
    trained.train()
    opt = make_optimizer(trained, "adamw", lr=1e-3)
    out = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps + 1):
            loss = compute_loss(loss_fn, trained(*args, **kwargs), args, kwargs)
            out.append(float(loss.detach()))
            if len(out) > steps:
                break
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return out
