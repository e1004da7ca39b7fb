"""Checkpoint pass: land the training step under a memory budget with the least extra compute.

Given a budget (bytes, or a fraction of the baseline peak; or an activation budget, below), the pass chooses, for
each candidate region of the graph, one of four things:

    keep       the region runs as captured; autograd saves what it saves
    selective  recompute in backward, but save the outputs of matmul-like ops (mm/addmm/bmm/convolution/attention
               kernels); pointwise and normalization ops are recomputed (selective activation checkpointing)
    full       recompute the whole region in backward; only its inputs (and its dropout masks, below) are kept
    redraw     like full, and the dropout masks are drawn again too (the lowest memory, the dearest recompute)

Random draws are kept, not drawn again. On CPU, dropout draws its mask into a float tensor and autograd saves it
(4 bytes per element), and drawing is most of a dropout-heavy forward's time (bernoulli_ was 60% of the
reference decoder's forward here). When the pass has work to do, `compact_dropout` first replaces CPU
`aten.dropout` by `fxmem.nn.dropout.bool_mask_dropout`: the same random numbers drawn into a bool mask
(bit-identical outputs and gradients, a quarter of the bytes). Recompute regions then keep those draws
(`fxmem.nn.checkpoint.DRAW_OPS`: the region's `DrawTape` hands the recomputation the forward's masks) instead of
drawing again, when every draw in the region is such a mask (recomputation replays other draws in order from the
restored RNG state, so keeping only some would shift the others); the memory model counts the kept masks and the
cost leaves their draw out.

Before any region, `remat` (on by default) looks for activations that are cheap functions of tensors autograd keeps
anyway: a GELU, dropout or layer-norm output that the next matmul saves, while the GELU's input, the dropout's
input and mask, or the norm's input and statistics are saved too. Such an output is saved twice over in effect; the
pass rewrites the node as `fxmem.nn.recast.remat(y, "aten.op.overload", *args)`, which hands the consumers'
saved-tensor hooks a recipe instead of the tensor and runs the op again (under no_grad, with a version check) when
backward unpacks it. Outputs and gradients are bit-identical (same op, same inputs), there is no region, no
dispatch mode and no RNG state, and it is what torch.compile's min-cut partitioner does inside its joint graph, in
eager. Sites are taken cheapest recompute per byte first, only as many as the budget needs (all of them when it
needs more, and then regions plan on the rewritten program; if that plan misses the budget, regions plan on the
program without remat). Max pooling is a site too (its recipe covers the int64 argmax indices it keeps for its own
backward), and so is a convolution or linear fed by the input alone when its recompute is cheap enough per byte (a
CNN's first convolution over one to three channels; on CPU such short convolutions and poolings are costed at their
measured speed, several times a pointwise pass, so they are taken after the chains). Ops that save their own output
(ReLU) and short chains whose middle output nobody keeps (batch norm -> in-place ReLU, which stays in place) are
rewritten as `remat_call('aten.op', *args)`: the ReLU's own save and the next conv's both become the recipe
ReLU(batch_norm(conv output)), the conv output being saved by the norm anyway. When the ops saving an output run
their backward back to back (ReLU's own save and the next conv's), backward recomputes it once for all of them
(`_fxmem_share`; the cost model holds it from the first unpack to the last) instead of once per save. A site whose
input is another site's output holds that one nested and recomputes it at each of its own recomputations, unless
its unpacks and the inner site's saves run back to back (a max pooling of a ReLU: the pooled output's unpack, then
the pooling's, then the ReLU's): then the inner value is shared by all of them (`remat_plan`, `_fxmem_nest`), one
chain instead of four. Likewise a max pooling whose output and indices are unpacked back to back runs once for both
(`_fxmem_group`).

Candidates come from module boundaries (`nn_module_stack`): the top-level modules of the model, descending into a
module that holds most of the saved bytes (e.g. `transformer` -> `transformer.h.0`, ...), and, with
`granularity: auto`, also one level finer (`h.0.attn`, `h.0.mlp`): the pass plans at both levels and keeps the
cheaper feasible plan (finer regions reach lower peaks; whole blocks hold fewer region inputs). `within_blocks`
drops candidates that join nodes of two repeated blocks (`h.0.mlp` + `h.1.ln_1`) or a block's with the root's:
FSDP2 (`fxmem.distribute`) shards a block apart only when no node outside it reads its parameters. It is on when
the policy declares `passes.offload.distributed: fsdp`. Each candidate
is a run of consecutive nodes of one module call; nodes that write parameters/buffers/inputs in place stay
outside regions, and batch-norm running statistics are restored after a recomputation (updated once per step).

The memory model is the cost model's (`fxmem.costmodel`, "checkpoint plans": `measure_regions`,
`build_region_model`, `RegionModel`): what each choice of each candidate frees and costs, and a plan's peak (the
baseline's timeline less what the regions before each point free, plus each recomputation's spike where it runs).
Regions sorted by position make every constraint a nested prefix sum; the pass minimises the sum of recompute
costs subject to peak(plan) <= budget: an exact dynamic programme over the chain of regions (bytes quantised,
always rounding in the safe direction), or a MILP (HiGHS through `highspy`) for graphs whose regions are not a
chain (skip connections), with a time limit and a greedy fallback whose optimality gap (vs HiGHS's bound on the
optimum) is reported. Ties in cost are broken towards the lower peak, which makes the planned peak monotone in the
budget: a lower budget never gets a higher planned peak.

The plan is then checked with the cost model's static estimate of the rewritten program (`verify`); if that is
above the budget, the pass plans again against a budget lowered by the overshoot (`refine` times). The stated
tolerance is `slack` (default 5%): measured peak <= budget * (1 + slack), tested on the example models.

Activation budget. `activation_budget` ('6MiB', or '30%' of the baseline's) bounds instead, or as well, the
bytes autograd keeps at the end of forward: what torch.compile's `activation_memory_budget` bounds (a fraction of
what its partitioner would save), and what decides whether a larger batch fits when the peak is elsewhere. Remat
takes sites until the estimate meets every limit given; for regions it is one more constraint of the same
nested form, on the last prefix (every region's forward has run by the end of forward): the bytes all regions
free together >= the activations above the budget (`RegionModel.act_need`). Planned, verified and refined like the
peak; when out of reach, the error (or the best effort, as for the peak) gives the lowest activations
checkpointing reaches.

Emission: each chosen region is outlined (`fxmem.outline`) into a `CheckpointRegion` submodule named
`ckpt_<module path>` that calls its body through `torch.utils.checkpoint(use_reentrant=False,
preserve_rng_state=True)` (dropout masks are reproduced exactly), with a selective policy for `selective`.
Parameters stay owned by the outer module (state_dict keys unchanged) and are passed in as arguments.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch
from torch import fx

from fxmem import ops as optable
from fxmem.costmodel import (CPU_BALANCE, CandidateRegion, RegionModel, as_recipes, build_region_model,
                             default_balance, estimate_from_trace, measure_regions, op_cost, program_key,
                             smallest_fitting_prefix, trace_forward, value_key)
from fxmem.errors import BudgetError, PolicyError
from fxmem.nn.checkpoint import MATMUL_OPS, CheckpointRegion
from fxmem.nn.dropout import bool_mask_dropout, bool_mask_dropout_remat
from fxmem.nn.recast import (INTERNAL_SAVES, flat_args, install as install_recast, op_call, op_named, remat,
                              remat_call)
from fxmem.outline import OutlineError, outline, region_boundary
from fxmem.pipeline import Change, PassResult, register
from fxmem.program import Program, module_stack
from fxmem.units import Budget, format_bytes, parse_budget

CHOICES = ("keep", "selective", "full", "redraw")


@dataclass
class CheckpointOptions:
    """Options of `passes.checkpoint` in a policy."""
    budget: Budget | None = None  # '4GiB', '40%' (of the baseline peak); None: the policy's budget
    # activation bytes left saved at the end of forward: '6MiB', or '30%' of the baseline's (what torch.compile's
    # activation_memory_budget bounds); None: no such bound. With a peak budget too, the plan meets both
    activation_budget: Budget | None = None
    solver: Literal["auto", "dp", "milp", "greedy"] = "auto"  # auto: dp for chains, milp otherwise
    selective: bool = True  # allow selective regions (keep matmul outputs, recompute the rest)
    # recompute cost: roofline (max of FLOPs and `balance` x bytes moved: pointwise and normalization ops are
    # memory-bound), op-table FLOPs alone, or ops timed on the example inputs
    cost: Literal["roofline", "flops", "profile"] = "roofline"
    balance: float | None = None  # roofline: FLOPs per byte of memory traffic; None: 10 on CPU, 100 on CUDA
    time_limit: float = 10.0  # seconds for the MILP before the greedy fallback
    slack: float = 0.05  # stated tolerance: measured peak <= budget * (1 + slack)
    keep_ops: list[str] = field(default_factory=lambda: sorted(MATMUL_OPS))  # what selective regions save
    regions: list[str] = field(default_factory=list)  # module paths to use as candidates (default: automatic)
    granularity: Literal["auto", "block", "sub-block"] = "auto"  # auto: plan at both levels, keep the cheaper
    min_region_fraction: float = 0.01  # ignore candidates saving less than this share of the saved bytes
    verify: bool = True  # estimate the planned program with the cost model (one more trace) and re-plan if high
    refine: int = 2  # at most this many re-plans when the cost model's estimate is above the budget
    # CPU dropout saves a float mask; draw the same numbers into a bool mask instead (bit-identical, 1/4 the bytes),
    # which recompute regions then keep rather than draw again (see compact_dropout)
    compact_dropout: bool = True
    # activations that are cheap functions of tensors autograd keeps anyway (GELU, dropout, layer norm outputs
    # feeding a matmul) are recomputed where backward needs them instead of saved (see remat), before regions
    remat: bool = True
    # regions never join nodes of two repeated blocks (fxmem.distributed.block_paths: h.0, h.1, ...) or a block's
    # with the root's: what FSDP2 needs to shard each block apart (fxmem.distribute). None: when the policy declares
    # `passes.offload.distributed: fsdp`
    within_blocks: bool | None = None


# ============================================================================================ candidates


def _is_region_node(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    t = n.target
    op, args = op_call(t, n.args)
    # in-place ops on values computed in the graph are fine; writes to parameters/buffers/inputs stay outside
    if any(isinstance(a, fx.Node) and a.op in ("get_attr", "placeholder") for a in optable.written_args(op, args)):
        return False
    name = getattr(t, "__name__", "")
    if name == "count_batch" or name.startswith("_assert"):
        return False
    if t is torch.ops.aten.sym_size.int or "sym_size" in str(t):
        return False
    return True


def _paths(n: fx.Node) -> list[str]:
    return [p for p, _ in module_stack(n) if p]


def candidate_regions(program: Program, saved_by_node: dict[str, int], explicit: list[str] | None = None,
                      finer: bool = False) -> list[CandidateRegion]:
    """Module-boundary candidates: runs of consecutive nodes of one module call, in graph order.

    finer: one level below the automatic one (e.g. `h.0.attn`, `h.0.mlp` instead of `h.0`); nodes of the
    parent that belong to no child (residual adds) stay outside the regions."""
    nodes = [n for n in program.graph.nodes if _is_region_node(n)]
    total = sum(saved_by_node.values()) or 1
    if explicit:
        chosen = list(explicit)
    else:
        chosen = _auto_levels(nodes, saved_by_node, total, finer)
    chosen_set = set(chosen)

    def owner(n):
        for p in _paths(n):
            if p in chosen_set:
                return p
        return None

    regions: list[CandidateRegion] = []
    cur: CandidateRegion | None = None
    cur_path = None
    for n in nodes:
        p = owner(n)
        if p is None:
            # getitem nodes and other glue between nodes of one module stay with it
            if cur is not None and getattr(n.target, "__name__", "") == "getitem" and n.args[0] in cur.nodes:
                cur.nodes.append(n)
                continue
            cur, cur_path = None, None
            continue
        if cur is not None and p == cur_path:
            cur.nodes.append(n)
        else:
            cur = CandidateRegion(p, [n])
            cur_path = p
            regions.append(cur)
    for r in regions:
        # a node registering a recipe (a remat wrapper, a remat dropout) whose readers are all outside (a block's
        # closing layer norm, attention's dropped-out probabilities) stays outside too: inside a recomputed region
        # the recipe scope steps aside and its output would be a plain tensor kept by its readers; outside, the
        # recipe is registered and they keep the recipe
        members = set(r.nodes)
        r.nodes = [n for n in r.nodes if not (n.target in (remat, bool_mask_dropout_remat) and n.users and
                                              all(u not in members for u in n.users))]
    regions = [r for r in regions if r.nodes]
    # unique names for repeated calls of one module (e.g. a shared pool)
    seen: dict[str, int] = {}
    for r in regions:
        k = seen.get(r.path, 0)
        seen[r.path] = k + 1
        if k:
            r.path = f"{r.path}#{k}"
    pos = {n: i for i, n in enumerate(program.graph.nodes)}
    for r in regions:
        r.first, r.last = pos[r.nodes[0]], pos[r.nodes[-1]]
    if explicit:
        missing = [p for p in explicit if not any(r.path.split("#")[0] == p for r in regions)]
        if missing:
            raise PolicyError(f"passes.checkpoint.regions: no graph nodes belong to module(s) {missing}")
    return regions


def _writes_input(region: CandidateRegion) -> bool:
    """True if a node of the region writes in place (relu_, add_, ...) to a value created outside it."""
    members = set(region.nodes)
    for n in region.nodes:
        op, args = op_call(n.target, n.args)  # (remat_call('aten.relu_.default', x) writes x too)
        for a in optable.written_args(op, args):
            if isinstance(a, fx.Node):
                base = a
                while base not in members and base.op == "call_function" and base.args \
                        and isinstance(base.args[0], fx.Node) and "view" in str(base.target):
                    base = base.args[0]
                if base not in members:
                    return True
    return False


def chunk_regions(program: Program, regions: list[CandidateRegion], k: int) -> list[CandidateRegion]:
    """Segments of k consecutive regions; each takes every region node between its first and last node (the
    glue in between too, so the segment stays convex). Named `first+last`."""
    pos = {n: i for i, n in enumerate(program.graph.nodes)}
    out = []
    for i in range(0, len(regions), k):
        grp = regions[i:i + k]
        name = grp[0].path if len(grp) == 1 else f"{grp[0].path}+{grp[-1].path.split('.')[-1]}"
        out.append(_spanning(program, pos, grp, name))
    return out


def _spanning(program: Program, pos: dict, grp: list[CandidateRegion], name: str) -> CandidateRegion:
    """One region from the first node of `grp`'s first region to the last of its last, with every region node in
    between (the glue too, so it stays convex)."""
    lo, hi = pos[grp[0].nodes[0]], pos[grp[-1].nodes[-1]]
    r = CandidateRegion(name, [n for n in program.graph.nodes if lo <= pos[n] <= hi and _is_region_node(n)])
    r.first, r.last = lo, hi
    return r


def glue_regions(program: Program, regions: list[CandidateRegion], measure) -> list[CandidateRegion]:
    """The measured `regions` with each one that saves bytes of its own making merged with the regions right after
    it that save none (a U-Net's pooling, up-convolution or output convolution, once remat made what they save
    a recipe), where that frees more: the glue saves its input, the region's output (a 1x1 output convolution
    saves the last block's whole output), which inside the merged region is recomputed instead. `measure` fills
    the merged regions' bytes and costs. Empty when no merge frees more."""
    groups: list[list[CandidateRegion]] = []
    for r in regions:
        if groups and r.saved == 0 and groups[-1][0].saved > 0:
            groups[-1].append(r)
        else:
            groups.append([r])
    pos = {n: i for i, n in enumerate(program.graph.nodes)}
    merged = {i: _spanning(program, pos, g, f"{g[0].path}+{g[-1].path}") for i, g in enumerate(groups) if len(g) > 1}
    if not merged:
        return []
    measure(list(merged.values()))
    better = {i for i, r in merged.items() if r.freed("full") > groups[i][0].freed("full")}
    if not better:
        return []
    return [r for i, g in enumerate(groups) for r in ([merged[i]] if i in better else g)]


