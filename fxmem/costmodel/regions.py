"""The checkpoint planner's memory model: what recomputing each candidate region frees and costs, and a plan's peak.

`measure_regions` fills each `CandidateRegion` from the forward trace; `build_region_model` maps the baseline
timeline onto prefixes of the region chain (`RegionModel`), with each recomputation's spike (`RecomputeWalk`). The
checkpoint pass picks the candidates (module boundaries) and solves over the model.
"""
from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .. import ops as optable
from ..nn.checkpoint import DRAW_OPS
from ..nn.dropout import bool_mask_dropout, bool_mask_dropout_remat
from ..nn.regions import names_op
from ..nn.region_graph import recipe_compatible
from ..node_value import node_value
from ..outline import region_boundary
from ..program import Program
from .costs import op_cost
from .recipe_closure import needed_records
from .recompute import RecomputeWalk
from .trace import DispatchRecorder, ForwardTrace, cached_per_trace
from .trace_index import TraceIndex

# What checkpointing candidate regions does to memory (Chen et al. 2016 / Rotor style, on the static timeline).
#
# Recomputing region i frees `freed_i(choice)` bytes: what autograd would save inside the region, less what the
# choice keeps (selective: matmul outputs; full: the kept dropout masks) and what the region must hold (inputs
# nobody else saves) or leaves as plain tensors (recipes saved outside it). A region's outputs count as freed when
# only its own ops save them (a residual stream a segment's norm saves and the next add only reads); another region
# reading such an output, recomputed, holds it. Those bytes are freed at every point after region i's forward and
# before its backward, i.e. every forward or backward point at a node later in the graph than region i; inside its
# own backward the recomputation brings its tensors back, as without checkpointing. With the baseline's live bytes
# `live(p)` the plan's peak is
#
#     peak(plan) = max over points p of  live(p) - sum of freed_i(choice_i) over regions i before p
#
# and, for each recomputed region i, its recomputation's spike: the baseline's live bytes where i recomputes (its
# first unpack: the backward of its last op that saves a tensor), plus spike_i(choice_i), less what the regions
# before i free. spike_i is what the recomputation holds at its highest above what it leaves (temporaries: attention
# scores a block drops in forward are live again at once with what it keeps), plus what it leaves beyond what it
# frees (inputs it held, outputs made again), walked on the trace as the static estimate walks an emitted region
# (`RecomputeWalk`); or, if higher, the baseline's points in i's own backward after that, with its held inputs and
# what the recomputation left that the baseline does not hold (recipe saves, plain inside a region; inputs made
# again) on top. Regions sorted by position make every constraint a nested prefix sum (`RegionModel`), which is
# what the pass's DP and MILP solve over.


