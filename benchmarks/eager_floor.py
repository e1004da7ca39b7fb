"""Eager floors: the least backward recomputation time any eager plan needs to keep fewer activation bytes.

Issue 33 asks fxmem's checkpoint plans to run within 1.15x of the eager floor at torch.compile's bytes. Two floors
for one captured graph, both from per-node times (below) and bytes (the cost model's `node_costs`):

- `knapsack_floor`: the cheapest ops per byte covering the bytes to drop, each op droppable on its own (a
  fractional knapsack). A relaxation: recomputing an op in backward needs its inputs there, which it ignores, so it
  can drop a softmax's output without keeping (or recomputing) the scores it is made from.
- `dependency_floor`: the same least time with that requirement, a 0-1 program over the graph (`RecomputeGraph`):
  every node whose output backward reads is kept or recomputed, every recomputed node's graph inputs are kept or
  recomputed too, and the kept bytes stay within the target. Every eager recompute plan without offload (fxmem's
  remat sites and regions, uniform checkpointing) is such a choice, and recomputes each node it needs at least
  once, so its recompute time is at least this. Where the model is unsure it errs low (a floor): a node kept for
  a recomputation is charged the bytes some op saves of it when it has any (plus its output's where backward
  reads other storages of it, below); a dropout's output is remade from its kept mask at the graph's cheapest time
  per byte (plus its backward-situated excess, below); a node nothing timed costs nothing.

Times: a recomputed node that reads an input the plan keeps (from the forward, out of cache by backward) is priced
at its recomputation's time where backward would run it (benchmarks/backward_times.py); one whose inputs are all
recomputed just before it (a chain's later op, reading what the op before made) at its forward time. Forward times
alone (`situated=False`, or `forward_seconds`) give a lower floor no plan reaches (benchmarks/backward_times.py).
A node kept for a recomputation keeps its output: where backward reads other storages of it and not its output
(`unsaved_outputs`), the output's bytes count on top. Node times are the least over repeated runs.

    floor = EagerFloor.of(program, loss_fn)
    floor.seconds(drop)            # dependency_floor: what the benchmark's goal lines compare against
    floor.forward_seconds(drop)    # the same at forward times
    floor.knapsack_seconds(drop)   # knapsack_floor
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx

from fxmem.costmodel import node_costs, trace_forward, value_key
from fxmem.nn.bitmask import packed_size
from fxmem.pipeline import pass_module

try:
    from benchmarks.backward_times import backward_node_times
except ImportError:  # run from benchmarks/ (its scripts put that directory on the path)
    from backward_times import backward_node_times

DROPOUT_TARGETS = frozenset({"aten.dropout.default", "aten.feature_dropout.default", "aten.alpha_dropout.default"})
# a dropout's mask is a node of its own, named the dropout's name + MASK_SUFFIX; in a plan, recomputing it is drawing
# the mask again (MASK_DRAWN_AGAIN where plans are listed by op)
MASK_SUFFIX = ".mask"
MASK_DRAWN_AGAIN = "dropout mask drawn again"


def is_mask(name: str) -> bool:
    """Whether a `RecomputeGraph` node name is a dropout's mask."""
    return name.endswith(MASK_SUFFIX)


# Node times are each node's least over this many forward runs and backward steps. With 9 and 5 the reference
# decoder's floor at compile@0.1's bytes came out anywhere from 18.9 to 33.2 ms between calls in one process
# (2026-11-30, 2 threads); with 30 and 15 at 19.1-19.5 ms in three calls (about 5 s a call instead of 2).
FORWARD_REPEATS = 30
BACKWARD_STEPS = 15


@dataclass
class EagerFloor:
    """Both floors of one captured graph, timed once."""
    items: list
    free: int
    graph: "RecomputeGraph"

    @classmethod
    def of(cls, program, loss_fn, situated: bool = True) -> "EagerFloor":
        costs, free = node_costs(program, "train", loss_fn), _free_bytes(program)
        times = _node_times(program, FORWARD_REPEATS)
        backward = backward_node_times(program, loss_fn, BACKWARD_STEPS) if situated else {}
        return cls(recompute_items(costs, times), free,
                   RecomputeGraph.build(program.graph, costs, times, backward, unsaved_outputs(program, loss_fn)))

    def seconds(self, drop: int) -> float:
        return dependency_floor(self.graph, drop)

    def plan(self, drop: int) -> list[str]:
        """The nodes the floor's plan recomputes (a dropout's mask drawn again: its name + ".mask")."""
        return dependency_plan(self.graph, drop)[1]

    def forward_seconds(self, drop: int) -> float:
        return dependency_floor(self.graph, drop, situated=False)

    def knapsack_seconds(self, drop: int) -> float:
        return knapsack_floor(self.items, self.free, drop)


def _node_times(program, repeats: int = 9) -> dict[str, float]:
    """Forward seconds per node: the least over `repeats` no_grad runs of the graph on the example inputs (a floor's
    choice, and steadier between runs than the pass's profiler, a median of five), less the interpreter's own time
    per node (the least any node took: a getitem's)."""
    times = pass_module("checkpoint").profile_nodes(program, repeats, statistic=min)
    overhead = min(times.values())
    return {name: max(0.0, t - overhead) for name, t in times.items()}