def _auto_levels(nodes: list, saved_by_node: dict[str, int], total: int, finer: bool = False) -> list[str]:
    """Top-level module paths; a module holding over half the saved bytes is replaced by its children.
    finer: then every chosen module with two or more children is replaced by its children."""
    saved_by_path: dict[str, int] = {}
    children: dict[str, list[str]] = {}
    tops: list[str] = []
    for n in nodes:
        ps = _paths(n)
        for d, p in enumerate(ps):
            saved_by_path[p] = saved_by_path.get(p, 0) + saved_by_node.get(n.name, 0)
            parent = ps[d - 1] if d else None
            lst = children.setdefault(parent, []) if parent else tops
            if p not in lst:
                lst.append(p)
    out: list[str] = []
    todo = list(tops)
    while todo:
        p = todo.pop(0)
        kids = children.get(p, [])
        if len(kids) >= 2 and saved_by_path.get(p, 0) > 0.5 * total:
            todo = kids + todo
        else:
            out.append(p)
    if finer:
        out = [c for p in out for c in (children.get(p, []) if len(children.get(p, [])) >= 2 else [p])]
    return out


# ============================================================================================ compact dropout masks



def compact_dropout(program: Program) -> list[Change]:
    """Replace train-capable `aten.dropout` of CPU floating tensors by `fxmem.nn.dropout.bool_mask_dropout`.

    CPU dropout saves a float mask; the replacement draws the same numbers into a bool mask (bit-identical outputs
    and gradients, 1 byte per element saved; see fxmem/nn/dropout.py; the pipeline's exactness check would roll
    the pass back on a build where they differ). `train` stays the graph's (the module's .train()/.eval()). CUDA
    already runs the fused native_dropout, whose mask is bool, so CUDA graphs are left alone. The draw is what
    recompute regions keep (fxmem.nn.checkpoint.DRAW_OPS) rather than draw again: on CPU, drawing is most of a
    dropout-heavy forward."""
    g = program.graph
    changes: list[Change] = []
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.dropout.default:
            continue
        x = n.args[0] if n.args else n.kwargs.get("input")
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p")
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train")
        v = x.meta.get("fxmem_val", x.meta.get("val")) if isinstance(x, fx.Node) else None
        if train is False or train is None or isinstance(p, bool) or not isinstance(p, (int, float)) \
                or not 0 < p < 1 or not isinstance(v, torch.Tensor) or v.device.type != "cpu" \
                or not v.dtype.is_floating_point:
            continue
        scale = float(torch.ones((), dtype=v.dtype).div_(1 - p))  # what the float mask held where it kept
        with g.inserting_before(n):
            new = g.create_node("call_function", bool_mask_dropout, (x, float(p), train, scale, v.dtype), {},
                                name=n.name + "_bool")
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        g.erase_node(n)
        path = (_paths(new) or ["<root>"])[-1]
        changes.append(Change(
            kind="checkpoint_compact_dropout", module=path, nodes_before=[n.name], nodes_after=[new.name],
            reason=f"dropout p={p:g} on CPU: the mask autograd saves is drawn as bool (1 byte per element instead "
                   f"of {v.element_size()}): the same random numbers, bit-identical outputs and gradients",
            bytes_saved=_static_numel(v) * (v.element_size() - 1),
            details={"p": float(p), "elements": _static_numel(v) or "data-dependent"}))
    return changes


def _static_numel(v: torch.Tensor) -> int:
    """Elements of a traced value; 0 where the size depends on the data (an unbacked symbol)."""
    try:
        return int(v.numel())
    except Exception:  # noqa: BLE001 - GuardOnDataDependentSymNode and friends
        return 0


# ============================================================================================ remat

REMAT_NORMS = frozenset({"layer_norm", "group_norm", "rms_norm", "native_layer_norm", "native_group_norm",
                         "batch_norm"})
# copies that join tensors: a remat site (a U-Net's skip concatenation), its inputs held or chained
REMAT_JOINS = frozenset({"cat", "stack"})
# pooling (a CNN's down-sampling): max pooling also keeps its int64 argmax indices, recomputed with it
# (fxmem.nn.recast.INTERNAL_SAVES)
REMAT_POOLS = frozenset({"max_pool2d", "max_pool3d", "avg_pool2d"})
# producers a join may recompute as a chain member when nobody else keeps their output (a U-Net's upsampling
# convolution, whose input it saves anyway): dearer than pointwise ops, so never sites of their own
REMAT_CHAIN_ONLY = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})


@dataclass
class RematSite:
    """An activation a consumer saves that is a cheap function of tensors autograd keeps anyway."""
    node: fx.Node
    key: int  # storage key of its output in the trace
    bytes: int  # what the consumers' saves hold
    cost: float  # recompute cost (roofline): once per saving op in backward, once in all if `share`
    path: str
    chain: tuple = ()  # cheap producers recomputed with it (their outputs are not kept either): batch norm -> ReLU
    call: bool = False  # emitted as remat_call: the op saves its own output, runs in place, or has a chain
    share: bool = False  # its savers run their backward back to back: recomputed once, for all of them
    internal: tuple = ()  # storage keys of what else the op saves of its own making (max pooling's indices)
    holds: tuple = ()  # names of the sites whose outputs it holds nested (its inputs, its chain's)
    # names of the sites holding it nested that backward recomputes right next to its own saves (a max pooling of
    # this ReLU): their recomputations can take its value shared with its saves (`remat_plan`)
    adjacent: tuple = ()
    contiguous: bool = True  # its own saves are unpacked back to back (or there is one)
    # its output's and internal saves are unpacked back to back: one run of the full op makes both (`_fxmem_group`)
    group: bool = False

    @property
    def keys(self) -> set:
        return {self.key, *self.internal}