@dataclass
class CandidateRegion:
    """A candidate: consecutive nodes of one module call, with what checkpointing it would free and cost."""
    path: str
    nodes: list  # fx.Node, graph order
    first: int = 0  # position of the first / last node in the graph
    last: int = 0
    saved: int = 0  # bytes autograd saves inside the region (created inside)
    kept: int = 0  # bytes selective keeps (outputs of keep ops)
    held: int = 0  # bytes of region inputs the region would hold that nobody saves otherwise
    flops: float = 0.0  # forward cost of the region (recompute cost of `full`)
    flops_sel: float = 0.0  # recompute cost of `selective`
    inputs: list = field(default_factory=list)
    keep_full: frozenset = frozenset()  # ops even `full` keeps: the region's random draws (DRAW_OPS), when all are
    kept_full: int = 0  # bytes of their outputs
    flops_redraw: float = 0.0  # recompute cost of `redraw` (`full` plus drawing the kept masks again)
    lost: int = 0  # bytes of recipe outputs the region makes that stay plain tensors when it is recomputed
    span: tuple = ()  # (first, last) index of its op records in the trace it was measured on
    keep_sel: frozenset = frozenset()  # ops `selective` keeps (the keep ops, and the draws `full` keeps)
    # why `selective` cannot be emitted ("" if it can): a kept op's output written in place afterwards (`h =
    # linear(x); h.relu_()`): torch's selective checkpointing caches that output and refuses a mutated one in
    # backward
    sel_blocked: str = ""
    # choice -> bytes live at its recomputation in backward beyond the baseline there: the recomputation's own
    # temporaries above what it leaves, plus what it leaves beyond what the region frees (its held inputs, its
    # outputs made again), or, if higher, the baseline's highest in the region's own backward after it with the
    # held inputs and what the recomputation left that the baseline does not hold on top (recipe saves made plain,
    # inputs made again); filled by `build_region_model` for the region's choices
    spike: dict = field(default_factory=dict)
    # its full and redraw recomputations run as recipes (`fxmem.nn.region_recipe`): only what its saves read, once
    recipes: bool = False

    def runs_as_recipes(self, choice: str) -> bool:
        return self.recipes and choice in ("full", "redraw")

    def keeps(self, choice: str) -> tuple[frozenset, int]:
        """(the ops whose outputs a recomputation with `choice` keeps, their bytes): selective the keep ops and
        the draws, full the draws, redraw nothing."""
        if choice == "selective":
            return self.keep_sel, self.kept
        if choice == "full":
            return self.keep_full, self.kept_full
        return frozenset(), 0

    def freed(self, choice: str) -> int:
        if choice == "keep":
            return 0
        return max(0, self.saved - self.keeps(choice)[1] - self.held - self.lost)

    def cost(self, choice: str) -> float:
        return {"keep": 0.0, "selective": self.flops_sel, "full": self.flops, "redraw": self.flops_redraw}[choice]


# the draws a recompute region keeps (on its DrawTape) instead of drawing again: fxmem.nn.checkpoint.DRAW_OPS, of
# these dropouts' bool masks
DROPOUT_FNS = (bool_mask_dropout, bool_mask_dropout_remat)


def value_key(by_node: dict, node: fx.Node) -> int | None:
    """The storage of the value node `node` hands on (`by_node`: node name -> its op records in a trace): the one
    its trace marked on the record that made it (`OpRecord.values_made`; for a getitem chain, an element of the
    tuple its first node returned: an LSTM's output), else its last op record's first output. A node whose ops
    return no tensor while its value is one hands on an input's (a dropout with p=0 returns its input as it is):
    its first tensor argument's."""
    root, path = _item_path(node)
    key = next((r.values_made[path] for r in reversed(by_node.get(root.name, [])) if path in r.values_made), None)
    if key is not None or path:
        return key
    records = by_node.get(node.name, [])
    key = next((r.out_keys[0] for r in reversed(records) if r.out_keys and r.out_keys[0] is not None), None)
    if key is None and node.op == "call_function" and node_value(node, tensor_only=True) is not None:
        arg = next((a for a in node.args if node_value(a, tensor_only=True) is not None), None)
        if arg is not None:
            return value_key(by_node, arg)
    return key


def _item_path(node: fx.Node) -> tuple:
    """(the node a chain of getitems with constant indices starts at, the indices), or (node, ()) for other nodes."""
    path: tuple = ()
    while node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and isinstance(node.args[1], int):
        path = (node.args[1],) + path
        node = node.args[0]
    return node, path


def kept_then_written(index: TraceIndex, made: dict) -> str:
    """Why a selective recomputation cannot keep the outputs `made` (storage -> the record of the keep op making it;
    "" if it can): one of them is written in place later in the forward (torch's selective checkpointing caches the
    tensor and raises in backward when it finds it changed). Names the op that made it and the op that writes it."""
    if not made:
        return ""
    for writer_idx, keys in index.writes:
        for key in keys:
            maker = made.get(key)
            if maker is not None and writer_idx > maker.idx:
                writer = index.records[writer_idx]
                return (f"{optable.packet(maker.func)} output of node {maker.node} is written in place by "
                        f"{optable.packet(writer.func)} (node {writer.node})")
    return ""