def unsaved_outputs(program, loss_fn) -> dict[str, int]:
    """Node name -> bytes of its output's storage, for nodes backward reads other storages of but not that one (a
    batched matmul saves the copies it makes of its operands, not its product): keeping such a node's output for a
    recomputation that reads it costs these bytes on top (the attention's `att @ v` under its `contiguous`)."""
    traced = trace_forward(program, program.example_args, program.example_kwargs, "train", loss_fn)
    recorder = traced.recorder
    by_node: dict[str, list] = {}
    saved: set[int] = set()
    for record in recorder.records:
        by_node.setdefault(record.node, []).append(record)
        saved.update(record.saved)
    out: dict[str, int] = {}
    for node in program.graph.nodes:
        records = by_node.get(node.name)
        key = value_key(by_node, node) if records else None
        if key is None or key in saved or not any(key in r.new_keys for r in records):
            continue
        if any(k in saved for r in records for k in r.new_keys):
            out[node.name] = recorder.storage_bytes[key]
    return out


def _free_bytes(program) -> int:
    """Bytes fxmem drops at no recompute at all: dropout masks kept packed, a bit per element, instead of float
    (compact_dropout)."""
    return sum(c.bytes_saved for c in pass_module("checkpoint").compact_dropout(program.snapshot()))


def recompute_items(costs: dict, times: dict) -> list[tuple[float, int]]:
    """What eager recomputation can trade, for `knapsack_floor`: per graph node (seconds it takes, bytes autograd
    saves of the storages it creates). A floor for plans on this graph: rewrites that change what autograd saves
    (the attention pass's SDPA) are another pass's, and offload is left out (on a CPU host it copies to disk)."""
    return [(times[n], c.kept_bytes) for n, c in costs.items() if n in times and c.kept_bytes > 0]


def knapsack_floor(items, free: int, drop: int) -> float:
    """Least seconds of recomputation that drops `drop` activation bytes, each node's bytes droppable alone at its
    forward time (see the module docstring)."""
    need, secs = drop - free, 0.0
    for t, b in sorted(items, key=lambda tb: tb[0] / tb[1]):
        if need <= 0:
            break
        take = min(1.0, need / b)
        secs += take * t
        need -= take * b
    return secs if need <= 0 else float("inf")


