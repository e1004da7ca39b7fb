"""Offload pass: when checkpointing cannot reach the budget, move what is not needed now to a slower tier.

Activations (default): candidate regions (module-boundary runs, graph segments, checkpoint regions already in the
graph) are measured by the cost model and timed by FLOP/s and tier bandwidth (probed, or `compute_rate` and
`bandwidth`); with a budget the largest and longest-lived are taken until the static estimate fits, without one
only those whose transfers compute hides. Each is outlined into an `OffloadRegion` (`fxmem.nn.offload`) sharing
one `OffloadRuntime`. Weights (`weights: true`): frozen parameters in blocks over `max_memory` stream in through
a `WeightStreamer`. Gradients/optimizer (`grads: true`) and `distributed` are recorded on the module
(`module.fxmem_offload`) for `fxmem.make_optimizer` and `fxmem.distribute`.
Design: docs/design/offload.md, "The pass".
"""
from __future__ import annotations

import functools
import operator
import re
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import fx

from fxmem.blocks import block_paths
from fxmem.copy_on_write import private_owner
from fxmem.costmodel import TraceIndex, estimate, node_costs, smallest_fitting_prefix, trace_forward
from fxmem.errors import PolicyError
from fxmem.graph_segments import with_segments
from fxmem.module_runs import finish_runs
from fxmem.nn.offload import OffloadRegion, OffloadRuntime, WeightStreamer, probe_bandwidth
from fxmem.nn.remat import op_call
from fxmem.nn.regions import region_info
from fxmem.outline import OutlineError, outline, region_boundary, unique_name
from fxmem.pass_api import Change, DeviceInfo, Pass, PassContext, PassResult, register
from fxmem.program import Program, module_stack
from fxmem.units import Budget, Size, format_bytes, parse_size

DEFAULT_FLOPS_PER_S = 2e10  # fallback when the matmul probe fails


@dataclass
class OffloadOptions:
    """Options of `passes.offload` in a policy."""
    activations: bool = True  # offload saved activations of chosen regions
    weights: bool = False  # stream frozen / inference-time weights from the slow tier
    grads: bool = False  # gradients to host as they are accumulated, optimizer steps on host (training loop)
    tier: Literal["auto", "cpu", "disk"] = "auto"  # auto: cpu (pinned host) for CUDA models, disk on CPU hosts
    prefetch: int = 1  # regions (or weight blocks) loaded ahead of backward (use)
    bandwidth: str | None = None  # e.g. '2GB/s'; default: a quick probe of the tier
    compute_rate: str | None = None  # e.g. '50GFLOP/s'; default: a quick matmul probe (pin it for a repeatable plan)
    budget: Budget | None = None  # '4GiB', '40%'; None: the policy's budget
    max_memory: dict[str, str] | None = None  # weights: {'cpu': '1GiB'} keep blocks resident up to this
    distributed: Literal["none", "ddp", "fsdp"] = "none"  # recorded for fxmem.distribute
    min_bytes: Size = Size(64 * 1024)  # saved tensors smaller than this stay on the device
    regions: list[str] = field(default_factory=list)  # module paths to use as candidates (default: automatic)
    grad_threshold: Size | None = None  # grads: move only when device memory is above this
    scratch_dir: str | None = None  # where the per-step scratch directory is created (default: the temp dir)
    unlink_early: bool = True  # disk: unlink scratch files (activations, streamed weights) once open (nothing on disk)

    def __post_init__(self) -> None:
        # rates are checked when the policy is read (the error names the file and line), not when the pass runs
        for key, parse in (("bandwidth", _parse_bandwidth), ("compute_rate", _parse_rate)):
            if getattr(self, key) is not None:
                try:
                    parse(getattr(self, key))
                except PolicyError as error:
                    raise ValueError(f"{key}: {str(error).partition(': ')[2]}") from None


# ============================================================================================ candidates

@dataclass
class Candidate:
    path: str
    nodes: list  # fx nodes (a run), or [call_module node] for a checkpoint region
    kind: str  # "run" | "checkpoint"
    first: int = 0
    last: int = 0
    saved: int = 0  # bytes the region would offload
    flops: float = 0.0
    score: float = 0.0
    transfer_s: float = 0.0
    compute_s: float = 0.0
    exposed_s: float = 0.0  # transfer time the neighbouring compute does not hide