def measure_regions(program: Program, regions: list[CandidateRegion], rec: DispatchRecorder, base_keys,
                    keep_ops: frozenset, node_time: dict[str, float] | None = None,
                    balance: float | None = None, recipes: bool = False) -> None:
    """Fill saved/kept/held bytes and recompute costs of each region from the forward trace (`rec`, `base_keys`:
    a `ForwardTrace`'s recorder and base keys). `node_time`: measured seconds per node instead of the roofline
    cost at `balance`. `recipes`: regions whose ops allow it run as recipes (`CandidateRegion.recipes`)."""
    _RegionMeasurer(rec, base_keys, keep_ops, node_time, balance, recipes).measure_all(regions)


@dataclass
class _Breakdown:
    """One region's op records taken apart: what they save and keep, and what recomputing them costs."""
    saved: set = field(default_factory=set)
    kept: set = field(default_factory=set)
    kept_full: set = field(default_factory=set)
    sac_made: dict = field(default_factory=dict)  # what selective checkpointing caches: storage -> keep op's record
    flops: float = 0.0
    flops_sel: float = 0.0
    draws_cost: float = 0.0


class _RegionMeasurer:
    def __init__(self, recorder: DispatchRecorder, base_keys: dict, keep_ops: frozenset, node_time, balance,
                 recipes: bool):
        self.recorder, self.base_keys, self.keep_ops, self.recipes = recorder, base_keys, keep_ops, recipes
        self.node_time, self.balance = node_time, balance
        self.index = TraceIndex.of(recorder)
        self.storage_bytes = recorder.storage_bytes
        self.op_costs = cached_per_trace(recorder, "_fxmem_op_costs", dict)  # (record, balance) -> op_cost
        # node -> why it may save a tensor of its own making (`recipe_compatible`; the traced program's nodes)
        self.own_saves = cached_per_trace(recorder, "_fxmem_own_saves", dict)

    def cost(self, record) -> float:
        key = (record.idx, self.balance)
        cost = self.op_costs.get(key)
        if cost is None:
            cost = self.op_costs[key] = op_cost(record, self.balance)
        return cost

    def keys_of(self, node: fx.Node) -> set[int]:
        """Every storage its ops made (a norm's statistics too) and the one its value hands on (a view's, an
        in-place op's), not the storages its ops merely pass through (a linear's view of its input, which its mm
        saves)."""
        by_node = self.index.by_node
        handed_on = value_key(by_node, node)
        return {key for r in by_node.get(node.name, []) for key in r.new_keys} | (
            {handed_on} if handed_on is not None else set())

    def measure_all(self, regions: list[CandidateRegion]) -> None:
        # the region's outputs that nothing outside it keeps: no saver outside, not the graph's output (a residual
        # stream that the next add only reads and a norm inside saves). Recomputing the region frees them with its
        # other saves; a region reading one as an input holds it instead (`held`: when its maker is kept, that
        # counts bytes its saver keeps anyway, the one place this model is conservative)
        bounds = [region_boundary(region.nodes) for region in regions]
        spans = [{r.idx for n in region.nodes for r in self.index.by_node.get(n.name, [])} for region in regions]
        loose: list[set[int]] = []
        self.loose_in: dict[int, int] = {}  # loose output -> the region it is loose in
        for position, ((_, outs), idxs) in enumerate(zip(bounds, spans)):
            pinned = {key for o in outs if any(u.op == "output" for u in o.users) for key in self.keys_of(o)}
            loose.append({key for o in outs for key in self.keys_of(o) - pinned
                          if self.base_keys.get(key) is None
                          and all(i in idxs for i in self.index.savers.get(key, ()))})
            self.loose_in.update(dict.fromkeys(loose[position], position))
        for position, (region, bound, idxs, own_loose) in enumerate(zip(regions, bounds, spans, loose)):
            self.measure(position, region, bound, idxs, own_loose)

    def measure(self, position: int, region: CandidateRegion, bound: tuple, idxs: set, own_loose: set) -> None:
        ins, outs = bound
        records = [r for n in region.nodes for r in self.index.by_node.get(n.name, [])]
        keep_rng = self._draws_kept(region, records)
        keep_sel = self.keep_ops | keep_rng
        parts = self._breakdown(records, idxs, keep_sel, keep_rng)
        if self.node_time is not None:
            self._node_time_costs(region, parts, keep_sel, keep_rng)
        region.recipes = self.recipes and not recipe_compatible(region.nodes, DRAW_OPS, restores=False,
                                                                own_saves=self.own_saves)
        if region.recipes and idxs:
            needed = needed_records(self.recorder.records, min(idxs), max(idxs), parts.saved)
            parts.flops = self._closure_cost(region, needed)
        # the other outputs live on outside it (consumers save them): checkpointing cannot free them
        out_keys = {key for o in outs for key in self.keys_of(o)} - own_loose
        parts.saved -= out_keys
        parts.kept -= out_keys
        parts.kept_full -= out_keys
        storage_bytes = self.storage_bytes
        region.lost = self._lost({n.name for n in region.nodes}, idxs)
        region.sel_blocked = kept_then_written(self.index, parts.sac_made)
        region.saved = sum(storage_bytes[key] for key in parts.saved)
        region.kept = sum(storage_bytes[key] for key in parts.kept)
        region.kept_full = sum(storage_bytes[key] for key in parts.kept_full)
        region.keep_full = keep_rng
        region.held = self._held(position, ins)
        region.flops, region.flops_sel = float(parts.flops), float(parts.flops_sel)
        region.flops_redraw = float(parts.flops + parts.draws_cost)
        region.inputs = ins
        region.keep_sel = keep_sel
        region.span = (min(idxs), max(idxs)) if idxs else ()

    @staticmethod
    def _draws_kept(region: CandidateRegion, records: list) -> frozenset:
        """Random draws are kept (not drawn again) only if every draw in the region can be: recomputation restores
        the RNG state and replays the draws in order, so skipping some would shift the others."""
        draws = [r for r in records if optable.category(r.func) == optable.RANDOM]
        targets = {n.name: n.target for n in region.nodes}
        if draws and all(optable.packet(r.func) in DRAW_OPS and targets.get(r.node) in DROPOUT_FNS for r in draws):
            return DRAW_OPS
        return frozenset()

    def _breakdown(self, records: list, idxs: set, keep_sel: frozenset, keep_rng: frozenset) -> _Breakdown:
        parts = _Breakdown()
        base_keys, created_in = self.base_keys, self.index.created_in
        for record in records:
            is_keep = names_op(record.func, keep_sel)
            is_keep_full = optable.packet(record.func) in keep_rng
            if self.node_time is None:
                cost = self.cost(record)
                if not is_keep_full:
                    parts.flops += cost
                else:
                    parts.draws_cost += cost
                if not is_keep:
                    parts.flops_sel += cost
            if record.out_rg:
                for key in record.saved:  # (not what the op keeps on its context: checkpointing cannot free it)
                    if base_keys.get(key) is None and created_in.get(key) in idxs and key not in record.held:
                        parts.saved.add(key)
            if is_keep:
                parts.kept.update(key for key in record.new_keys if base_keys.get(key) is None)
                if not is_keep_full:
                    parts.sac_made.update(dict.fromkeys(record.new_keys, record))
            if is_keep_full:
                parts.kept_full.update(key for key in record.new_keys if base_keys.get(key) is None)
        return parts

    def _closure_cost(self, region: CandidateRegion, needed: set[int]) -> float:
        """A recipe region's full recompute cost: its needed closure's ops (draws are not among them: redraw adds
        theirs), or the measured times of the nodes they belong to (a dropout's at its whole time)."""
        records = self.recorder.records
        if self.node_time is None:
            return float(sum(self.cost(records[index]) for index in needed))
        nodes = {records[index].node for index in needed}
        return float(sum(self.node_time.get(node.name, 0.0) for node in region.nodes if node.name in nodes))

    def _node_time_costs(self, region: CandidateRegion, parts: _Breakdown, keep_sel: frozenset,
                         keep_rng: frozenset) -> None:
        """Recompute costs from measured seconds per node instead of the roofline."""
        for node in region.nodes:
            seconds = self.node_time.get(node.name, 0.0)
            node_records = self.index.by_node.get(node.name, [])
            if not any(optable.packet(r.func) in keep_rng for r in node_records):
                parts.flops += seconds
            else:
                parts.draws_cost += seconds
            if not any(optable.packet(r.func) in keep_sel for r in node_records):
                parts.flops_sel += seconds

    def _held(self, position: int, ins: list) -> int:
        """Bytes of region inputs the region must hold; if autograd saves one anyway, nothing extra (unless only
        the region making it saves it: see `loose`). Its storage, whoever created it: an in-place op or a view hands
        on a storage an earlier op made (new_keys is empty); the value's storage alone where the trace knows it,
        not the others its node made (a dropout's mask, which the dropout saves, beside its output, which only an
        LSTM's copy of it stood for)."""
        held_keys: set[int] = set()
        for arg in ins:
            value = arg.meta.get("fxmem_val")
            if isinstance(value, torch.Tensor) and arg.op != "get_attr" and arg.op != "placeholder":
                handed_on = value_key(self.index.by_node, arg)
                keys = {key for key in ({handed_on} if handed_on is not None else self.keys_of(arg))
                        if self.base_keys.get(key) is None}
                if keys & self.recorder.recipe_at.keys():
                    # a recipe's output: checkpoint saves it through fxmem.nn.recast's hooks, as the recipe (if
                    # another region made it and recomputes, that region counts it: see `lost`)
                    continue
                if not (keys & self.index.savers.keys()):
                    held_keys |= keys
                elif self.loose_in.get(handed_on, position) != position:
                    held_keys.add(handed_on)  # another region's loose output
        return sum(self.storage_bytes[key] for key in held_keys)

    def _lost(self, names: set, idxs: set) -> int:
        """Recipes registered inside the region and saved outside it (a batch norm -> ReLU chain closing the
        region): recomputed (any choice but keep), the body runs with the recipe scope aside
        (fxmem.nn.recast.aside), so those outputs are plain tensors their savers keep from the region's forward to
        their backward: the region frees that much less. The same for a recipe output made inside that a recipe
        made outside holds nested (a cat's upsampling convolution): that recipe holds it as a plain tensor."""
        recipe_at, recast_savers, holders = self.recorder.recipe_at, self.index.recast_savers, self.index.holders

        def kept_outside(key: int) -> bool:
            return any(i not in idxs for i in recast_savers.get(key, ())) or any(
                recipe_at.get(j) not in names and (recast_savers.get(j) or holders.get(j))
                for j in holders.get(key, ()))
        lost = 0
        for key, registered_in in recipe_at.items():
            if registered_in in names and self.base_keys.get(key) is None and kept_outside(key):
                lost += self.storage_bytes[key]
        return lost


