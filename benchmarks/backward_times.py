"""What recomputing each node costs where backward would run it: its op timed at its first save's unpack.

The eager floor (benchmarks/eager_floor.py) prices a recomputed node at its forward time, measured by running the
graph in order: each op reads inputs the op before it just wrote, from cache. A recomputation in backward reads
inputs that were kept since the forward, from memory: on the reference decoder at compile@0.7's bytes, where
fxmem's plan recomputes only GELUs, layer norms and dropout remakes, its recomputation clocked in backward took about
twice the floor built from forward times (benchmarks/results/region_recipes_runs/). A floor built
from forward times alone is one no plan reaches, the floor's own plan included.

`backward_node_times(program, loss_fn)` measures the other end: it runs training steps of the captured graph,
every node's inputs and output held, and at the first unpack of a save of a node's output it runs the node's op
again on its recorded inputs (no_grad, result dropped) and times it: the node's recomputation as the first backward
op that reads it would meet it. A dropout's output is timed as fxmem remakes it from a kept mask
(`fxmem.nn.dropout.remake`). In-place ops and ops that are not aten overloads are not timed. Holding every
value changes what the allocator reuses, so the times lean to the slow side of what a plan meets; the floor uses
them only for nodes whose inputs a plan keeps (a recomputed chain's later ops read what the op before made, and
keep their forward time).

    times = backward_node_times(program, loss_fn, steps=5)   # node name -> seconds (least over the steps)
"""
from __future__ import annotations

import time

import torch
from torch import fx

from fxmem.nn.bitmask import pack
from fxmem.nn.dropout import remake

DROPOUT = "aten.dropout.default"


class _Recorder(fx.Interpreter):
    """Runs the graph, holding each node's output and the arguments it ran with; maps output storages to nodes."""

    def __init__(self, module):
        super().__init__(module)
        self.calls: dict[str, tuple] = {}
        self.outputs: dict[str, object] = {}
        self.node_of: dict[int, fx.Node] = {}

    def run_node(self, node):
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        out = super().run_node(node)
        if node.op == "call_function" and _timeable(node):
            self.calls[node.name] = (node.target, args, kwargs)
            self.outputs[node.name] = out
            for value in (out if isinstance(out, (list, tuple)) else (out,)):
                if isinstance(value, torch.Tensor):
                    self.node_of.setdefault(value.untyped_storage()._cdata, node)  # the producer, not a view
        return out


def _timeable(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable


class _FirstUnpackTimer:
    """Saved-tensor hooks: each save remembers its storage; the first unpack of a node's save times the node's op."""

    def __init__(self, recorder: _Recorder):
        self.recorder = recorder
        self.seconds: dict[str, float] = {}
        self.masks: dict[str, torch.Tensor] = {}

    def pack(self, tensor):
        return tensor, tensor.untyped_storage()._cdata

    def unpack(self, packed):
        tensor, key = packed
        node = self.recorder.node_of.get(key)
        if node is not None and node.name not in self.seconds:
            self.seconds[node.name] = self._time(node)
        return tensor

    def _time(self, node: fx.Node) -> float:
        target, args, kwargs = self.recorder.calls[node.name]
        with torch.no_grad():
            if str(target) == DROPOUT and args[2]:
                x, scale = args[0], 1.0 / (1.0 - args[1])
                mask = self.masks.get(node.name)
                if mask is None:  # (packed, as the dropout keeps it)
                    mask = self.masks[node.name] = pack(torch.rand_like(x) >= args[1])
                started = time.perf_counter()
                remake(x, mask, scale)
            else:
                started = time.perf_counter()
                target(*args, **kwargs)
            return time.perf_counter() - started


def backward_node_times(program, loss_fn, steps: int = 5) -> dict[str, float]:
    """Node name -> seconds its recomputation takes at its first save's unpack in backward (the least over `steps`
    training steps of the captured graph on its example inputs, a floor's choice and the steadiest: a median of
    three moved single nodes by half; see the module docstring)."""
    module = program.snapshot().module
    module.train()
    runs: dict[str, list[float]] = {}
    for _ in range(steps):
        recorder = _Recorder(module)
        timer = _FirstUnpackTimer(recorder)
        with torch.autograd.graph.saved_tensors_hooks(timer.pack, timer.unpack):
            out = recorder.run(*program.flat_inputs(), enable_io_processing=False)
            loss = loss_fn(_structured(module, out), program.example_args)
        loss.backward()
        module.zero_grad(set_to_none=True)
        for name, seconds in timer.seconds.items():
            runs.setdefault(name, []).append(seconds)
    return {name: min(values) for name, values in runs.items()}


def _structured(module, flat_out):
    """The graph's flat outputs as the module returns them (its output pytree)."""
    codegen = module.graph._codegen
    return codegen.process_outputs(flat_out) if hasattr(codegen, "process_outputs") else flat_out