def _is_run_node(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    schema = getattr(op_call(target, node.args)[0], "_schema", None)  # (remat_call of an in-place op writes too)
    if schema is not None and schema.is_mutable:
        return False
    name = getattr(target, "__name__", "")
    if name == "count_batch" or name.startswith("_assert") or "sym_size" in str(target):
        return False
    if "higher_order" in str(target):
        return False  # wrap_with_set_grad_enabled etc.: keep outside regions
    return True


def _paths(node: fx.Node) -> list[str]:
    return [p for p, _ in module_stack(node) if p]


def _levels(nodes: list[fx.Node], saved_by_node: dict[str, int]) -> list[str]:
    total = sum(saved_by_node.values()) or 1
    by_path: dict[str, int] = {}
    children: dict[str, list[str]] = {}
    tops: list[str] = []
    for node in nodes:
        paths = _paths(node)
        for depth, path in enumerate(paths):
            by_path[path] = by_path.get(path, 0) + saved_by_node.get(node.name, 0)
            siblings = children.setdefault(paths[depth - 1], []) if depth else tops
            if path not in siblings:
                siblings.append(path)
    out, todo = [], list(tops)
    while todo:
        path = todo.pop(0)
        kids = children.get(path, [])
        if len(kids) >= 2 and by_path.get(path, 0) > 0.5 * total:
            todo = kids + todo
        else:
            out.append(path)
    return out


def candidates(program: Program, saved_by_node: dict[str, int], explicit: list[str]) -> list[Candidate]:
    """Runs of consecutive nodes of one module call, and existing checkpoint regions, in graph order."""
    graph_module = program.module
    nodes = list(program.graph.nodes)
    run_nodes = [node for node in nodes if _is_run_node(node)]
    chosen = list(explicit) if explicit else _levels(run_nodes, saved_by_node)
    chosen_set = set(chosen)
    out: list[Candidate] = []
    cur: Candidate | None = None
    for node in nodes:
        if node.op == "call_module":
            info = region_info(graph_module.get_submodule(node.target))
            if info is not None and info.kind == "recompute" and not isinstance(graph_module.get_submodule(node.target),
                                                                                 OffloadRegion):
                out.append(Candidate(node.target, [node], "checkpoint"))
            cur = None
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            if cur is not None and node.args[0] in cur.nodes:
                cur.nodes.append(node)  # an element of the run's own tuple (split, max_pool2d_with_indices)
            else:
                # glue reading another node's tuple (a multi-output checkpoint region's results): outside every
                # run, so a run takes the tensors as inputs, not the tuple
                cur = None
            continue
        if not _is_run_node(node):
            if node.op in ("get_attr", "placeholder"):
                continue
            cur = None
            continue
        owner = next((p for p in _paths(node) if p in chosen_set), None)
        if owner is None:
            cur = None
            continue
        if cur is not None and cur.path == owner and cur.kind == "run":
            cur.nodes.append(node)
        else:
            cur = Candidate(owner, [node], "run")
            out.append(cur)
    if not explicit:
        out = with_segments(out, nodes, saved_by_node, _is_run_node, lambda name, seg: Candidate(name, seg, "run"))
    finish_runs(out, nodes, explicit, "passes.offload.regions")
    return out


def measure_candidates(program: Program, cands: list[Candidate], min_bytes: int) -> None:
    """Bytes each candidate would offload and its FLOPs, from the cost model's forward trace."""
    traced = trace_forward(program, program.example_args, program.example_kwargs, program.mode)
    recorder, base_keys = traced.recorder, traced.base_keys
    index = TraceIndex.of(recorder)
    created_in = index.created_in
    for cand in cands:
        records = [r for n in cand.nodes for r in index.by_node.get(n.name, [])]
        if cand.kind == "checkpoint":
            # the region's recorded ops are its body's; what it keeps is its non-parameter inputs
            call = cand.nodes[0]
            idxs = {r.idx for r in recorder.records if r.region == call.target}
            records = [r for r in recorder.records if r.idx in idxs]
            region_start = min(idxs) if idxs else 0
            keys = set()
            for record in records:
                for key in record.in_keys:
                    if key is not None and base_keys.get(key) is None and created_in.get(key, -1) < region_start \
                            and not (set(index.savers.get(key, ())) - idxs):
                        keys.add(key)
        else:
            idxs = {r.idx for r in records}
            keys = {key for r in records if r.out_rg for key in r.saved
                    if base_keys.get(key) is None and created_in.get(key) in idxs}
        cand.saved = sum(recorder.storage_bytes[key] for key in keys if recorder.storage_bytes[key] >= min_bytes)
        cand.flops = float(sum(r.flops for r in records))


def _parse_bandwidth(text: str) -> float:
    match = re.fullmatch(r"\s*(.+?)\s*/\s*s(ec)?\s*", text)
    if not match:
        raise PolicyError(f"passes.offload.bandwidth: expected a rate like '2GB/s', got {text!r}")
    try:
        return float(parse_size(match.group(1)))
    except ValueError as error:
        raise PolicyError(f"passes.offload.bandwidth: {error}") from None


_FLOP_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def _parse_rate(text: str) -> float:
    """'50GFLOP/s', '5e10 FLOP/s', '2 TFLOPS' -> FLOP/s."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMGTP]?)\s*(?:FLOP/s|FLOPS|flop/s|flops)\s*",
                     str(text))
    if not match or float(match.group(1)) <= 0:
        raise PolicyError(f"passes.offload.compute_rate: expected a positive rate like '50GFLOP/s', got {text!r}")
    return float(match.group(1)) * _FLOP_PREFIX[match.group(2).upper()]


# ============================================================================================ the pass

def resolve_tier(tier: str, device: DeviceInfo) -> str:
    if tier == "auto":
        return "cpu" if device.pinned_host else "disk"
    if tier == "cpu" and not device.pinned_host:
        raise PolicyError(f"passes.offload.tier: 'cpu' moves CUDA tensors to pinned host memory, but the model is "
                          f"on {device.type}; use 'disk' (or 'auto') on a CPU host")
    return tier


@register
class OffloadPass(Pass):
    name = "offload"
    exact = True
    Options = OffloadOptions

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        options: OffloadOptions = ctx.options
        if options.prefetch < 0:
            raise PolicyError(f"passes.offload.prefetch: must be >= 0, got {options.prefetch}")
        tier = resolve_tier(options.tier, ctx.device_for(program))
        changes, notes, metrics = [], [], {"tier": tier}
        plan = {"tier": tier, "grads": options.grads, "grad_threshold": options.grad_threshold,
                "distributed": options.distributed, "fsdp_blocks": []}
        budget = ctx.budget
        if options.budget is not None:
            budget = options.budget.resolve(ctx.baseline.peak) if ctx.baseline is not None else None
        if options.activations and program.mode == "train":
            region_changes, region_notes, region_metrics = offload_activations(program, options, tier, budget, ctx)
            changes += region_changes
            notes += region_notes
            metrics.update(region_metrics)
        elif options.activations:
            notes.append("activations: inference mode saves nothing for backward; nothing to offload")
        if options.weights:
            weight_changes, weight_notes = offload_weights(program, options, tier)
            changes += weight_changes
            notes += weight_notes
        if options.grads:
            changes.append(Change("offload-plan", "", [], [], "gradients to host as accumulated, optimizer on host "
                                  "(fxmem.make_optimizer returns a fxmem.nn.offload.OffloadedOptimizer)", None,
                                  {"grad_threshold": options.grad_threshold}))
            notes.append("grads: the plan is recorded on the module (fxmem_offload); fxmem.make_optimizer(module, "
                         "policy) wraps the optimizer in fxmem.nn.offload.OffloadedOptimizer, which moves gradients to "
                         "the host as they are accumulated")
        if options.distributed != "none":
            plan["fsdp_blocks"] = block_paths(program.module)
            changes.append(Change("offload-plan", "", [], [], f"run under {options.distributed} (fxmem.distribute)",
                                  None, {"blocks": plan["fsdp_blocks"]}))
            notes.append(f"distributed: {options.distributed} recorded; call fxmem.distribute(module, options) after "
                         f"torch.distributed.init_process_group (blocks: {len(plan['fsdp_blocks'])})")
        program.module.fxmem_offload = plan
        return PassResult(program, bool(changes), changes, notes, metrics)


def offload_activations(program: Program, options: OffloadOptions, tier: str, budget: int | None, ctx):
    notes: list[str] = []
    costs = _saved_by_node(program)
    cands = candidates(program, costs, list(options.regions))
    measure_candidates(program, cands, int(options.min_bytes))
    cands = [c for c in cands if c.saved > 0]
    if not cands:
        return [], ["activations: no region saves tensors of at least min_bytes; nothing to offload"], {}
    bandwidth = _parse_bandwidth(options.bandwidth) if options.bandwidth else _probe(tier, options, notes)
    rate = _parse_rate(options.compute_rate) if options.compute_rate else _probe_flops(program)
    n_nodes = len(program.graph.nodes)
    for position, cand in enumerate(cands):
        cand.transfer_s = cand.saved / bandwidth
        cand.compute_s = cand.flops / rate
        nxt = cands[position + 1].flops / rate if position + 1 < len(cands) else 0.0
        # write hides behind the region's own forward; the read behind the next region's backward (~2x forward)
        cand.exposed_s = max(0.0, cand.transfer_s - cand.compute_s) + max(0.0, cand.transfer_s - 2 * nxt)
        cand.score = cand.saved * (n_nodes - cand.last)  # large and long-lived first
    order = sorted(cands[:-1] if len(cands) > 1 else [], key=lambda c: (-c.score, c.first))
    if not order:
        return [], ["activations: only one candidate region (the last before backward, needed at once); "
                    "offloading it cannot lower the peak"], {}
    metrics = {"bandwidth_bytes_per_s": bandwidth, "flops_per_s": rate, "candidates": len(cands)}
    # probed rates differ run to run: they stay out of the notes (metrics named *_s go to the report's timing
    # section, left out of the deterministic report); pinned rates are policy values and are named
    pinned = bool(options.bandwidth and options.compute_rate)
    rates = (f"{format_bytes(bandwidth)}/s, compute {rate:.3g} FLOP/s" if pinned
             else "bandwidth and compute rate probed on this machine: see the timing section")

    def apply(count: int) -> Program:
        trial = program.snapshot()
        emit(trial, order[:count], options, tier)
        trial.refresh()
        return trial

    @functools.cache
    def peak_of(count: int) -> int:
        return estimate(apply(count), mode=program.mode, optimizer=ctx.optimizer, loss_fn=ctx.loss_fn).peak

    if budget is not None:
        base_peak = ctx.baseline.peak if ctx.baseline is not None else peak_of(0)
        if base_peak <= budget:
            return [], [f"activations: the estimated peak {format_bytes(base_peak)} already fits the budget "
                        f"{format_bytes(budget)}; nothing offloaded"], metrics
        count = smallest_fitting_prefix(len(order), peak_of, budget)
        if count == len(order) and peak_of(count) > budget:
            notes.append(f"activations: offloading every candidate ({count}) gives an estimated peak of "
                         f"{format_bytes(peak_of(count))}, above the budget {format_bytes(budget)}")
        chosen = order[:count]
    else:
        chosen = [c for c in order if c.exposed_s <= 0.1 * max(c.compute_s, 1e-9)]
        if not chosen:
            return [], [f"activations: no budget, and no region's transfer ({rates}) is hidden by its compute; "
                        f"nothing offloaded (set a budget to force it)"], metrics
    chosen_set = set(id(c) for c in chosen)
    chosen = [c for c in cands if id(c) in chosen_set]
    changes = emit(program, chosen, options, tier)
    metrics["offloaded_bytes"] = sum(c.saved for c in chosen)
    metrics["exposed_transfer_s"] = sum(c.exposed_s for c in chosen)
    exposed = (f"; estimated transfer time not hidden by compute: {sum(c.exposed_s for c in chosen) * 1e3:.1f} ms"
               if pinned else "; the transfer time compute cannot hide is in the timing section")
    notes.append(f"activations: {len(chosen)} of {len(cands)} regions to {tier}, "
                 f"{format_bytes(sum(c.saved for c in chosen))} per step ({rates}){exposed}")
    return changes, notes, metrics


def _probe(tier: str, options: OffloadOptions, notes: list) -> float:
    try:
        return probe_bandwidth(tier, 16 << 20, scratch_root=options.scratch_dir)
    except Exception as error:  # noqa: BLE001
        notes.append(f"bandwidth probe failed ({error}); assumed 1 GB/s")
        return 1e9


def _probe_flops(program: Program) -> float:
    """Matmul FLOP/s on the model's device (a ~10 ms probe); compute time of a region = its FLOPs / this."""
    dev = next((p.device for p in program.module.parameters()), torch.device("cpu"))
    try:
        matrix = torch.randn(256, 256, device=dev)
        matrix @ matrix
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        for _ in range(4):
            matrix @ matrix
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return max(1e8, 4 * 2 * 256 ** 3 / max(time.perf_counter() - start, 1e-9))
    except Exception:  # noqa: BLE001
        return DEFAULT_FLOPS_PER_S


def _saved_by_node(program: Program) -> dict[str, int]:
    return {k: v.saved_bytes for k, v in node_costs(program).items()}


def emit(program: Program, chosen: list[Candidate], options: OffloadOptions, tier: str) -> list[Change]:
    """Outline each chosen run into an OffloadRegion; wrap chosen checkpoint regions. One shared runtime."""
    graph_module = program.module
    by_name = {nd.name: nd for nd in program.graph.nodes}  # candidates may come from the graph this was copied from
    chosen = [Candidate(c.path, [by_name[nd.name] for nd in c.nodes], c.kind, c.first, c.last, c.saved, c.flops,
                        c.score, c.transfer_s, c.compute_s, c.exposed_s) for c in chosen]
    runtime = OffloadRuntime(tier=tier, prefetch=options.prefetch, min_bytes=int(options.min_bytes),
                             scratch_root=options.scratch_dir, unlink_early=options.unlink_early)
    changes = []
    n_regions = len(chosen)
    for position, cand in enumerate(chosen):
        if cand.kind == "checkpoint":
            call = cand.nodes[0]
            region = graph_module.get_submodule(call.target)
            params = tuple(j for j, a in enumerate(call.args) if isinstance(a, fx.Node) and a.op == "get_attr")
            wrapper = OffloadRegion(region, runtime, index=position, last=(position == n_regions - 1),
                                    param_args=params, inputs_too=True, label=cand.path,
                                    checkpoint_region=region_info(region))
            name = f"offload_{call.target}"
            graph_module.add_submodule(name, wrapper)
            call.target = name
            changes.append(Change("offload", cand.path, [call.target], [name],
                                  f"checkpoint region inputs to {tier}", cand.saved,
                                  {"kind": "checkpoint", "index": position, "exposed_s": cand.exposed_s}))
            continue
        before = [m.name for m in cand.nodes]
        ins, _ = region_boundary(cand.nodes)
        params = tuple(j for j, a in enumerate(ins) if a.op == "get_attr")
        try:
            call = outline(program, cand.nodes, "offload_" + cand.path.replace("#", "_"),
                           wrap=lambda body, position=position, params=params, cand=cand: OffloadRegion(
                               body, runtime, index=position, last=(position == n_regions - 1), param_args=params,
                               label=cand.path),
                           recompile=False)
        except OutlineError as error:
            raise OutlineError(f"offload region {cand.path}: {error}") from None
        changes.append(Change("offload", cand.path, before, [call.target],
                              f"saved activations to {tier}, prefetch {options.prefetch}", cand.saved,
                              {"kind": "run", "index": position, "transfer_s": cand.transfer_s,
                               "exposed_s": cand.exposed_s}))
    graph_module.graph.lint()
    graph_module.recompile()  # once for all the regions (outline(recompile=False))
    return changes


# ============================================================================================ weights

def offload_weights(program: Program, options: OffloadOptions, tier: str):
    """Frozen parameters -> WeightStreamer blocks fetched before first use (see the module docstring)."""
    graph_module = program.module
    frozen = _frozen_parameters(program)
    if not frozen:
        return [], ["weights: no frozen parameters (requires_grad=False) to stream; in training only frozen "
                    "weights (e.g. a distillation teacher) can be offloaded"]
    position = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    groups = _weight_blocks([node.target for node, _ in frozen],
                            {node.target: _nbytes(param) for node, param in frozen})
    blocks: dict[str, list] = {}
    for node, param in frozen:
        blocks.setdefault(groups[node.target], []).append((node, param))
    order = sorted(blocks, key=lambda block: min(position[user] for node, _ in blocks[block] for user in node.users))
    resident, streamed = _split_resident(order, blocks, _device_limit(graph_module, options))
    if not streamed:
        return [], [f"weights: all {len(order)} frozen blocks fit max_memory; nothing streamed"]
    spec = {block: [(node.target, param.detach()) for node, param in blocks[block]] for block in streamed}
    streamer = WeightStreamer(spec, tier=tier, prefetch=options.prefetch, scratch_root=options.scratch_dir,
                              unlink_early=options.unlink_early)  # (detached copies: the user's flags stay)
    name = unique_name(graph_module, "fxmem_weights")
    graph_module.add_submodule(name, streamer)
    changes = [_fetch_block(graph_module, name, block_index, block, blocks[block], position, tier)
               for block_index, block in enumerate(streamed)]
    for block in streamed:
        for node, _ in blocks[block]:
            _remove_attr(graph_module, node.target)
    streamer.install_state_dict_hooks(graph_module, name)
    graph_module.graph.lint()
    graph_module.recompile()
    notes = [f"weights: {len(streamed)} block(s) streamed from {tier} "
             f"({format_bytes(streamer.bytes_offloaded)}), {len(resident)} resident under max_memory"]
    return changes, notes


def _nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def _frozen_parameters(program: Program) -> list:
    """(get_attr node, parameter) for each used parameter the streamer may take: frozen ones in training, every
    one in inference (their requires_grad flags are the user's, shared with the model, and stay as they are)."""
    graph_module = program.module
    inference = program.mode == "inference"
    frozen = []
    for node in graph_module.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            param = graph_module.get_parameter(node.target)
        except AttributeError:
            continue
        if (inference or not param.requires_grad) and node.users:
            frozen.append((node, param))
    return frozen


def _device_limit(graph_module, options: OffloadOptions) -> int | None:
    """`max_memory`'s bytes for the parameters' device tier, None without a max_memory."""
    if not options.max_memory:
        return None
    device = next((param.device for param in graph_module.parameters()), torch.device("cpu")).type
    if device not in options.max_memory:
        raise PolicyError(f"passes.offload.max_memory: no entry for the device tier {device!r} "
                          f"(have {sorted(options.max_memory)})")
    return parse_size(options.max_memory[device])


def _split_resident(order: list, blocks: dict, limit: int | None) -> tuple[list, list]:
    """(resident, streamed) blocks: in order of first use, those that still fit `limit` stay on the device."""
    resident, streamed, used = [], [], 0
    for block in order:
        size = sum(_nbytes(param) for _, param in blocks[block])
        if limit is not None and used + size <= limit:
            resident.append(block)
            used += size
        else:
            streamed.append(block)
    return resident, streamed


def _fetch_block(graph_module, streamer_name: str, block_index: int, block: str, members: list, position: dict,
                 tier: str) -> Change:
    """Before the block's first use, fetch it from the streamer; its parameters' nodes become items of the fetch."""
    graph = graph_module.graph
    first_user = min((user for node, _ in members for user in node.users), key=lambda user: position[user])
    with graph.inserting_before(first_user):
        fetch = graph.call_module(streamer_name, (block_index,))
        fetch.meta["nn_module_stack"] = dict(first_user.meta.get("nn_module_stack") or {})
        for slot, (node, _) in enumerate(members):
            element = graph.call_function(operator.getitem, (fetch, slot))
            element.meta.update({key: value for key, value in node.meta.items()
                                 if key in ("val", "fxmem_val", "tensor_meta")})
            node.replace_all_uses_with(element)
            graph.erase_node(node)
    return Change("offload", block, [node.target for node, _ in members], [fetch.name],
                  f"frozen weights streamed from {tier}", sum(_nbytes(param) for _, param in members),
                  {"kind": "weights"})


def _remove_attr(root: torch.nn.Module, target: str) -> None:
    """Delete a parameter from the module tree, copying the modules on its path first (copy-on-write), so the
    program this one was snapshotted from keeps its parameter."""
    prefix, _, leaf = target.rpartition(".")
    del private_owner(root, prefix)._parameters[leaf]


def _weight_blocks(names: list[str], size: dict[str, int]) -> dict[str, str]:
    """Block of each parameter: the longest prefix of its name ending in a numbered module (`h.3`,
    `teacher.convs.1`), else its top-level module (`wte`)."""
    out = {}
    for name in names:
        parts = name.split(".")[:-1]
        idx = [i for i, s in enumerate(parts) if s.isdigit()]
        out[name] = ".".join(parts[:idx[-1] + 1]) if idx else (parts[0] if parts else name)
    del size
    return out