@dataclass
class RegionModel:
    """Nested prefix constraints: for k = 0..n, sum of freed over regions[:k] >= need[k]."""
    regions: list[CandidateRegion]
    live_by_prefix: list[int]  # max baseline live bytes over points with k regions before them
    floor: int  # peak of points no region can help (optimizer step, ...)
    floor_at: str
    choices: list[tuple[str, ...]]  # allowed choices per region
    # bytes all regions together must free: the activations left at the end of forward (after every region's
    # forward, so the last prefix) above an activation budget
    act_need: int = 0
    # per region: baseline live bytes in backward just before the region's recomputation would run; a recomputed
    # region adds its `spike` there, less what the regions before it free (empty: not modelled)
    spike_base: list = field(default_factory=list)
    # answers a planner finds once per model (the checkpoint pass's lowest planned peak); a copy with another
    # act_need (`dataclasses.replace`) shares them
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def needs(self, budget: int) -> list[int]:
        out = [max(0, live - budget) for live in self.live_by_prefix]
        out[-1] = max(out[-1], self.act_need)
        return out

    def spike_needs(self, budget: int) -> list[dict]:
        """Per region: choice -> bytes the regions before it must free for that choice's recomputation to stay
        within `budget` (choices whose recomputation stays within it anyway are left out)."""
        out: list[dict] = [{} for _ in self.regions]
        for position, base in enumerate(self.spike_base):
            for choice, extra in self.regions[position].spike.items():
                need = base + extra - budget
                if choice != "keep" and extra > 0 and need > 0:
                    out[position][choice] = need
        return out

    def freed(self, plan: list[str]) -> int:
        return sum(region.freed(choice) for region, choice in zip(self.regions, plan))

    def max_freed(self) -> int:
        return sum(max(region.freed(c) for c in allowed) for region, allowed in zip(self.regions, self.choices))

    def fits(self, plan: list[str], budget: int) -> bool:
        return self.peak(plan) <= budget and self.freed(plan) >= self.act_need

    def peak(self, plan: list[str], spikes: bool = True) -> int:
        """The plan's planned peak (spikes=False: leaving the recomputations' spikes out)."""
        freed = 0
        best = self.floor
        for position, live in enumerate(self.live_by_prefix):
            if position:
                freed += self.regions[position - 1].freed(plan[position - 1])
            best = max(best, live - freed)
            if spikes and position < len(self.spike_base) and plan[position] != "keep":
                # region `position`'s recomputation, with the regions before it freed
                best = max(best, self.spike_base[position] + self.regions[position].spike.get(plan[position], 0)
                           - freed)
        return best

    def cost(self, plan: list[str]) -> float:
        return sum(region.cost(choice) for region, choice in zip(self.regions, plan))

    def max_plan(self) -> list[str]:
        return [max(allowed, key=lambda c, region=region: region.freed(c))
                for region, allowed in zip(self.regions, self.choices)]

    def min_peak(self) -> int:
        """The planned peak of the plan freeing the most in every region: the lowest of any plan when no
        recomputation spikes (a planner finds the lowest otherwise: the checkpoint pass's `lowest`)."""
        return self.peak(self.max_plan())