def _remat_op(n: fx.Node) -> bool:
    """A cheap op remat can run again: pointwise (in place too), a layer/group/RMS/batch norm."""
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    if t._schema.is_mutable and not optable.packet(t).endswith("_"):
        return False
    cat = optable.category(t)
    return cat == optable.POINTWISE or (cat == optable.NORM and optable.packet(t) in REMAT_NORMS) or \
        optable.packet(t) in REMAT_JOINS or optable.packet(t) in REMAT_POOLS


# an input-fed matmul or convolution (a CNN's first convolution, on few input channels) is a site when its
# recompute costs at most this many times balance per byte of its output (roofline cost per byte / balance; with
# FLOPs alone, per byte / CPU_BALANCE): 20 admits a short-reduction convolution at the cost model's
# SLOW_KERNELS_CPU 170 per byte (a pointwise op is ~2 by this measure); it is ranked by that cost, after the cheap
# sites
REMAT_INPUT_MATMUL_PASSES = 20.0
# cheaper sites tried, each with one estimate, in place of the one completing the cheapest-per-byte prefix
REMAT_LAST_SITE_TRIES = 8


def _input_fed_matmul(n: fx.Node) -> bool:
    """A matmul-like op (convolution, linear) whose tensor inputs are all graph inputs or parameters."""
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and \
        optable.category(t) == optable.MATMUL and not t._schema.is_mutable and \
        all(a.op in ("placeholder", "get_attr") for a in n.all_input_nodes)


def _chain_op(a: fx.Node, site: fx.Node) -> bool:
    """`a` may be recomputed as a member of `site`'s chain: a cheap op, or a transposed convolution feeding a join."""
    if _remat_op(a):
        return True
    t = a.target
    return a.op == "call_function" and isinstance(t, torch._ops.OpOverload) and \
        optable.packet(t) in REMAT_CHAIN_ONLY and isinstance(site.target, torch._ops.OpOverload) and \
        optable.packet(site.target) in REMAT_JOINS


def remat_sites(program: Program, traced, balance: float | None) -> list[RematSite]:
    """Nodes whose output some op saves for backward (later consumers, or the node itself: ReLU saves its result)
    that (1) are pointwise ops (in-place ones too), layer/group/RMS/batch norms, bool-mask dropout, joins (cat,
    stack: a U-Net's skip concatenation), pooling (max pooling's indices recomputed with it), or a convolution or
    linear fed only by graph inputs and parameters at most REMAT_INPUT_MATMUL_PASSES pointwise passes dear per
    byte (a CNN's first convolution), and (2) have every tensor input held until those saves are unpacked
    anyway (parameters, inputs, tensors saved by this node or an earlier one), or computed by one such cheap op
    from held tensors and kept by nobody (a chain: a batch norm feeding an in-place ReLU is recomputed from the
    norm's input, which the norm saves; a join's upsampling transposed convolution from its input). Cheapest per
    byte first; a site's cost counts an input that is another site's output once per unpack (a nested recipe is
    recomputed with it)."""
    rec, base_keys, out_keys = traced.recorder, traced.base_keys, traced.out_keys
    R = [r for r in rec.records if r.region is None]
    sb = rec.storage_bytes
    by_node: dict[str, list] = {}
    for r in R:
        by_node.setdefault(r.node, []).append(r)
    pos = {r.idx: i for i, r in enumerate(R)}
    saved_upto: dict[int, int] = {}  # storage key -> index of the first record saving it
    savers: dict[int, list] = {}
    for r in R:
        for k in r.saved:
            saved_upto.setdefault(k, r.idx)
            savers.setdefault(k, []).append(r)

    def key_of(a) -> int | None:
        return value_key(by_node, a) if isinstance(a, fx.Node) else None

    def tensor_inputs(n: fx.Node) -> list:
        ins = n.args[:1] if n.target is bool_mask_dropout else n.all_input_nodes
        return [a for a in ins if a.op in ("placeholder", "get_attr")
                or isinstance(a.meta.get("fxmem_val", a.meta.get("val")), torch.Tensor)]

    def held(a: fx.Node, k: int, last: int) -> bool:
        if a.op in ("placeholder", "get_attr"):
            return True
        ak = key_of(a)
        return ak is not None and ak != k and (base_keys.get(ak) is not None or saved_upto.get(ak, last + 1) <= last)

    def cost_of(n: fx.Node) -> float:
        rs = [r for r in by_node.get(n.name, []) if optable.category(r.func) not in (optable.RANDOM, optable.CREATION)]
        return sum(op_cost(r, balance) for r in rs)

    def back_to_back(at: set, between: set = frozenset()) -> bool:
        """Records at these positions (in R) run their backwards one after another: nothing between them but ops
        without a backward or views (no saves, no new tensors), or the records at `between`."""
        if not at:
            return True
        return all(i in at or i in between or not R[i].out_rg or (not R[i].saved and not R[i].new_keys)
                   for i in range(min(at), max(at) + 1))

    sites = []
    per_unpack: dict[str, tuple] = {}  # site -> (recompute cost once, times backward recomputes it)
    unpacked_at: dict[str, set] = {}  # site -> positions (in R) of the records saving its outputs
    for n in program.graph.nodes:
        if n.op != "call_function":
            continue
        dropout = n.target is bool_mask_dropout
        fed = not dropout and _input_fed_matmul(n)
        if not (dropout or fed or _remat_op(n)):
            continue
        v = n.meta.get("fxmem_val", n.meta.get("val"))
        recs = by_node.get(n.name)
        if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point or not recs:
            continue
        k = key_of(n)
        if k is None or k in out_keys or base_keys.get(k) is not None:
            continue
        if any(u.op == "call_function" and isinstance(u.target, torch._ops.OpOverload)
               and u.target._schema.is_mutable and u.args and u.args[0] is n for u in n.users):
            continue  # changed in place later (batch norm -> ReLU_): the in-place op is the site, with a chain
        own = {r.idx for r in recs}
        consumers = savers.get(k, [])
        if not consumers:
            continue
        last = max(own)
        in_place = not dropout and n.target._schema.is_mutable
        chain, ok = [], True
        for i, a in enumerate(tensor_inputs(n)):
            if held(a, k, last) and not (in_place and i == 0):
                continue
            # a cheap producer nobody keeps (or the tensor an in-place op overwrites), its inputs held
            ak = key_of(a)
            if (dropout or not _chain_op(a, n) or a.target._schema.is_mutable or len(a.users) != 1
                    or ak is None or ak in out_keys or base_keys.get(ak) is not None
                    or (ak != k and ak in savers) or not by_node.get(a.name)
                    or not all(held(b, k, last) for b in tensor_inputs(a))):
                ok = False
                break
            chain.append(a)
        if not ok:
            continue
        self_saves = any(k in r.saved for r in recs)
        if fed and cost_of(n) > REMAT_INPUT_MATMUL_PASSES * (balance or CPU_BALANCE) * sb[k]:
            continue  # dearer than a few pointwise passes: regions decide instead
        # savers with nothing between them but ops without a backward or views (no saves, no new tensors): their
        # backwards run back to back, so one recomputation can serve them all, held across no other op's backward
        contiguous = back_to_back({pos[r.idx] for r in consumers})
        share = len(consumers) > 1 and contiguous
        # what else the op saves of its own making (max pooling's indices): a recipe too, the op run again for it
        internal = [s for r in recs for s in r.saved if s != k and s in r.new_keys] \
            if not dropout and optable.op_name(n.target) in INTERNAL_SAVES else []
        unpacked_at[n.name] = {pos[r.idx] for kk in (k, *internal) for r in savers.get(kk, [])}
        group = bool(internal) and back_to_back(unpacked_at[n.name])
        once = cost_of(n) + sum(cost_of(c) for c in chain)
        unpacks = 1 if group else (1 if share else len(consumers)) + bool(internal)
        # a join's list argument may hold recipes' outputs (a skip connection's ReLU): remat_call keeps them as recipes
        call = bool(chain) or in_place or self_saves or bool(internal) or optable.packet(n.target) in REMAT_JOINS
        sites.append(RematSite(n, k, int(sb[k] + sum(sb[s] for s in internal)), float(once * unpacks),
                               (_paths(n) or ["<root>"])[-1], tuple(chain), call, share, tuple(internal),
                               contiguous=contiguous, group=group))
        per_unpack[n.name] = (once, unpacks)
    # an input that is another site's output is a nested recipe (remat_call holds it as a recipe): each unpack
    # recomputes it too (a max pool of a batch norm -> ReLU chain runs the chain again for its output and for its
    # indices), unless the holder's unpacks and the input's own saves are back to back: then one recomputation,
    # shared, serves them all (the pool's output, its indices, its input and the ReLU's result: one chain)
    by_name = {s.node.name: s for s in sites}
    for s in sites:
        members = {c.name for c in s.chain}
        held_names = list(dict.fromkeys(a.name for m in (*s.chain, s.node) for a in tensor_inputs(m)
                                        if a.name in per_unpack and a.name not in members and a.name != s.node.name))
        s.holds = tuple(held_names) if s.call else ()
        # (the holder's own ops run their backward between its saves' and the inner one's)
        own = {pos[r.idx] for m in (*s.chain, s.node) for r in by_node.get(m.name, [])}
        for a in held_names:
            inner = by_name[a]
            if s.call and inner.contiguous and back_to_back(unpacked_at[a] | unpacked_at[s.node.name], own):
                inner.adjacent += (s.node.name,)
            else:
                s.cost += per_unpack[s.node.name][1] * per_unpack[a][0]
    sites.sort(key=lambda s: (s.cost / max(1, s.bytes), s.node.name))
    return sites


def remat_plan(sites: list[RematSite]) -> tuple[set, dict, dict, dict]:
    """For the sites applied together: the outputs recomputed once for all their uses (shared), which recipes hold
    which nested and whether through the shared value (as `DispatchRecorder.nesting`, by storage key), per holder the
    names of the sites it uses that way, and the outputs one shared run makes together (a grouped max pooling's
    output and indices: output key -> group, as `DispatchRecorder.recipe_group`). A nested site is used through its
    shared value by the holders adjacent to it that are applied too; a site is shared when it has more than one use
    that way or of its own."""
    chosen = {s.node.name: s for s in sites}
    through: dict[str, list[str]] = {}  # holder -> nested sites it uses through their shared value
    uses: dict[str, int] = {s.node.name: (2 if s.share else 1) for s in sites}
    for s in sites:
        for a in s.holds:
            if a in chosen and s.node.name in chosen[a].adjacent:
                through.setdefault(s.node.name, []).append(a)
                uses[a] += 1
    shared = {s.node.name for s in sites if uses[s.node.name] > 1 and s.contiguous}
    nesting: dict[int, dict[int, bool]] = {}
    for s in sites:
        for a in s.holds:
            if a in chosen:
                for hk in s.keys:
                    nesting.setdefault(chosen[a].key, {})[hk] = a in through.get(s.node.name, ())
    groups = {k: s.key for s in sites if s.group for k in s.keys}
    return ({chosen[n].key for n in shared} | set(groups), nesting,
            {h: [a for a in ns if a in shared] for h, ns in through.items()}, groups)