@dataclass
class RecomputeGraph:
    """The graph as `dependency_floor` sees it. Per compute node: `seconds` to recompute it, `keep_bytes` to keep
    it, `views` (no storage of its own: kept only through its input), `needed` (backward reads bytes it creates),
    its compute-node `inputs`, `extra` seconds its recomputation takes on top when it reads a kept input
    (backward-situated time less forward time), `out_keep` bytes its output costs on top of `keep_bytes` when a
    recomputation reads it (`unsaved_outputs`; 0: keeping the node keeps its output); `fixed`: bytes kept whatever
    the plan (the loss's own saves), `total`: the bytes the unplanned graph keeps (float masks)."""
    names: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    extra: list[float] = field(default_factory=list)
    keep_bytes: list[int] = field(default_factory=list)
    out_keep: list[int] = field(default_factory=list)
    needed: list[bool] = field(default_factory=list)
    views: list[bool] = field(default_factory=list)
    inputs: list[list[int]] = field(default_factory=list)
    fixed: int = 0
    total: int = 0

    @classmethod
    def build(cls, graph: fx.Graph, costs: dict, times: dict, backward: dict | None = None,
              unsaved: dict | None = None) -> "RecomputeGraph":
        """From the graph, its `node_costs`, forward seconds per node, backward-situated seconds where measured and
        `unsaved_outputs`."""
        model = cls(total=sum(c.kept_bytes for c in costs.values()))
        model._add_nodes(graph, costs, times, backward or {}, unsaved or {})
        return model

    def _add_nodes(self, graph: fx.Graph, costs: dict, times: dict, backward: dict, unsaved: dict) -> None:
        index: dict[str, int] = {}
        outputs = {n.name for n in graph.find_nodes(op="output")[0].all_input_nodes}
        # the least seconds per byte any node took to make its output: a dropout output's remake, a multiply, at it
        cheapest = min((times[n] / c.out_bytes for n, c in costs.items() if c.out_bytes and times.get(n)),
                       default=0.0)
        for node in graph.nodes:
            if not _is_compute(node):
                continue
            cost = costs.get(node.name)
            kept, made = (cost.kept_bytes, cost.out_bytes) if cost is not None else (0, 0)
            seconds = times.get(node.name, 0.0)
            inputs = [index[m.name] for m in node.all_input_nodes if m.name in index]
            if str(node.target) in DROPOUT_TARGETS and made:
                kept, seconds, mask = self._dropout(node, kept, made, seconds, cheapest)
                inputs.append(mask)
            extra = max(0.0, backward[node.name] - seconds) if node.name in backward else 0.0
            index[node.name] = self._add(node.name, seconds, kept, 0 if node.name in outputs else (kept or made),
                                         made == 0, inputs, extra)
            if kept and node.name not in outputs:
                self.out_keep[-1] = unsaved.get(node.name, 0)
        names = {node.name for node in graph.nodes}
        self.fixed += sum(c.kept_bytes for name, c in costs.items() if name not in names)  # the loss's saves

    def _add(self, name: str, seconds: float, kept: int, keep: int, view: bool, inputs: list[int],
             extra: float = 0.0) -> int:
        """One node (a view, a getitem, an in-place op has no storage of its own: its input's); its index."""
        self.names.append(name)
        self.seconds.append(seconds)
        self.extra.append(extra)
        self.needed.append(kept > 0)
        self.keep_bytes.append(keep)
        self.out_keep.append(0)
        self.views.append(view)
        self.inputs.append(inputs)
        return len(self.names) - 1

    def _dropout(self, node: fx.Node, kept: int, made: int, seconds: float, cheapest: float):
        """A dropout as two nodes: its mask (as many elements as the output, in the input's dtype on CPU; kept
        packed, a bit per element, fxmem's compact dropout, or drawn again at the dropout's time) and its output,
        remade from the mask by one multiply. Returns the output's (bytes backward reads, seconds to remake it) and
        the mask's index."""
        mask = made // 2
        itemsize = node.meta["val"].dtype.itemsize
        index = self._add(node.name + MASK_SUFFIX, seconds, mask, packed_size(mask // itemsize), False, [])
        return max(0, kept - mask), cheapest * (made - mask), index


def _is_compute(node: fx.Node) -> bool:
    """A node whose value a plan keeps or makes again: a call producing tensors (not a placeholder, a parameter, a
    shape, or a module call returning nothing)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def dependency_floor(graph: RecomputeGraph, drop: int, time_limit: float = 30.0, situated: bool = True) -> float:
    """Least seconds of recomputation that keeps at most `graph.total - drop` bytes with every recomputed node's
    inputs available, a recomputed node that reads a kept input paying its `extra` (`situated`; see the module
    docstring); inf when no plan keeps so few."""
    return dependency_plan(graph, drop, time_limit, situated)[0]


def dependency_plan(graph: RecomputeGraph, drop: int, time_limit: float = 30.0,
                    situated: bool = True) -> tuple[float, list[str]]:
    """`dependency_floor` and the nodes the best plan found recomputes (empty when none was found)."""
    target = graph.total - drop - graph.fixed
    if target < 0:
        return float("inf"), []
    n = len(graph.names)
    extra = np.asarray(graph.extra if situated else [0.0] * n, dtype=float)
    out_keep = graph.out_keep or [0] * n
    # columns: keep[i] (i < n), recompute[i] (n + i), reads-a-kept-input[i] (2n + i), output kept for a
    # recomputation (3n + i, nodes with `out_keep`); rows: needed, inputs available, reads a kept input (recomputed
    # while an input is not), bytes
    width = 4 * n
    rows: list[np.ndarray] = []
    lo: list[float] = []
    for i in range(n):
        for m in graph.inputs[i]:
            rows.append(_row(width, {(3 * n + m) if out_keep[m] else m: 1.0, n + m: 1.0, n + i: -1.0}))
            lo.append(0.0)
            if extra[i] > 0:
                rows.append(_row(width, {2 * n + i: 1.0, n + i: -1.0, n + m: 1.0}))
                lo.append(0.0)
        if extra[i] > 0 and not graph.inputs[i]:
            rows.append(_row(width, {2 * n + i: 1.0, n + i: -1.0}))
            lo.append(0.0)
        if graph.needed[i]:
            rows.append(_row(width, {i: 1.0, n + i: 1.0}))
            lo.append(1.0)
    rows.append(-np.r_[np.asarray(graph.keep_bytes, dtype=float), np.zeros(2 * n), np.asarray(out_keep, dtype=float)])
    lo.append(-float(target))
    col_hi = [0.0 if view else 1.0 for view in graph.views] + [1.0] * n + [1.0 if e > 0 else 0.0 for e in extra] + \
        [1.0 if b else 0.0 for b in out_keep]
    cost = np.r_[np.zeros(n), np.asarray(graph.seconds, dtype=float), extra, np.zeros(n)]
    values, optimal, bound = pass_module("checkpoint.solvers").highs_milp(
        cost, np.array(rows), lo, [math.inf] * len(rows), np.zeros(width), col_hi, [True] * width, time_limit)
    # the optimum, or where the time limit stops HiGHS first its proven lower bound on it (a floor either way);
    # neither: infeasible, no plan keeps so few
    recomputed = [] if values is None else [graph.names[i] for i in range(n) if values[n + i] > 0.5]
    return (bound if bound is not None else math.inf), recomputed


def _row(width: int, entries: dict) -> np.ndarray:
    row = np.zeros(width)
    for column, value in entries.items():
        row[column] = value
    return row