class _GraphPositions:
    """Timeline points placed in the graph: a node's position, the loss after every node."""

    def __init__(self, program: Program):
        self.position = {n.name: i for i, n in enumerate(program.graph.nodes)}
        self.end = len(self.position) + 1

    def of(self, point) -> int | None:
        """A timeline point's position in the graph (None: not a node's)."""
        return self.position.get(point.label, self.end if point.label == "loss" else None)


def build_region_model(est, regions: list[CandidateRegion], program: Program, choices,
                       traced: ForwardTrace | None = None) -> RegionModel:
    """Map the baseline timeline onto prefixes of the region chain. With `traced` (the trace the regions were
    measured on), also each recomputation's spike: the baseline's live bytes in backward just before it runs, and
    per choice what it adds there (`RecomputeWalk`)."""
    positions = _GraphPositions(program)
    lasts = [region.last for region in regions]
    live = [0] * (len(regions) + 1)
    floor, floor_at = 0, ""
    for point in est.timeline:
        graph_position = positions.of(point) if point.phase != "optimizer" else None
        if graph_position is None:
            if point.peak > floor:
                floor, floor_at = point.peak, point.label
            continue
        before = bisect.bisect_left(lasts, graph_position)  # regions whose last node is before `graph_position`
        live[before] = max(live[before], point.peak)
    if traced is None or not all(region.span for region in regions):
        return RegionModel(regions, live, floor, floor_at, choices)
    walk = RecomputeWalk.of(traced)
    spike_base, inner = _spike_bases(est, regions, positions, walk)
    for position, (region, allowed) in enumerate(zip(regions, choices)):
        region.spike = {}
        for choice in allowed:
            if choice != "keep":
                region.spike[choice] = _spike(region, choice, walk, positions, inner[position], spike_base[position])
    return RegionModel(regions, live, floor, floor_at, choices, spike_base=spike_base)


