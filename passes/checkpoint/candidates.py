"""Candidate regions: runs of consecutive nodes of one module call, at several levels, measured by the cost model.

`candidate_regions` finds them at the block level (top-level modules, descending into one holding most of the
saved bytes) or one level finer; `chunk_regions` joins consecutive ones into segments, `glue_regions` merges a
region with the glue after it. `RegionMeter` measures them on one traced program and builds the `CandidateSet`s
(regions, allowed choices, memory model) the solvers plan over.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx

from fxmem import ops as optable
from fxmem.blocks import node_blocks
from fxmem.costmodel import CandidateRegion, RegionModel, build_region_model, default_balance, measure_regions
from fxmem.graph_segments import with_segments
from fxmem.module_runs import finish_runs
from fxmem.nn.dropout import bool_mask_dropout_remat
from fxmem.nn.remat import op_call, remat
from fxmem.outline import OutlineError, check_outline
from fxmem.program import Program, module_stack


def module_paths(node: fx.Node) -> list[str]:
    """The node's module paths, outermost first (the root left out)."""
    return [p for p, _ in module_stack(node) if p]


def is_region_node(node: fx.Node) -> bool:
    """A node a recompute region may hold: a call that writes no parameter, buffer or input in place, and is no
    shape query or runtime assertion."""
    if node.op != "call_function":
        return False
    target = node.target
    op, args = op_call(target, node.args)
    # in-place ops on values computed in the graph are fine; writes to parameters/buffers/inputs stay outside
    if any(isinstance(a, fx.Node) and a.op in ("get_attr", "placeholder") for a in optable.written_args(op, args)):
        return False
    name = getattr(target, "__name__", "")
    if name == "count_batch" or name.startswith("_assert"):
        return False
    if target is torch.ops.aten.sym_size.int or "sym_size" in str(target):
        return False
    return True


def candidate_regions(program: Program, saved_by_node: dict[str, int], explicit: list[str] | None = None,
                      finer: bool = False) -> list[CandidateRegion]:
    """Module-boundary candidates: runs of consecutive nodes of one module call, in graph order.

    finer: one level below the automatic one (e.g. `h.0.attn`, `h.0.mlp` instead of `h.0`); nodes of the
    parent that belong to no child (residual adds) stay outside the regions."""
    nodes = [n for n in program.graph.nodes if is_region_node(n)]
    total = sum(saved_by_node.values()) or 1
    chosen = list(explicit) if explicit else _auto_levels(nodes, saved_by_node, total, finer)
    regions = _runs(nodes, set(chosen))
    if not explicit:
        regions = with_segments(regions, list(program.graph.nodes), saved_by_node, is_region_node, CandidateRegion)
    for region in regions:
        # a node registering a recipe (a remat wrapper, a remat dropout) whose readers are all outside (a block's
        # closing layer norm, attention's dropped-out probabilities) stays outside too: inside a recomputed region
        # the recipe scope steps aside and its output would be a plain tensor kept by its readers; outside, the
        # recipe is registered and they keep the recipe
        members = set(region.nodes)
        region.nodes = [n for n in region.nodes if not (n.target in (remat, bool_mask_dropout_remat) and n.users
                                                        and all(u not in members for u in n.users))]
    regions = [r for r in regions if r.nodes]
    finish_runs(regions, list(program.graph.nodes), explicit, "passes.checkpoint.regions")
    return regions


def _runs(nodes: list[fx.Node], chosen: set[str]) -> list[CandidateRegion]:
    """Runs of consecutive nodes owned by one chosen module path (getitem glue stays with its producer's run)."""
    regions: list[CandidateRegion] = []
    current: CandidateRegion | None = None
    current_path = None
    for node in nodes:
        path = next((p for p in module_paths(node) if p in chosen), None)
        if path is None:
            # getitem nodes and other glue between nodes of one module stay with it
            if current is not None and getattr(node.target, "__name__", "") == "getitem" \
                    and node.args[0] in current.nodes:
                current.nodes.append(node)
                continue
            current, current_path = None, None
            continue
        if current is not None and path == current_path:
            current.nodes.append(node)
        else:
            current = CandidateRegion(path, [node])
            current_path = path
            regions.append(current)
    return regions


def _auto_levels(nodes: list, saved_by_node: dict[str, int], total: int, finer: bool = False) -> list[str]:
    """Top-level module paths; a module holding over half the saved bytes is replaced by its children.
    finer: then every chosen module with two or more children is replaced by its children."""
    saved_by_path: dict[str, int] = {}
    children: dict[str, list[str]] = {}
    tops: list[str] = []
    for node in nodes:
        paths = module_paths(node)
        for depth, path in enumerate(paths):
            saved_by_path[path] = saved_by_path.get(path, 0) + saved_by_node.get(node.name, 0)
            parent = paths[depth - 1] if depth else None
            siblings = children.setdefault(parent, []) if parent else tops
            if path not in siblings:
                siblings.append(path)
    out: list[str] = []
    todo = list(tops)
    while todo:
        path = todo.pop(0)
        kids = children.get(path, [])
        if len(kids) >= 2 and saved_by_path.get(path, 0) > 0.5 * total:
            todo = kids + todo
        else:
            out.append(path)
    if finer:
        out = [c for p in out for c in (children.get(p, []) if len(children.get(p, [])) >= 2 else [p])]
    return out