def apply_remat(program: Program, sites: list[RematSite]) -> list[Change]:
    """Rewrite each site as `remat(op(*args), 'aten.op', *args)` (bool-mask dropout: its remat variant)."""
    g = program.graph
    by_name = {n.name: n for n in g.nodes}
    shared, _, through, _ = remat_plan(sites)
    site_of: dict[str, str] = {}  # a remat node emitted below -> the site's node
    changes = []
    for s in sites:
        n = by_name[s.node.name]
        share = s.key in shared
        if s.call:
            # remat_call: the op's own saves of its output become the recipe too, and a chained producer's
            # output is held as its recipe (nested), not as a tensor
            names = []
            for c in (*s.chain, n):
                c = by_name[c.name]
                if c.target is not remat_call:
                    # (in place on a chained output nobody else reads, relu_ after a batch norm, stays in place)
                    nest = tuple(i for i, a in enumerate(flat_args(c.args)) if isinstance(a, fx.Node)
                                 and site_of.get(a.name, a.name) in through.get(s.node.name, ()))
                    c.args = (optable.op_name(c.target),) + tuple(c.args)
                    c.target = remat_call
                    if nest:  # nested sites used through their shared value
                        c.kwargs = {**c.kwargs, "_fxmem_nest": nest}
                names.append(c.name)
            if s.group:
                n.kwargs = {**n.kwargs, "_fxmem_group": True}
            elif share:
                n.kwargs = {**n.kwargs, "_fxmem_share": True}
            # under torch.compile the last member recomputes the chain in one checkpoint (fxmem.nn.recast)
            pos = {m: i for i, m in enumerate(names)}
            last = by_name[names[-1]]
            last.kwargs = {**last.kwargs, "_fxmem_chain": tuple(
                (by_name[m].args[0],  # a member's output as "@i", also inside a list argument (cat)
                 fx.node.map_arg(by_name[m].args[1:], lambda a: f"@{pos[a.name]}" if a.name in pos else a),
                 {k: v for k, v in by_name[m].kwargs.items()
                  if k not in ("_fxmem_chain", "_fxmem_share", "_fxmem_nest", "_fxmem_group")})
                for m in names)}
            what = " -> ".join(optable.packet(op_named(by_name[m].args[0])) for m in names)
            changes.append(Change(
                kind="checkpoint_remat", module=s.path, nodes_before=names, nodes_after=names,
                reason=f"{what} output (inputs saved anyway): recomputed where backward needs it, also for the "
                       "op's own saves, instead of kept", bytes_saved=s.bytes, details={"recompute_cost": s.cost}))
            continue
        if n.target is bool_mask_dropout:
            n.target = bool_mask_dropout_remat
            after, what = n.name, "dropout output (input and bool mask are saved anyway)"
        else:
            t = n.target
            op = optable.op_name(t)
            with g.inserting_after(n):
                m = g.create_node("call_function", remat, (n, op) + tuple(n.args),
                                  {**n.kwargs, **({"_fxmem_share": True} if share else {})}, name=n.name + "_remat")
            m.meta.update(n.meta)
            site_of[m.name] = n.name
            n.replace_all_uses_with(m, delete_user_cb=lambda u, m=m: u is not m)
            after, what = m.name, f"{optable.packet(t)} output (its inputs are saved anyway)"
        changes.append(Change(
            kind="checkpoint_remat", module=s.path, nodes_before=[n.name], nodes_after=[after],
            reason=f"{what}: recomputed where backward needs it instead of saved by its consumer",
            bytes_saved=s.bytes, details={"recompute_cost": s.cost}))
    install_recast(program.module)
    program.module.recompile()
    return changes


# ============================================================================================ memory model