def _spike_bases(est, regions: list[CandidateRegion], positions: _GraphPositions,
                 walk: RecomputeWalk) -> tuple[list[int], list[list]]:
    """Backward runs from the last node to the first: region k recomputes when it reaches its last node that saves
    a tensor (the first unpack), with what the backward of the nodes after it left live (gradients made in the
    region's own nodes after that one too): `spike_base`. And the region's own backward after it (`inner`: per
    region [(position, the baseline's peak there)])."""
    count = len(regions)
    runs = [positions.position[walk.runs_in(*region.span)] for region in regions]
    firsts = [region.first for region in regions]
    spike_base = [0] * count
    inner: list[list] = [[] for _ in range(count)]
    previous, pending = 0, count - 1
    for point in est.timeline:
        graph_position = positions.of(point) if point.phase == "backward" else None
        if graph_position is not None:
            while pending >= 0 and graph_position <= runs[pending]:
                spike_base[pending] = previous
                pending -= 1
            owner = bisect.bisect_right(firsts, graph_position) - 1
            if owner >= 0 and graph_position <= runs[owner]:
                inner[owner].append((graph_position, point.peak))
        if point.phase != "optimizer":
            previous = point.live
    for position in range(pending + 1):
        spike_base[position] = previous
    return spike_base, inner