def outlinable(region: CandidateRegion) -> bool:
    """The region's nodes can become one call (`fxmem.outline.check_outline`: convex, something used outside): a
    `sym_size` outside a region that reads a value made inside it and feeds a later member makes it not convex."""
    try:
        check_outline(region.nodes, region.path)
    except OutlineError:
        return False
    return True


def writes_input(region: CandidateRegion) -> bool:
    """True if a node of the region writes in place (relu_, add_, ...) to a value created outside it."""
    members = set(region.nodes)
    for node in region.nodes:
        op, args = op_call(node.target, node.args)  # (remat_call('aten.relu_.default', x) writes x too)
        for written in optable.written_args(op, args):
            if isinstance(written, fx.Node):
                base = written
                while base not in members and base.op == "call_function" and base.args \
                        and isinstance(base.args[0], fx.Node) and "view" in str(base.target):
                    base = base.args[0]
                if base not in members:
                    return True
    return False


def chunk_regions(program: Program, regions: list[CandidateRegion], size: int) -> list[CandidateRegion]:
    """Segments of `size` consecutive regions; each takes every region node between its first and last node (the
    glue in between too, so the segment stays convex). Named `first+last`."""
    position = {n: i for i, n in enumerate(program.graph.nodes)}
    out = []
    for start in range(0, len(regions), size):
        group = regions[start:start + size]
        name = group[0].path if len(group) == 1 else f"{group[0].path}+{group[-1].path.split('.')[-1]}"
        out.append(_spanning(program, position, group, name))
    return out


def _spanning(program: Program, position: dict, group: list[CandidateRegion], name: str) -> CandidateRegion:
    """One region from the first node of `group`'s first region to the last of its last, with every region node in
    between (the glue too, so it stays convex)."""
    first, last = position[group[0].nodes[0]], position[group[-1].nodes[-1]]
    region = CandidateRegion(name, [n for n in program.graph.nodes
                                    if first <= position[n] <= last and is_region_node(n)])
    region.first, region.last = first, last
    return region


def glue_regions(program: Program, regions: list[CandidateRegion], measure) -> list[CandidateRegion]:
    """The measured `regions` with each one that saves bytes of its own making merged with the regions right after
    it that save none (a U-Net's pooling, up-convolution or output convolution, once remat made what they save
    a recipe), where that frees more: the glue saves its input, the region's output (a 1x1 output convolution
    saves the last block's whole output), which inside the merged region is recomputed instead. `measure` fills
    the merged regions' bytes and costs. Empty when no merge frees more."""
    groups: list[list[CandidateRegion]] = []
    for region in regions:
        if groups and region.saved == 0 and groups[-1][0].saved > 0:
            groups[-1].append(region)
        else:
            groups.append([region])
    position = {n: i for i, n in enumerate(program.graph.nodes)}
    merged = {i: _spanning(program, position, g, f"{g[0].path}+{g[-1].path}")
              for i, g in enumerate(groups) if len(g) > 1}
    if not merged:
        return []
    measure(list(merged.values()))
    better = {i for i, r in merged.items() if r.freed("full") > groups[i][0].freed("full")}
    if not better:
        return []
    return [r for i, g in enumerate(groups) for r in ([merged[i]] if i in better else g)]


def is_chain(regions: list[CandidateRegion]) -> bool:
    """True if values flow from region to region only forward by one (glue nodes traced through)."""
    owner: dict[fx.Node, int] = {}
    for index, region in enumerate(regions):
        for node in region.nodes:
            owner[node] = index
    memo: dict[fx.Node, set] = {}

    def sources(value: fx.Node) -> set:
        if value in owner:
            return {owner[value]}
        if value in memo:
            return memo[value]
        memo[value] = set()
        out = set()
        for arg in value.all_input_nodes:
            out |= sources(arg)
        memo[value] = out
        return out

    for index, region in enumerate(regions):
        for arg in region.inputs:
            for source in sources(arg):
                if source != index - 1 and source != index:
                    return False
    return True


def profile_nodes(program: Program, repeats: int = 3, statistic=np.median) -> dict[str, float]:
    """Seconds per node on the example inputs: `statistic` over `repeats` no_grad runs (the median by default)."""
    times: dict[str, list[float]] = {}

    class _Timer(fx.Interpreter):
        def run_node(self, node):
            started = time.perf_counter()
            out = super().run_node(node)
            times.setdefault(node.name, []).append(time.perf_counter() - started)
            return out

    flat = program.flat_inputs()
    with torch.no_grad():
        for _ in range(repeats):
            _Timer(program.module).run(*flat, enable_io_processing=False)
    return {k: float(statistic(v)) for k, v in times.items()}