def lowest(model: RegionModel) -> tuple[int, list[str]]:
    """(the lowest planned peak of any plan, a plan with it). With recomputation spikes, recomputing a region can
    raise the peak at its backward, so it is the lowest budget some plan fits: the DP's feasibility, bisected (its
    bytes rounded in the safe direction). Found once per model (kept in `model.memo`)."""
    if "lowest" not in model.memo:
        top_plan = model.max_plan()
        best = (model.peak(top_plan), top_plan)
        # (when no spike raises that plan's peak it is the lowest: no plan peaks below it without spikes)
        if best[0] > model.peak(top_plan, spikes=False):
            peak_only = replace(model, act_need=0, memo={})
            lo, hi = max(model.floor, model.live_by_prefix[0]), best[0]
            while hi - lo > max(1, hi // 2048):
                mid = (lo + hi) // 2
                plan = solve_dp(peak_only, mid, q=1024)
                if plan is not None:
                    best = min(best, (model.peak(plan), plan))
                    hi = min(mid, best[0])
                else:
                    lo = mid + 1
        model.memo["lowest"] = best
    return model.memo["lowest"]


def _with_need(model: RegionModel, act_need: int) -> RegionModel:
    """`model` with the regions' total freed bytes bounded below by `act_need` (an activation budget)."""
    return model if model.act_need == act_need else replace(model, act_need=act_need)


# ============================================================================================ solvers

@dataclass
class CandidateSet:
    regions: list
    choices: list
    model: RegionModel
    chain: bool
    level: str
    solved: dict = field(default_factory=dict)  # planning budget -> (solution, tie-broken solution)

@dataclass
class Solution:
    plan: list[str]
    cost: float
    peak: int
    solver: str
    optimal: bool = True
    gap: float | None = None  # relative gap to a lower bound (greedy fallback)
    seconds: float = 0.0
    note: str = ""


def solve_dp(model: RegionModel, budget: int, q: int = 4096) -> list[str] | None:
    """Exact DP over the chain of regions; bytes quantised to need/q units (freed rounded down, needs up)."""
    needs = model.needs(budget)
    spikes = model.spike_needs(budget)
    top = max(needs + [v for d in spikes for v in d.values()])
    n = len(model.regions)
    if top == 0:
        return ["keep"] * n
    if needs[0] > 0:
        return None
    unit = max(1.0, top / q)
    cap = int(math.ceil(top / unit))
    need_u = [int(math.ceil(x / unit)) for x in needs]
    INF = float("inf")
    dp = np.full(cap + 1, INF)
    dp[0] = 0.0
    back = []
    for k, (reg, ch) in enumerate(zip(model.regions, model.choices)):
        new = np.full(cap + 1, INF)
        arg = np.full(cap + 1, -1, dtype=np.int64)
        src = np.full(cap + 1, -1, dtype=np.int64)
        for ci, c in enumerate(ch):
            f = int(reg.freed(c) // unit)
            cand = dp + reg.cost(c)
            if c in spikes[k]:  # its recomputation: the regions before it must free this much
                cand[:int(math.ceil(spikes[k][c] / unit))] = INF
            tmp = np.full(cap + 1, INF)
            tsrc = np.full(cap + 1, -1, dtype=np.int64)
            lo = max(0, cap - f)  # states s < lo move to s + f < cap; the rest saturate at cap
            tmp[f:f + lo] = cand[:lo]
            tsrc[f:f + lo] = np.arange(lo)
            j = int(np.argmin(cand[lo:]))
            if cand[lo + j] < tmp[cap]:
                tmp[cap], tsrc[cap] = cand[lo + j], lo + j
            better = tmp < new - 1e-12 * np.maximum(1.0, np.abs(np.where(np.isfinite(new), new, 0.0)))
            new = np.where(better, tmp, new)
            arg = np.where(better, ci, arg)
            src = np.where(better, tsrc, src)
        new[: need_u[k + 1]] = INF  # prefix constraint after region k
        dp = new
        back.append((arg, src))
    if not np.isfinite(dp).any():
        return None
    # cheapest; among equal cost the most freed (lower peak)
    best = float(dp[np.isfinite(dp)].min())
    s = int(np.nonzero(dp <= best + 1e-9 * max(1.0, abs(best)))[0].max())
    plan = []
    for k in range(n - 1, -1, -1):
        arg, src = back[k]
        plan.append(model.choices[k][int(arg[s])])
        s = int(src[s])
    return plan[::-1]


def _solve_dp_fine(model: RegionModel, budget: int) -> list[str] | None:
    """`solve_dp`; when it finds nothing although a plan fits (the plan freeing the most, or `lowest`'s when
    recomputation spikes bind), again on units fine enough that rounding cannot hide a plan: each region's freed
    bytes round down by up to a unit, so n regions can lose n units (12 decoder layers as 24 segments at 1/4096
    of the need: the whole margin between the lowest peak and a budget a little above it). Else that plan."""
    plan = solve_dp(model, budget)
    if plan is not None or not model.regions:
        return plan
    fits = next((p for p in (model.max_plan(), lowest(model)[1] if model.spike_base else None)
                 if p is not None and model.fits(p, budget)), None)
    if fits is None:
        return None
    return solve_dp(model, budget, q=4096 * len(model.regions)) or fits


class _MilpLayout:
    """The 0/1 variables of a plan (one per region and allowed choice) and the matrices both MILPs use."""

    def __init__(self, model: RegionModel):
        n = len(model.regions)
        self.n = n
        self.var = [(i, c) for i in range(n) for c in model.choices[i]]
        m = len(self.var)
        self.cost = np.array([model.regions[i].cost(c) for i, c in self.var])
        self.one = np.zeros((n, m))  # row i: region i takes exactly one choice
        self.freed = np.zeros((n + 1, m))  # row k: bytes freed by regions[:k]
        for j, (i, c) in enumerate(self.var):
            self.one[i, j] = 1.0
            self.freed[i + 1:, j] = model.regions[i].freed(c)

    def plan(self, x) -> list[str]:
        out = ["keep"] * self.n
        for j, (i, c) in enumerate(self.var):
            if x[j] > 0.5:
                out[i] = c
        return out


def _highs(cost, A, lo, hi, col_lo, col_hi, integer, time_limit: float):
    """min cost.x subject to lo <= A x <= hi, col_lo <= x <= col_hi, x[integer] integral: HiGHS through highspy
    (imported here; `python -X importtime` puts highspy at about 0.1 s and scipy.optimize at 0.4 s). Returns (x or None,
    proven optimal, dual bound): x is the best feasible point found, the dual bound a lower bound on the optimum
    (the optimum itself when proven; at least the LP relaxation's bound otherwise), None when unknown."""
    import highspy
    # the binding itself: the Python wrapper's constructor enables callbacks, which prints HiGHS's banner to the
    # process's stdout before output_flag can be set (highspy 1.16)
    h = getattr(highspy, "_Highs", highspy.Highs)()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    A = np.asarray(A, dtype=float)
    col, row = np.nonzero(A.T)  # the nonzeros column by column
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
    lp.col_cost_ = np.asarray(cost, dtype=float)
    lp.col_lower_ = np.asarray(col_lo, dtype=float)
    lp.col_upper_ = np.asarray(col_hi, dtype=float)
    lp.row_lower_ = np.asarray(lo, dtype=float)
    lp.row_upper_ = np.asarray(hi, dtype=float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.r_[0, np.cumsum(np.bincount(col, minlength=A.shape[1]))].astype(np.int32)
    lp.a_matrix_.index_ = row.astype(np.int32)
    lp.a_matrix_.value_ = A.T[col, row]
    kind = highspy.HighsVarType
    lp.integrality_ = [kind.kInteger if i else kind.kContinuous for i in integer]
    h.passModel(lp)
    h.run()
    status, info = h.getModelStatus(), h.getInfo()
    optimal = status == highspy.HighsModelStatus.kOptimal
    feasible = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if feasible else None
    bound = None
    if optimal:
        bound = float(info.objective_function_value)
    elif status == highspy.HighsModelStatus.kTimeLimit and math.isfinite(info.mip_dual_bound):
        bound = float(info.mip_dual_bound)
    return x, optimal, bound


def solve_milp(model: RegionModel, budget: int, time_limit: float):
    """The cheapest plan under `budget` as a MILP (HiGHS). Returns (plan or None, proven optimal, lower bound on
    the optimal cost or None): the bound is the optimum when proven, HiGHS's dual bound when the time limit
    stopped it, the LP relaxation's optimum when it stopped before having one (what a greedy plan's optimality
    gap is measured against)."""
    needs = model.needs(budget)
    if needs[0] > 0:  # above the budget before any region: nothing can help (as solve_dp)
        return None, True, None
    spikes = model.spike_needs(budget)
    lay = _MilpLayout(model)
    m = len(lay.var)
    scale = max(1.0, lay.cost.max())
    bscale = max(1.0, max(needs + [v for d in spikes for v in d.values()]))
    binding = [k for k in range(1, lay.n + 1) if needs[k] > 0]  # prefix k: freed(regions[:k]) >= need[k]
    # region k recomputed with choice c: freed(regions[:k]) >= its spike's need, i.e. freed - need * x[k, c] >= 0
    col = {v: j for j, v in enumerate(lay.var)}
    spike_rows = []
    for k, d in enumerate(spikes):
        for c, need in d.items():
            row = lay.freed[k].copy()
            row[col[(k, c)]] -= need
            spike_rows.append(row)
    A = np.vstack([lay.one, lay.freed[binding] / bscale] + [np.array(spike_rows) / bscale] * bool(spike_rows))
    lo = np.r_[np.ones(lay.n), np.array([needs[k] for k in binding], dtype=float) / bscale, np.zeros(len(spike_rows))]
    hi = np.r_[np.ones(lay.n), np.full(len(binding) + len(spike_rows), np.inf)]
    x, optimal, bound = _highs(lay.cost / scale, A, lo, hi, np.zeros(m), np.ones(m), [True] * m, time_limit)
    if bound is None:  # stopped before HiGHS had a bound: the LP relaxation's optimum is one (an LP solves fast)
        _, lp_optimal, lp = _highs(lay.cost / scale, A, lo, hi, np.zeros(m), np.ones(m), [False] * m, math.inf)
        bound = lp if lp_optimal else None
    bound = bound * scale if bound is not None else None
    if x is None:
        return None, False, bound
    return lay.plan(x), optimal, bound


def milp_lowest_peak(model: RegionModel, plan: list[str], time_limit: float) -> list[str]:
    """Among plans no costlier than `plan`, one with the lowest planned peak: one MILP (minimise P subject to
    live[k] - freed(regions[:k]) <= P for every prefix k and cost <= plan's), not a bisection over budgets."""
    lay = _MilpLayout(model)
    n, m = lay.n, len(lay.var)
    c0, p0 = model.cost(plan), model.peak(plan)
    cscale = max(1.0, lay.cost.max())
    bscale = float(max(1, p0))
    # columns: the plan's variables, then P; rows: one choice per region, no costlier (a relative tolerance: the
    # solver's own is about 1e-6), then P + freed(regions[:k]) >= live[k] for every prefix k, then the bytes all
    # regions free >= the activation need
    A = np.zeros((n + 1 + n + 1 + 1, m + 1))
    A[:n, :m] = lay.one
    A[n, :m] = lay.cost / cscale
    A[n + 1:2 * n + 2, :m] = lay.freed / bscale
    A[n + 1:2 * n + 2, m] = 1.0
    A[2 * n + 2, :m] = lay.freed[n] / bscale
    lo = np.r_[np.ones(n), -np.inf, np.array(model.live_by_prefix, dtype=float) / bscale, model.act_need / bscale]
    hi = np.r_[np.ones(n), c0 / cscale * (1 + 1e-7) + 1e-9, np.full(n + 2, np.inf)]
    # region k recomputed with choice c: P + freed(regions[:k]) - (spike base + spike) * x[k, c] >= 0
    rows = []
    for j, (k, c) in enumerate(lay.var):
        extra = model.regions[k].spike.get(c, 0) if c != "keep" and k < len(model.spike_base) else 0
        if extra > 0:
            row = np.zeros(m + 1)
            row[:m] = lay.freed[k] / bscale
            row[j] -= (model.spike_base[k] + extra) / bscale
            row[m] = 1.0
            rows.append(row)
    if rows:
        A = np.vstack([A, np.array(rows)])
        lo = np.r_[lo, np.zeros(len(rows))]
        hi = np.r_[hi, np.full(len(rows), np.inf)]
    obj = np.zeros(m + 1)
    obj[m] = 1.0
    x, _, _ = _highs(obj, A, lo, hi, np.r_[np.zeros(m), model.floor / bscale], np.r_[np.ones(m), np.inf],
                     [True] * m + [False], time_limit)
    if x is None:
        return plan
    out = lay.plan(x)
    # the solver's tolerances must not make the plan costlier, its peak higher or its freed bytes short
    if model.cost(out) <= c0 * (1 + 1e-9) + 1e-9 and model.peak(out) <= p0 and model.freed(out) >= model.act_need:
        return out
    return plan


def solve_greedy(model: RegionModel, budget: int) -> list[str] | None:
    """Upgrade the region with the best bytes-freed per unit cost until the plan fits (nested by budget)."""
    n = len(model.regions)
    plan = ["keep"] * n
    rank = {c: i for i, c in enumerate(CHOICES)}
    while not model.fits(plan, budget):
        best, best_ratio = None, -1.0
        for i, (reg, ch) in enumerate(zip(model.regions, model.choices)):
            for c in ch:
                if rank[c] <= rank[plan[i]]:
                    continue
                df = reg.freed(c) - reg.freed(plan[i])
                if df <= 0:
                    continue
                dc = reg.cost(c) - reg.cost(plan[i])
                ratio = df / max(dc, 1e-9)
                if ratio > best_ratio:
                    best, best_ratio = (i, c), ratio
        if best is None:
            return None
        plan[best[0]] = best[1]
    return plan


def is_chain(regions: list[CandidateRegion], program: Program) -> bool:
    """True if values flow from region to region only forward by one (glue nodes traced through)."""
    owner: dict[fx.Node, int] = {}
    for i, r in enumerate(regions):
        for n in r.nodes:
            owner[n] = i
    memo: dict[fx.Node, set] = {}

    def sources(v: fx.Node) -> set:
        if v in owner:
            return {owner[v]}
        if v in memo:
            return memo[v]
        memo[v] = set()
        out = set()
        for a in v.all_input_nodes:
            out |= sources(a)
        memo[v] = out
        return out

    for i, r in enumerate(regions):
        for a in r.inputs:
            for j in sources(a):
                if j != i - 1 and j != i:
                    return False
    return True


def solve(model: RegionModel, budget: int, solver: str, time_limit: float, chain: bool,
          tiebreak: bool = True) -> Solution | None:
    """The cheapest plan under `budget`; with `tiebreak`, among the cheapest the one with the lowest planned peak
    (see `tie_break`)."""
    t0 = time.perf_counter()
    kind = solver if solver != "auto" else ("dp" if chain else "milp")
    note = ""
    optimal, gap = True, None
    if kind == "dp":
        plan = _solve_dp_fine(model, budget)
        if plan is not None and tiebreak:
            # lexicographic tie-break: the lowest budget with the same cost gives the lowest peak
            plan = _lowest_peak_same_cost(model, plan, budget, lambda b: solve_dp(model, b))
    elif kind == "milp":
        plan, optimal, bound = solve_milp(model, budget, time_limit)
        if plan is not None and optimal and tiebreak:
            plan = milp_lowest_peak(model, plan, time_limit)
        if plan is None or not optimal:
            g = solve_greedy(model, budget)
            if g is not None and (plan is None or model.cost(g) < model.cost(plan)):
                note = (f"MILP found no proven optimum within time_limit={time_limit:g}s; greedy plan used")
                plan, kind = g, "greedy"
            if plan is not None and bound:
                gap = (model.cost(plan) - bound) / max(bound, 1e-12)
    else:
        plan = solve_greedy(model, budget)
        optimal = False
        if plan is not None:
            try:
                _, _, bound = solve_milp(model, budget, time_limit)  # the optimum, or a bound on it
            except Exception:  # noqa: BLE001 - the bound is informative only
                bound = None
            if bound:
                gap = (model.cost(plan) - bound) / max(bound, 1e-12)
    if plan is None:
        return None
    return Solution(plan, model.cost(plan), model.peak(plan), kind, optimal, gap, time.perf_counter() - t0, note)


def tie_break(sol: Solution, model: RegionModel, budget: int, time_limit: float) -> Solution:
    """`sol` (found with tiebreak=False) replaced by a plan of the same cost with the lowest planned peak."""
    if sol.solver == "dp":
        plan = _lowest_peak_same_cost(model, sol.plan, budget, lambda b: solve_dp(model, b))
    elif sol.solver == "milp" and sol.optimal:
        plan = milp_lowest_peak(model, sol.plan, time_limit)
    else:
        return sol
    return Solution(plan, model.cost(plan), model.peak(plan), sol.solver, sol.optimal, sol.gap, sol.seconds,
                    sol.note)


def _lowest_peak_same_cost(model: RegionModel, plan: list[str], budget: int, solve_at, iters: int = 24) -> list[str]:
    """Among plans with the optimal cost, one with the lowest planned peak (bisection on the budget)."""
    c0 = model.cost(plan)
    lo, hi = model.min_peak(), model.peak(plan)
    best = plan
    for _ in range(iters):
        if hi - lo <= max(1, hi // 4096):
            break
        mid = (lo + hi) // 2
        p = solve_at(mid)
        if p is not None and model.cost(p) <= c0 * (1 + 1e-9) + 1e-9:
            best, hi = p, min(model.peak(p), mid)
        else:
            lo = mid + 1
    return best


# ============================================================================================ the pass

def resolve_budget(options: CheckpointOptions, ctx, baseline_peak: int) -> int | None:
    b = options.budget
    if b is None:
        return ctx.budget
    return _resolve(b, "budget", baseline_peak)


def resolve_activation_budget(options: CheckpointOptions, baseline_activations: int) -> int | None:
    b = options.activation_budget
    return None if b is None else _resolve(b, "activation_budget", baseline_activations)


def _resolve(b, key: str, baseline: int) -> int:
    if not isinstance(b, Budget):
        try:
            b = parse_budget(b)
        except ValueError as e:
            raise PolicyError(f"passes.checkpoint.{key}: {e}") from None
    return int(b.resolve(baseline))


# Two best-effort plans (remat + regions, regions alone) at limits neither reaches: the one planned lowest is
# emitted and verified; the other only if it was planned less than this fraction above the first's estimate. The
# memory model's lowest plans sit within +1% of their estimates on the example models (tests pin -0.5% .. +2.5%), so
# a plan planned further above cannot come out lower, and its emission (a trace of the whole program) is saved.
BEST_EFFORT_MARGIN = 0.03
NO_PEAK = 1 << 62  # the planning budget of a peak nobody bounds (only activations are)


@dataclass(frozen=True)
class Limits:
    """What the plan must meet: the estimated peak <= `peak` and the activations saved at the end of forward <=
    `activations` (either may be None: unbounded)."""
    peak: int | None
    activations: int | None

    def over(self, peak: int, activations: int) -> int:
        """By how many bytes an estimate misses (0 when it meets both)."""
        return max(0, peak - self.peak if self.peak is not None else 0,
                   activations - self.activations if self.activations is not None else 0)

    def fits(self, est) -> bool:
        return self.over(est.peak, est.activations) == 0

    def miss_metrics(self, m: dict) -> int:
        """By how many bytes a pass result's estimate misses (an unchecked one, verify=False, counts as fitting)."""
        return self.over(m.get("estimated_peak") or 0, m.get("estimated_activations") or 0)

    def fits_note(self, est) -> str:
        return (f"checkpoint: the estimate (peak {format_bytes(est.peak)}, activations "
                f"{format_bytes(est.activations)}) already fits {self.describe()}; nothing recomputed")

    def describe(self) -> str:
        parts = ([f"the budget {format_bytes(self.peak)}"] if self.peak is not None else []) + \
            ([f"the activation budget {format_bytes(self.activations)}"] if self.activations is not None else [])
        return " and ".join(parts)


def profile_nodes(program: Program, repeats: int = 3) -> dict[str, float]:
    """Seconds per node on the example inputs (median of `repeats` runs)."""
    gm = program.module
    times: dict[str, list[float]] = {}

    class _Timer(fx.Interpreter):
        def run_node(self, n):
            t0 = time.perf_counter()
            out = super().run_node(n)
            times.setdefault(n.name, []).append(time.perf_counter() - t0)
            return out

    flat = program.flat_inputs()
    with torch.no_grad():
        for _ in range(repeats):
            _Timer(gm).run(*flat, enable_io_processing=False)
    return {k: float(np.median(v)) for k, v in times.items()}


def _current_estimate(program: Program, ctx):
    """The context's baseline if it was made for this very program (same code, mode and optimizer), else None."""
    base = ctx.baseline
    if base is not None and getattr(base, "program_key", "") and base.program_key == program_key(program) \
            and getattr(base, "mode", ctx.mode) == ctx.mode \
            and getattr(base, "optimizer", ctx.optimizer) == ctx.optimizer:
        return base
    return None


def _restore_args(inputs: list, nodes: list, gm) -> tuple[int, ...]:
    """Indices of region inputs that are buffers the region updates in place (batch-norm running stats)."""
    mutated: set = set()
    for n in nodes:
        t, args = op_call(n.target, n.args)  # (a remat_call batch norm runs inside a region as the norm itself)
        if t in (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default):
            for a in args[3:5]:
                if isinstance(a, fx.Node):
                    mutated.add(a)
        mutated.update(a for a in optable.written_args(t, args) if isinstance(a, fx.Node))
    return tuple(i for i, a in enumerate(inputs) if a in mutated and a.op == "get_attr")


@register
class CheckpointPass:
    name = "checkpoint"
    exact = True
    Options = CheckpointOptions

    def run(self, program: Program, ctx) -> PassResult:
        opts: CheckpointOptions = ctx.options if isinstance(ctx.options, CheckpointOptions) else CheckpointOptions()
        notes: list[str] = []
        t0 = time.perf_counter()
        if ctx.mode != "train":
            return PassResult(program, False, notes=["checkpoint: inference mode saves nothing for backward; "
                                                     "nothing to do"])
        base = ctx.baseline if ctx.baseline is not None else ctx.estimate(program)
        budget = resolve_budget(opts, ctx, base.peak)
        act_budget = resolve_activation_budget(opts, base.activations)
        if budget is None and act_budget is None:
            return PassResult(program, False, notes=["checkpoint: no budget set (passes.checkpoint.budget, "
                                                     "passes.checkpoint.activation_budget or the policy's budget); "
                                                     "nothing to do"])
        lim = Limits(budget, act_budget)
        keep_ops = frozenset(opts.keep_ops)
        if opts.within_blocks is None:
            from fxmem.distributed import declared_mode
            opts = replace(opts, within_blocks=declared_mode(ctx.policy) == "fsdp")
        est0 = _current_estimate(program, ctx)  # the baseline itself when it was made for this program
        traced = None
        if est0 is None:
            traced = self._trace(program, ctx)
            est0 = estimate_from_trace(program, traced, mode=ctx.mode, optimizer=ctx.optimizer, loss_fn=ctx.loss_fn)
        # best_effort: the limit out of reach that the pass planned as low as it goes instead ("peak",
        # "activations"); None when the limits are reachable
        metrics = {"budget": budget, "peak_before": est0.peak, "slack": opts.slack, "best_effort": None}
        if act_budget is not None:
            metrics.update({"activation_budget": act_budget, "activations_before": est0.activations})
        if lim.fits(est0):
            notes.append(lim.fits_note(est0))
            return PassResult(program, False, notes=notes, metrics=metrics)
        # over budget: first the free, exact saving (bool dropout masks), then recomputation for the rest
        pre: list[Change] = []
        if opts.compact_dropout:
            compacted = program.snapshot()
            pre = compact_dropout(compacted)
            if pre:
                compacted.graph.lint()  # the new nodes carry the replaced nodes' metadata (same shapes and dtypes)
                compacted.module.recompile()
                program = compacted
                traced = self._trace(program, ctx)
                before = est0
                est0 = estimate_from_trace(program, traced, mode=ctx.mode, optimizer=ctx.optimizer,
                                           loss_fn=ctx.loss_fn)
                metrics["compact_dropout"] = {"sites": len(pre), "peak_after": est0.peak,
                                              "activations_saved": before.activations - est0.activations}
                ctx.log(f"[checkpoint] {len(pre)} dropout masks drawn as bool: estimated peak "
                        f"{format_bytes(before.peak)} -> {format_bytes(est0.peak)}")
        if traced is None:
            traced = self._trace(program, ctx)
        if lim.fits(est0):
            notes.append(lim.fits_note(est0))
            if pre:
                metrics.update({"estimated_peak": est0.peak, "estimated_activations": est0.activations})
            return PassResult(program, bool(pre), changes=pre, notes=notes, metrics=metrics)

        if opts.regions:
            candidate_regions(program, {}, opts.regions)  # names every listed module that is not in the graph
        if opts.remat:
            # cheap activations whose inputs are kept anyway: recomputed in backward (no region, no dispatch
            # mode), the cheapest per byte first; only as many as the budget needs, all of them if it needs more
            sites = remat_sites(program, traced, opts.balance if opts.balance is not None
                                else default_balance(program) if opts.cost == "roofline" else None)
            if sites:
                def missed(chosen: list) -> int:  # bytes the estimate with these sites misses the limits by
                    shared, nesting, _, groups = remat_plan(chosen)
                    est = estimate_from_trace(program, as_recipes(traced, set().union(*(s.keys for s in chosen)),
                                                                  shared, nesting, groups),
                                              mode=ctx.mode, optimizer=ctx.optimizer, loss_fn=ctx.loss_fn)
                    return lim.over(est.peak, est.activations)
                k = smallest_fitting_prefix(len(sites), lambda k: missed(sites[:k]), 0)
                chosen = sites[:k]
                if k < len(sites):  # (the prefix fits: smallest_fitting_prefix gives all sites when none does)
                    # the site completing the prefix need not be the next by cost per byte: a cheaper one further
                    # down may free enough (a 1 MiB chain where the next in line is a 2 MiB concatenation)
                    cheaper = sorted((s for s in sites[k:] if s.cost < sites[k - 1].cost), key=lambda s: s.cost)
                    for s in cheaper[:REMAT_LAST_SITE_TRIES]:
                        if missed(sites[:k - 1] + [s]) <= 0:
                            chosen = sites[:k - 1] + [s]
                            break
                rematted = program.snapshot()
                rm = apply_remat(rematted, chosen)
                rematted.graph.lint()
                traced2 = self._trace(rematted, ctx)
                est2 = estimate_from_trace(rematted, traced2, mode=ctx.mode, optimizer=ctx.optimizer,
                                           loss_fn=ctx.loss_fn)
                if est2.peak < est0.peak or ((est2.peak == est0.peak or budget is None)
                                             and est2.activations < est0.activations):
                    metrics["remat"] = {"sites": len(rm), "candidates": len(sites), "peak_after": est2.peak,
                                        "activations_saved": est0.activations - est2.activations}
                    ctx.log(f"[checkpoint] {len(rm)} of {len(sites)} cheap activations recomputed in backward: "
                            f"estimated peak {format_bytes(est0.peak)} -> {format_bytes(est2.peak)}")
                    if lim.fits(est2):
                        notes.append(f"checkpoint: {len(rm)} cheap activations recomputed in backward bring the "
                                     f"estimate to peak {format_bytes(est2.peak)}, activations "
                                     f"{format_bytes(est2.activations)}, within {lim.describe()}; no region "
                                     f"recomputed")
                        metrics.update({"estimated_peak": est2.peak, "estimated_activations": est2.activations})
                        return PassResult(rematted, True, changes=pre + rm, notes=notes, metrics=metrics)
                    # regions for the rest, planned on the rewritten program and on the program without remat
                    # (recipes and regions interact: a region input that is a recipe is recomputed too, and a
                    # region can make remat's recomputation redundant); the cheaper plan that fits wins
                    remat_cost = sum(s.cost for s in chosen) if opts.cost != "profile" else 0.0
                    def planner(prog, tr, est, changes, mets):
                        memo: dict = {}

                        def run(only: bool):
                            if "sets" not in memo:
                                memo["sets"] = self._candidate_sets(prog, tr, est, opts, keep_ops)
                            return self._plan_regions(prog, tr, est, changes, list(notes), dict(mets), opts, ctx,
                                                      lim, keep_ops, t0, only, memo["sets"])
                        return run

                    return self._remat_or_not(
                        planner(rematted, traced2, est2, pre + rm, metrics),
                        planner(program, traced, est0, pre, {m: v for m, v in metrics.items() if m != "remat"}),
                        remat_cost, lim)
        return self._plan_regions(program, traced, est0, pre, notes, metrics, opts, ctx, lim, keep_ops, t0)

    @staticmethod
    def _remat_or_not(with_remat, without, remat_cost: float, lim: Limits) -> PassResult:
        """Regions with remat or regions alone. Both are planned (the memory model and the solver, no tracing);
        the cheaper reachable plan (remat's own recompute counted) is emitted and verified. The other is emitted
        too only if it may be cheaper after all (the verify-and-refine loop made the first costlier) or the first
        misses the limits by its estimate (and, when neither plan reaches them, the other was not planned clearly
        higher: BEST_EFFORT_MARGIN): the cheaper one that fits wins, else the lower estimate. Limits
        neither plan reaches (one by its planner, the other by its estimate) are a BudgetError. `run(True)` plans
        only: (cost, planned shortfall, reachable); `run(False)` emits and verifies (a PassResult)."""
        def fits(r) -> bool:
            return lim.miss_metrics(r.metrics) == 0

        def cost(r, extra) -> float:
            return extra + next((r.metrics[m] for m in ("recompute_roofline_flops", "recompute_flops",
                                                        "recompute_seconds") if r.metrics.get(m) is not None), 0.0)

        def clearly_lower(r, planned_miss: int) -> bool:
            """r (emitted, missing the limits by its estimate) comes out lower than a best-effort plan planned to
            miss them by `planned_miss`, even if the memory model put that plan BEST_EFFORT_MARGIN above what it
            would estimate: emitting and verifying that one (another trace) would not change the choice."""
            miss = lim.miss_metrics(r.metrics)
            peak, acts = r.metrics.get("estimated_peak") or 0, r.metrics.get("estimated_activations") or 0
            on = peak if lim.peak is not None and peak - lim.peak >= miss else acts  # the estimate missing the most
            return planned_miss - miss > BEST_EFFORT_MARGIN * on

        plans, err = [], None
        for run, extra in ((with_remat, remat_cost), (without, 0.0)):
            try:
                planned_cost, miss, reachable = run(True)
            except BudgetError as e:
                err = err or e
                continue
            # reachable plans first, cheapest first; best-effort plans (unreachable limits) by planned shortfall
            plans.append(((not reachable, planned_cost + extra if reachable else miss), run, extra))
        if not plans:
            raise err
        plans.sort(key=lambda t: t[0])
        (_, run1, extra1), rest = plans[0], plans[1:]
        first = run1(False)
        best, best_run, why = first, run1, "the cheaper plan"
        if rest and not (fits(first) and (rest[0][0][0] or cost(first, extra1) <= rest[0][0][1])) \
                and not (rest[0][0][0] and clearly_lower(first, rest[0][0][1])):
            (_, run2, extra2) = rest[0]
            try:
                second = run2(False)
            except BudgetError:
                second = None
            if second is not None and (fits(second) and not fits(first) or fits(second) and fits(first)
                                       and cost(second, extra2) < cost(first, extra1)):
                best, best_run = second, run2
                why = "the cheaper plan that fits" if fits(first) else "the plan that fits"
            elif second is not None and not fits(first) and not fits(second) and \
                    lim.miss_metrics(second.metrics) < lim.miss_metrics(first.metrics):
                best, best_run, why = second, run2, "the lower estimate"
        if err is not None and not fits(best):
            # the other plan cannot reach the budget and this one misses it by its estimate: unreachable (a plan
            # returned here could peak above what a lower, best-effort budget gives: not monotone)
            raise err
        if best_run is without:
            best.notes.append(f"checkpoint: regions without remat: {why} (remat + regions was planned too, its "
                              f"own recompute counted)")
        return best

    @staticmethod
    def _candidate_sets(program: Program, traced, est0, opts, keep_ops: frozenset) -> list:
        """Candidate regions at each level (block, sub-block, segments), measured, with their memory models."""
        rec, base_keys = traced.recorder, traced.base_keys
        saved_by_node: dict[str, int] = {}
        seen: set = set()
        for r in rec.records:
            for k in r.saved:
                if k not in seen and base_keys.get(k) is None:
                    seen.add(k)
                    saved_by_node[r.node] = saved_by_node.get(r.node, 0) + rec.storage_bytes[k]
        node_time = profile_nodes(program) if opts.cost == "profile" else None
        balance = None
        if opts.cost == "roofline":
            balance = opts.balance if opts.balance is not None else default_balance(program)
        levels = {"block": [False], "sub-block": [True], "auto": [False, True]}[opts.granularity]
        if opts.regions:
            levels = [False]
        sets: list[CandidateSet] = []
        seen_paths: set = set()
        block_of: dict = {}
        if opts.within_blocks:
            from fxmem.distributed import node_blocks
            block_of = node_blocks(program.module)
        candidate_lists = []
        for finer in levels:
            regions = candidate_regions(program, saved_by_node, opts.regions or None, finer=finer)
            candidate_lists.append(("sub-block" if finer else "block", regions))
        if opts.granularity == "auto" and not opts.regions:
            # uniform segments of k consecutive finest regions (Chen et al.): a region of one op frees nothing
            finest = candidate_lists[-1][1]
            for k in range(2, max(2, int(math.isqrt(len(finest)))) + 2):
                if len(finest) >= k + 1:
                    candidate_lists.append((f"segments-{k}", chunk_regions(program, finest, k)))
        for level, regions in candidate_lists:
            key = tuple(tuple(n.name for n in r.nodes) for r in regions)
            if key in seen_paths or not regions:
                continue
            seen_paths.add(key)
            regions = [r for r in regions if not _writes_input(r)]  # recomputation would see the written value
            if opts.within_blocks:
                regions = [r for r in regions if len({block_of.get(n) for n in r.nodes}) == 1]
            measure_regions(program, regions, rec, base_keys, keep_ops, node_time, balance)
            if level == "block" and not opts.regions:
                glued = glue_regions(program, regions, lambda rs: measure_regions(
                    program, rs, rec, base_keys, keep_ops, node_time, balance))
                if glued:
                    candidate_lists.append(("block+glue", glued))
            total_saved = sum(r.saved for r in regions) or 1
            if not opts.regions:
                worth = [r for r in regions if r.freed("full") >= opts.min_region_fraction * total_saved]
                if worth and len(worth) < len(regions) and any(r.held for r in worth):
                    # measured again without the others: an output of a region left out (a ReLU block that frees
                    # nothing) is no longer one a recomputed region would make again, so its readers need not hold
                    # it (only `held` depends on the other regions)
                    measure_regions(program, worth, rec, base_keys, keep_ops, node_time, balance)
                regions = worth
            if not regions:
                continue
            choices = [(("keep", "selective", "full") if opts.selective and not r.sel_blocked
                        and r.freed("selective") > 0 and r.flops_sel < r.flops else ("keep", "full"))
                       + (("redraw",) if r.keep_full and r.freed("redraw") > r.freed("full") else ())
                       for r in regions]
            model = build_region_model(est0, regions, program, choices, traced)
            sets.append(CandidateSet(regions, choices, model, is_chain(regions, program), level))
        return sets

    def _plan_regions(self, program: Program, traced, est0, pre: list, notes: list, metrics: dict, opts, ctx,
                      lim: Limits, keep_ops: frozenset, t0: float, plan_only: bool = False, sets=None):
        """Recompute regions on `program` (already rewritten by `pre`) for the rest of the way to the limits;
        `plan_only`: the first plan's (cost, planned shortfall, limits reachable) without emitting it. `sets`: the
        candidate sets, if already built for this program."""
        if sets is None:
            sets = self._candidate_sets(program, traced, est0, opts, keep_ops)
        if not sets:
            if plan_only:
                return 0.0, lim.over(est0.peak, est0.activations), False
            notes.append("checkpoint: no candidate region saves activations; nothing to do")
            if pre:
                metrics.update({"estimated_peak": est0.peak, "estimated_activations": est0.activations})
            return PassResult(program, bool(pre), changes=pre, notes=notes, metrics=metrics)
        metrics["candidates"] = {cs.level: len(cs.regions) for cs in sets}
        budget = lim.peak if lim.peak is not None else NO_PEAK  # the planning budget of the peak
        act_need = max(0, est0.activations - lim.activations) if lim.activations is not None else 0

        def planned_miss(cs, plan) -> int:
            return lim.over(cs.model.peak(plan), est0.activations - cs.model.freed(plan))

        min_set = min(sets, key=lambda cs: max(cs.model.min_peak(), cs.model.floor))
        min_peak = max(min_set.model.min_peak(), min_set.model.floor)
        if lim.peak is not None and min_peak > lim.peak:
            # recomputation spikes can put the plan freeing the most above a lower one: look harder before giving up
            min_set = min(sets, key=lambda cs: max(lowest(cs.model)[0], cs.model.floor))
            min_peak = max(lowest(min_set.model)[0], min_set.model.floor)
        act_set = max(sets, key=lambda cs: cs.model.max_freed())
        before_acts = metrics.get("activations_before", est0.activations)  # before this pass (and remat)
        min_acts = est0.activations - act_set.model.max_freed()
        best_effort = None  # out of reach, the limit planned as low as it goes: "peak" or "activations"
        msg = None
        if lim.peak is not None and min_peak > lim.peak:
            msg, best_effort = self._budget_message(lim.peak, min_peak, est0, min_set.model), "peak"
        elif lim.activations is not None and min_acts > lim.activations:
            msg, best_effort = self._activation_message(lim.activations, min_acts, before_acts), "activations"
        if msg is not None:
            if "offload" in ctx.enabled and best_effort == "peak":
                # (the offload pass plans against the peak budget: it does not take over an activation budget)
                notes.append(msg + " The offload pass is enabled and takes the rest: checkpointing goes as low as "
                                   "it reaches.")
            elif not getattr(ctx, "budget_strict", True):
                # a preset's budget is a target: go as low as checkpointing can and say so
                notes.append(msg + " The policy's budget is a target (budget_strict: false): checkpointing goes "
                                   "as low as it reaches.")
            else:
                raise BudgetError(msg)
        metrics["best_effort"] = best_effort

        # plan against the memory model, emit on a copy, check with the cost model; if the estimate misses the
        # limits, plan again against a peak budget lowered, or an activation need raised, by the overshoot (at
        # most `refine` times)
        target, need = budget, act_need
        best = None
        for attempt in range(1 + max(0, opts.refine)):
            if best_effort is not None:
                # best effort: the cheapest plan reaching the lowest planned peak (or activations) rather than
                # simply everything recomputed
                cs = min_set if best_effort == "peak" else act_set
                model = cs.model if best_effort == "peak" else _with_need(cs.model, cs.model.max_freed())
                # (the lowest peak within `lowest`'s resolution: a solver asked for exactly it may miss it)
                low = lowest(cs.model)[0]
                at = max(low + max(1, low // 2048), cs.model.floor) if best_effort == "peak" else budget
                sol = solve(model, at, opts.solver, opts.time_limit, cs.chain)
                if sol is None:
                    plan = lowest(cs.model)[1] if best_effort == "peak" else cs.model.max_plan()
                    sol = Solution(plan, cs.model.cost(plan), cs.model.peak(plan),
                                   "lowest" if best_effort == "peak" else "max", True)
            else:
                found = []
                key = (target, need)
                for cs in sets:
                    if key not in cs.solved:  # planning, then emitting, solve the same limits
                        cs.solved[key] = [solve(_with_need(cs.model, need), target, opts.solver, opts.time_limit,
                                                cs.chain, tiebreak=False), None]
                    sl = cs.solved[key][0]
                    if sl is not None:
                        found.append((sl.cost, sl.peak, len(found), sl, cs))
                if not found:
                    if best is not None:
                        break
                    raise BudgetError(self._budget_message(lim.peak, min_peak, est0, min_set.model)
                                      if lim.peak is not None and (lim.activations is None or act_need == 0)
                                      else self._activation_message(lim.activations, min_acts, before_acts)
                                      + (f" With the budget {format_bytes(lim.peak)} as well, no plan meets "
                                         f"both." if lim.peak is not None else ""))
                # cheapest, then lowest planned peak: only the sets at the lowest cost can win, so only their
                # plans go through the (costly) lowest-peak tie-break
                c_min = min(t[0] for t in found)
                for c, _, _, sl, cs2 in found:
                    if c <= c_min * (1 + 1e-9) + 1e-9 and cs2.solved[key][1] is None:
                        cs2.solved[key][1] = tie_break(sl, _with_need(cs2.model, need), target, opts.time_limit)
                found = [(c, cs2.solved[key][1].peak, i, cs2.solved[key][1], cs2)
                         for c, _, i, _, cs2 in found if c <= c_min * (1 + 1e-9) + 1e-9]
                _, _, _, sol, cs = min(found, key=lambda t: t[:3])
            if plan_only:
                return sol.cost, planned_miss(cs, sol.plan), best_effort is None
            trial = program.snapshot()
            changes = self._emit(trial, cs.regions, sol.plan, keep_ops)
            # (_emit linted and recompiled; the manager refreshes meta after the pass)
            est1 = ctx.estimate(trial) if opts.verify else None
            miss = lim.over(est1.peak, est1.activations) if est1 is not None else 0
            if best is None or best[3] is None or est1 is None or (miss, est1.peak) < best[6]:
                best = (sol, trial, changes, est1, target, cs, (miss, est1.peak if est1 is not None else 0))
            if best_effort is not None or est1 is None or miss == 0:
                break
            if lim.peak is not None and est1.peak > lim.peak:
                target = target - (est1.peak - lim.peak) - max(1, lim.peak // 1000)
            if lim.activations is not None and est1.activations > lim.activations:
                if need >= act_set.model.max_freed():
                    break
                # at most everything the regions can free: the plan freeing the most is the last one to try
                need = min(need + (est1.activations - lim.activations) + max(1, lim.activations // 1000),
                           act_set.model.max_freed())
            if target < min_peak:
                break
        sol, trial, changes, est1, target, cs, _ = best
        if est1 is None:
            lowered = True  # (not checked: verify=False)
        elif lim.activations is not None:  # fewer activations, the peak no higher
            lowered = est1.activations < est0.activations and (lim.peak is None or est1.peak <= est0.peak)
        else:  # a lower peak, or the same with fewer activations
            lowered = (est1.peak, est1.activations) < (est0.peak, est0.activations)
        if not lowered:
            why = (f"no plan of the candidate regions frees activations" if lim.activations is not None else
                   f"the peak is where recomputation cannot reach, at {est0.peak_at or est0.peak_phase}")
            kept = (f"no region emitted; the {len(pre)} rewrite(s) before regions (remat, compact dropout) are kept"
                    if pre else "graph left unchanged")
            notes.append(f"checkpoint: the best plan would not lower the estimated memory (peak "
                         f"{format_bytes(est1.peak)} vs {format_bytes(est0.peak)}, activations "
                         f"{format_bytes(est1.activations)} vs {format_bytes(est0.activations)}: {why}); {kept}")
            metrics.update({"estimated_peak": est0.peak if pre else est1.peak,
                            "estimated_activations": est0.activations if pre else est1.activations,
                            "plan": {r.path: c for r, c in zip(cs.regions, sol.plan)}})
            return PassResult(program, bool(pre), changes=pre, notes=notes, metrics=metrics)
        program = trial
        regions = cs.regions
        metrics.update({"chain": cs.chain, "granularity": cs.level})
        if sol.note:
            notes.append("checkpoint: " + sol.note)
        metrics.update({
            "solver": sol.solver, "optimal": sol.optimal, "gap": sol.gap, "solve_seconds": round(sol.seconds, 4),
            "planned_peak": sol.peak, "planning_budget": target if lim.peak is not None else None,
            "planned_activations": est0.activations - cs.model.freed(sol.plan),
            "estimated_peak": est1.peak if est1 is not None else None,
            "estimated_activations": est1.activations if est1 is not None else None,
            "recompute_flops": sol.cost if opts.cost == "flops" else None,
            "recompute_roofline_flops": sol.cost if opts.cost == "roofline" else None,
            "recompute_seconds": sol.cost if opts.cost == "profile" else None,
            "forward_flops": est0.flops_forward, "plan": {r.path: c for r, c in zip(regions, sol.plan)},
            "transform_seconds": round(time.perf_counter() - t0, 3),
        })
        if est1 is not None and lim.peak is not None and est1.peak > lim.peak * (1 + opts.slack):
            notes.append(f"checkpoint: estimated peak after the pass {format_bytes(est1.peak)} is above the "
                         f"budget {format_bytes(lim.peak)} + {opts.slack:.0%} slack (planned "
                         f"{format_bytes(sol.peak)})")
        if est1 is not None and lim.activations is not None and est1.activations > lim.activations * (1 + opts.slack):
            notes.append(f"checkpoint: estimated activations after the pass {format_bytes(est1.activations)} are "
                         f"above the activation budget {format_bytes(lim.activations)} + {opts.slack:.0%} slack "
                         f"(planned {format_bytes(metrics['planned_activations'])})")
        ctx.log(f"[checkpoint] {sum(c != 'keep' for c in sol.plan)}/{len(regions)} regions recomputed "
                f"({sol.solver}); planned peak {format_bytes(sol.peak)}, estimated "
                f"{format_bytes(est1.peak) if est1 is not None else 'not checked'}"
                + (f", activations {format_bytes(est1.activations)}" if est1 is not None else "")
                + f"; {lim.describe()}")
        return PassResult(program, bool(changes) or bool(pre), changes=pre + changes, notes=notes, metrics=metrics)

    # ------------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _trace(program: Program, ctx):
        return trace_forward(program, program.example_args, program.example_kwargs, ctx.mode, ctx.loss_fn)

    @staticmethod
    def _budget_message(budget, min_peak, est, model) -> str:
        fixed = est.params + est.buffers + est.grads + est.optimizer_state + est.inputs
        return (f"checkpoint: budget {format_bytes(budget)} is below the lowest peak checkpointing reaches, "
                f"about {format_bytes(min_peak)} (baseline {format_bytes(est.peak)}). What cannot be checkpointed: "
                f"parameters {format_bytes(est.params)}, gradients {format_bytes(est.grads)}, optimizer state "
                f"{format_bytes(est.optimizer_state)}, buffers {format_bytes(est.buffers)}, inputs "
                f"{format_bytes(est.inputs)} (together {format_bytes(fixed)}), plus the inputs each recomputed "
                f"region keeps and the last region's activations. Raise the budget, or enable the offload pass.")

    @staticmethod
    def _activation_message(act_budget, min_acts, before) -> str:
        return (f"checkpoint: activation budget {format_bytes(act_budget)} is below the lowest activations at the "
                f"end of forward that checkpointing reaches, about {format_bytes(max(0, min_acts))} (before the "
                f"pass {format_bytes(before)}): every recomputed region keeps its inputs, and the model's output and "
                f"what the last region needs stay. Raise the activation budget (the offload pass plans against the "
                f"peak budget, not this one).")

    @staticmethod
    def _emit(program: Program, regions: list[CandidateRegion], plan: list[str], keep_ops: frozenset) -> list[Change]:
        changes = []
        by_name = {n.name: n for n in program.graph.nodes}  # the program may be a snapshot: same names
        for reg, choice in zip(regions, plan):
            if choice == "keep":
                continue
            nodes = [by_name[n.name] for n in reg.nodes]
            keep = {"selective": keep_ops | reg.keep_full, "full": reg.keep_full}.get(choice, frozenset())
            ins, _ = region_boundary(nodes)
            restore = _restore_args(ins, nodes, program.module)
            label = reg.path.split("#")[0]
            before = [n.name for n in nodes]
            try:
                call = outline(program, nodes, "ckpt_" + reg.path.replace("#", "_"),
                               wrap=lambda body, keep=keep, label=label, restore=restore:
                               CheckpointRegion(body, keep, label=label, restore_args=restore), recompile=False)
            except OutlineError as e:
                changes.append(Change("checkpoint_skipped", label, before, [], f"not outlined: {e}", 0))
                continue
            changes.append(Change(
                kind="checkpoint_" + choice, module=label, nodes_before=before, nodes_after=[call.name],
                reason=(("full recompute, dropout masks drawn again" if choice == "redraw" else f"{choice} recompute")
                        + f": frees about {format_bytes(reg.freed(choice))} of saved activations "
                        f"for {reg.cost(choice):.3g} recompute cost"
                        + (f" (keeps outputs of {', '.join(sorted(keep))})" if keep else "")),
                bytes_saved=reg.freed(choice),
                details={"choice": choice, "saved_bytes": reg.saved,
                         "kept_bytes": reg.kept if choice == "selective" else reg.kept_full,
                         "recompute_cost": reg.cost(choice), "submodule": call.target}))
        program.graph.lint()
        program.module.recompile()  # once for all the regions (outline(recompile=False))
        return changes