def _spike(region: CandidateRegion, choice: str, walk: RecomputeWalk, positions: _GraphPositions, inner: list,
           spike_base: int) -> int:
    """What region's recomputation with `choice` adds where it runs: what it holds at its highest, less what the
    baseline has live of the region's saves (what it recomputes instead of keeping); its held inputs and kept draws
    stay on top. Or, if higher, the baseline in the region's own backward after it (`inner`) with what the
    recomputation left that the baseline does not hold (recipe saves made plain, inputs made again: each until the
    backward of the first node saving it), the draws its tape keeps and the inputs it holds until its backward is
    done. (Its "lost" outputs, plain tensors savers after it keep, are gone by then: their backward ran first.)"""
    keep_ops, kept = region.keeps(choice)
    over, leaves, extra = walk.over(*region.span, frozenset(keep_ops), region.runs_as_recipes(choice))
    node_position = positions.position
    # the draws a region keeps its draw tape holds until the region's backward is done; the baseline frees each in
    # the backward of the first op saving it (the dropout's mask multiply), earlier in the region's backward
    tape_ops = frozenset(keep_ops) & DRAW_OPS
    savers = TraceIndex.of(walk.recorder).savers

    def freed_at(key: int) -> int:  # where the baseline frees a saved tensor: its first saver's backward
        return node_position[walk.records[savers[key][0]].node] if key in savers else positions.end
    tape = [(freed_at(key), walk.recorder.storage_bytes[key])
            for r in walk.records[region.span[0]:region.span[1] + 1] if names_op(r.func, tape_ops)
            for key in r.new_keys if walk.base_keys.get(key) is None] if tape_ops else []
    after = max((peak + sum(nbytes for node, nbytes in extra if node_position[node] < at)
                 + sum(nbytes for saver, nbytes in tape if at < saver) for at, peak in inner), default=0)
    return max(0, over + leaves - max(0, region.saved - kept - region.held), after + region.held - spike_base)