@dataclass
class CandidateSet:
    """Candidate regions at one level, each with its allowed choices, and their memory model."""
    regions: list
    choices: list
    model: RegionModel
    chain: bool
    level: str
    solved: dict = field(default_factory=dict)  # planning budget -> (solution, tie-broken solution)


class RegionMeter:
    """Measures candidate regions on one traced program (`traced`: what `trace_forward` returned) with the pass's
    options, and makes candidate sets of them."""

    def __init__(self, program: Program, traced, opts, keep_ops: frozenset):
        self.program, self.traced, self.opts, self.keep_ops = program, traced, opts, keep_ops
        self.recorder, self.base_keys = traced.recorder, traced.base_keys
        self.node_time = profile_nodes(program) if opts.cost == "profile" else None
        self.balance = None
        if opts.cost == "roofline":
            self.balance = opts.balance if opts.balance is not None else default_balance(program)
        self.block_of = node_blocks(program.module) if opts.within_blocks else {}

    def saved_by_node(self) -> dict[str, int]:
        """Bytes autograd saves per node (each storage counted once, at its first saver; base storages left out)."""
        saved: dict[str, int] = {}
        seen: set = set()
        for record in self.recorder.records:
            for key in record.saved:
                if key not in seen and self.base_keys.get(key) is None:
                    seen.add(key)
                    saved[record.node] = saved.get(record.node, 0) + self.recorder.storage_bytes[key]
        return saved

    def levels(self) -> list[tuple[str, list[CandidateRegion]]]:
        """(level, regions) to plan at: blocks, sub-blocks (granularity), and segments of the finest regions."""
        opts = self.opts
        finer_levels = {"block": [False], "sub-block": [True], "auto": [False, True]}[opts.granularity]
        if opts.regions:
            finer_levels = [False]
        saved = self.saved_by_node()
        levels = [("sub-block" if finer else "block", candidate_regions(self.program, saved, opts.regions or None,
                                                                        finer=finer))
                  for finer in finer_levels]
        if opts.granularity == "auto" and not opts.regions:
            # uniform segments of k consecutive finest regions (Chen et al.): a region of one op frees nothing
            finest = levels[-1][1]
            for size in range(2, max(2, int(math.isqrt(len(finest)))) + 2):
                if len(finest) >= size + 1:
                    levels.append((f"segments-{size}", chunk_regions(self.program, finest, size)))
        return levels

    def measure(self, regions: list[CandidateRegion]) -> None:
        """Fill the regions' bytes and costs (`fxmem.costmodel.measure_regions`)."""
        measure_regions(self.program, regions, self.recorder, self.base_keys, self.keep_ops, self.node_time,
                        self.balance, recipes=self.opts.region_recipes)

    def admissible(self, regions: list[CandidateRegion]) -> list[CandidateRegion]:
        """The regions a recomputation can run: none writing a value made outside it (recomputation would see the
        written value), none the emitter could not outline (the plan verified would not be the plan chosen), none
        across two blocks when regions stay within blocks."""
        regions = [r for r in regions if not writes_input(r) and outlinable(r)]
        if self.opts.within_blocks:
            regions = [r for r in regions if len({self.block_of.get(n) for n in r.nodes}) == 1]
        return regions

    def candidate_set(self, level: str, regions: list[CandidateRegion], estimate) -> CandidateSet | None:
        """The measured `regions` worth planning (freeing at least `min_region_fraction` of what all save), their
        choices and memory model against `estimate` (the program's); None when none is worth it."""
        opts = self.opts
        total_saved = sum(r.saved for r in regions) or 1
        if not opts.regions:
            worth = [r for r in regions if r.freed("full") >= opts.min_region_fraction * total_saved]
            if worth and len(worth) < len(regions) and any(r.held for r in worth):
                # measured again without the others: an output of a region left out (a ReLU block that frees
                # nothing) is no longer one a recomputed region would make again, so its readers need not hold
                # it (only `held` depends on the other regions)
                self.measure(worth)
            regions = worth
        if not regions:
            return None
        choices = [region_choices(r, opts.selective) for r in regions]
        model = build_region_model(estimate, regions, self.program, choices, self.traced)
        return CandidateSet(regions, choices, model, is_chain(regions), level)


def region_choices(region: CandidateRegion, selective: bool) -> tuple[str, ...]:
    """What a region may be: kept, recomputed selectively (when allowed and cheaper), fully, or with its dropout
    masks drawn again (when that frees more than keeping them)."""
    choices = ("keep", "selective", "full") if selective and not region.sel_blocked \
        and region.freed("selective") > 0 and region.flops_sel < region.flops else ("keep", "full")
    return choices + (("redraw",) if region.keep_full and region.freed("redraw") > region.freed("full") else ())
