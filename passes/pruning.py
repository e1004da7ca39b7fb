"""Structural pruning of cold hidden units, measured on real (calibration) data.

In order: dependency groups (`fxmem.depgroups.find_groups`; coupled groups are reported, not pruned), calibration
(`fxmem.calibrate`, the last `holdout` share held out), scores per unit (`fluctuation` (default), `magnitude` or
`frequency`) choosing `fraction` or `threshold` of each group's units (at least `min_keep` stay), mean compensation
folded into linear consumers' biases (`compensate`), the accuracy guard (`fxmem.lossguard`, kind `pruning`) with
back-off by the group that moves the held-out outputs most, and slicing (`fxmem.depgroups.slice_group`).

Lossy (`exact = False`): the PassManager rolls it back when the verdict it returns refuses.
Design: docs/design/pruning-gating.md, "The pruning pass".
"""
from __future__ import annotations

import fnmatch
import math
import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import fx

from fxmem import ops as optable
from fxmem.calibrate import calibrate, normalize_item
from fxmem.compare import deviation
from fxmem.depgroups import Group, attr_of, find_groups, slice_group
from fxmem.errors import PolicyError
from fxmem.intent import Intent, guard_stop
from fxmem.lossguard import first_accepted, guard_for
from fxmem.node_value import node_value
from fxmem.pass_api import Change, Pass, PassContext, PassResult, register
from fxmem.program import Program, module_path


@dataclass
class PruningOptions:
    """passes.pruning: how many cold units to remove per dependency group, and the accuracy guard."""
    fraction: float = 0.2  # share of each group's units removed (ignored when threshold is set)
    threshold: float | None = None  # remove units whose firing frequency is below this (0..1)
    min_keep: float = 8  # units kept per group at least: a count (>= 1) or a share of the group (< 1)
    skip: list[str] = field(default_factory=list)  # module path globs never pruned
    heads: bool = False  # attention heads: not implemented (rejected when true)
    require_calibration: bool = True  # without calibration data: do nothing (and say so)
    max_batches: int = 16  # calibration items used at most
    holdout: float = 0.25  # share of calibration items held out for the guard (at least 1 when >= 2 items)
    score: Literal["fluctuation", "magnitude", "frequency"] = "fluctuation"
    eps: float = 0.1  # a unit fires when |a| > eps * (layer's mean |a|)
    compensate: bool = True  # fold removed units' means into linear consumers' biases
    tolerance: float | None = None  # end-to-end relative output error; None = kind default / verify.lossy_tolerance
    metric_tolerance: float | None = None  # allowed drop of evaluate(module); None = verify.metric_tolerance
    guard: bool = True  # false: prune as asked, unjudged
    backoff: float = 0.5  # multiply a group's pruned count by this when over the tolerance
    max_backoff_steps: int = 32


def validate(options: PruningOptions) -> None:
    if not (0.0 <= options.fraction < 1.0):
        raise PolicyError(f"passes.pruning.fraction: must be in [0, 1), got {options.fraction}")
    if options.threshold is not None and not (0.0 <= options.threshold <= 1.0):
        raise PolicyError(f"passes.pruning.threshold: a firing frequency in [0, 1], got {options.threshold}")
    if options.min_keep < 0:
        raise PolicyError(f"passes.pruning.min_keep: must be >= 0, got {options.min_keep}")
    if not (0.0 < options.backoff < 1.0):
        raise PolicyError(f"passes.pruning.backoff: must be in (0, 1), got {options.backoff}")
    if not (0.0 <= options.holdout < 1.0):
        raise PolicyError(f"passes.pruning.holdout: must be in [0, 1), got {options.holdout}")
    if options.max_batches < 1:
        raise PolicyError(f"passes.pruning.max_batches: must be >= 1, got {options.max_batches}")
    if options.heads:
        raise PolicyError("passes.pruning.heads: attention-head pruning is not implemented in this version; "
                          "set heads: false (heads stay coupled through the head reshape and are left alone)")
    if options.score not in ("fluctuation", "magnitude", "frequency"):
        raise PolicyError(f"passes.pruning.score: one of fluctuation, magnitude, frequency; got {options.score!r}")


# ============================================================================================ helpers

def group_paths(graph_module: fx.GraphModule, group: Group) -> list[str]:
    nodes = {node.name: node for node in graph_module.graph.nodes}
    out = [group.name]
    for record in list(group.producers) + list(group.consumers):
        node = nodes.get(record.node)
        if node is not None:
            out.append(module_path(node))
    return [p for p in dict.fromkeys(out) if p]


def skipped_by(paths: list[str], patterns) -> str | None:
    for pattern in patterns or ():
        for path in paths:
            if fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + ".*"):
                return pattern
    return None


def unit_scores(graph_module: fx.GraphModule, group: Group, stats, score: str) -> torch.Tensor:
    total = torch.zeros(group.size, dtype=torch.float64)
    for consumer in group.consumers:
        probe_stats = stats.by_node[consumer.probe]
        if score == "frequency":
            total += probe_stats.freq
            continue
        weight = attr_of(graph_module, consumer.weight).detach().to(torch.float64)
        weight = weight.movedim(consumer.wdim, 0).reshape(group.size, -1)
        col = weight.norm(dim=1)
        total += probe_stats.var * col * col if score == "fluctuation" else probe_stats.mean_abs * col
    return total


def n_to_prune(group: Group, options: PruningOptions, stats) -> int:
    units = group.size
    keep_min = int(math.ceil(options.min_keep * units)) if options.min_keep < 1 else int(options.min_keep)
    keep_min = max(1, min(units, keep_min))
    if options.threshold is not None:
        freq = torch.stack([stats.by_node[c.probe].freq for c in group.consumers]).max(0).values
        count = int((freq < options.threshold).sum())
    else:
        count = int(math.floor(options.fraction * units))
    return max(0, min(count, units - keep_min))


def compensable(group: Group) -> bool:
    return all(c.kind == "linear" and c.bias is not None for c in group.consumers)


class _Masked(fx.Interpreter):
    """Runs the graph with the pruned units of each group replaced at their consumers' inputs (by their
    calibration mean when compensated, else 0): numerically what the sliced graph computes."""

    def __init__(self, graph_module, masks: dict):
        super().__init__(graph_module)
        self.masks = masks  # probe node -> (channel dim, pruned idx, fill values)

    def run_node(self, node):
        out = super().run_node(node)
        mask = self.masks.get(node.name)
        if mask is not None:
            dim, idx, fill = mask
            out = out.clone()
            shape = [1] * out.dim()
            shape[dim] = idx.numel()
            out.index_copy_(dim, idx, fill.to(out.dtype).reshape(shape).expand(
                *[s if i != dim else idx.numel() for i, s in enumerate(out.shape)]).contiguous())
        return out


def _run(program: Program, item, masks=None):
    args, kwargs = normalize_item(item)
    module = program.module
    was = module.training
    module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            if masks is None:
                return module(*args, **kwargs)
            flat = program.flat_inputs(args, kwargs)
            outs = _Masked(module, masks).run(*flat, enable_io_processing=False)
            return outs
    finally:
        module.train(was)


def _flat_out(output):
    from torch.utils import _pytree as pytree
    return pytree.tree_leaves(output)


def guard_deviation(program, items, refs, masks) -> float:
    worst = 0.0
    for item, ref in zip(items, refs):
        got = _run(program, item, masks) if masks else _run(program, item)
        worst = max(worst, deviation(_flat_out(ref), _flat_out(got)).rel)
    return worst


def _param_count(graph_module, targets) -> int:
    count = 0
    for target in dict.fromkeys(targets):
        try:
            tensor = attr_of(graph_module, target)
        except AttributeError:
            continue
        count += tensor.numel()
    return count


def _group_targets(group: Group) -> list[str]:
    targets = []
    for producer in group.producers:
        targets += [producer.weight] + ([producer.bias] if producer.bias else [])
    for consumer in group.consumers:
        targets.append(consumer.weight)
    targets += [t for t, _ in group.params]
    return targets


# ============================================================================================ the pass

@register
class PruningPass(Pass):
    name = "pruning"
    exact = False
    Options = PruningOptions

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        options: PruningOptions = ctx.options
        validate(options)
        notes: list[str] = []
        items = _calibration_items(program, ctx, options, notes)
        if items is None:
            return PassResult(program, False, notes=notes)
        n_hold = 0 if len(items) < 2 else max(1, int(round(len(items) * options.holdout)))
        stat_items, hold_items = (items[:-n_hold], items[-n_hold:]) if n_hold else (items, items)
        if not n_hold:
            notes.append("only one calibration item: the guard measures on the same item the statistics came from")
        stats = calibrate(program, stat_items, max_batches=None, eps=options.eps, progress=sys.stderr.isatty())
        metrics: dict = {"histograms": stats.histograms(), "calibration": stats.summary(),
                         "calibration_items": len(stat_items), "holdout_items": len(hold_items)}
        plan, counts = _plan(program.module, options, stats, metrics)
        if not plan or not any(counts.values()):
            return PassResult(program, False, notes=notes, metrics=metrics, intents=[_nothing(options, plan, notes)])
        hold = [normalize_item(it) for it in hold_items]
        guard = guard_for(ctx, program, "pruning", section="passes.pruning", tolerance=options.tolerance,
                          metric_tolerance=options.metric_tolerance, items=hold,
                          data=f"{len(hold)} held-out calibration item(s)") if options.guard else None

        def build(cnt):
            cand = program.snapshot()
            changes = self._slice(cand, plan, cnt, stats, options)
            cand.refresh()
            return cand, changes
        backoff_log: list = []
        outcome = first_accepted(guard, build, _backoff(program, plan, counts, stats, options, hold, backoff_log),
                                 "pruning")
        metrics["backoff"] = backoff_log
        metrics["guard_asked"] = [outcome.asked.to_dict()] if outcome.asked is not None else []
        if outcome.program is None:
            notes.append(f"the guard accepted no pruning after {outcome.tries} candidate(s): nothing pruned")
            return PassResult(program, False, notes=notes, metrics=metrics,
                              intents=[_intent(options, plan, counts, outcome, None)])
        _metric_record(outcome.verdict, metrics)
        self._costs(program, outcome.program, outcome.payload, metrics)
        return PassResult(outcome.program, True, changes=outcome.payload, notes=notes, metrics=metrics,
                          intents=[_intent(options, plan, counts, outcome, metrics["params_removed_share"])],
                          verdicts=[outcome.verdict])

    # --------------------------------------------------------------------------------------------
    def _slice(self, cand: Program, plan, counts, stats, options) -> list[Change]:
        graph_module = cand.module
        changes = []
        for name, (group, order) in plan.items():
            count = counts.get(name, 0)
            if count <= 0:
                continue
            pruned = order[:count].sort().values
            keep = order[count:].sort().values
            delta = {}
            if options.compensate and compensable(group):
                for consumer in group.consumers:
                    probe_stats = stats.by_node[consumer.probe]
                    weight = attr_of(graph_module, consumer.weight).detach()
                    folded = weight[:, pruned].to(torch.float64) @ probe_stats.mean[pruned]
                    delta[consumer.node] = folded.to(weight.dtype)
            before = _param_count(graph_module, _group_targets(group))
            shapes = slice_group(graph_module, group, keep, delta)
            after = _param_count(graph_module, _group_targets(group))
            freq = torch.stack([stats.by_node[consumer.probe].freq for consumer in group.consumers]).max(0).values
            group_nodes = [p.node for p in group.producers] + [c.node for c in group.consumers]
            changes.append(Change(
                kind="prune", module=name, nodes_before=group_nodes, nodes_after=list(group_nodes),
                reason=(f"{group.kind} group: removed {count} of {group.size} units (lowest {options.score} score; "
                        f"their firing frequency {float(freq[pruned].mean()):.2f} vs {float(freq[keep].mean()):.2f} "
                        f"kept)" + ("; means folded into the consumer bias" if delta else "")),
                bytes_saved=None,
                details={"units_before": group.size, "units_after": int(keep.numel()), "params_removed": before - after,
                         "shapes": {t: [list(a), list(b)] for t, (a, b) in shapes.items()},
                         "compensated": bool(delta)}))
        return changes

    def _costs(self, before: Program, after: Program, changes: list, metrics: dict) -> None:
        """Parameters and forward FLOPs (op table, at the example shapes) removed, per group and in total."""
        flops_before, flops_after = node_flops(before.module), node_flops(after.module)
        tot_p = tot_f = 0
        shared: dict[str, int] = {}
        for change in changes:
            for node_name in set(change.nodes_before):
                shared[node_name] = shared.get(node_name, 0) + 1
        for change in changes:
            params = change.details["params_removed"]
            tot_p += params
            change.bytes_saved = params * 4
            # a node shared by two groups (consumer of one, producer of the next): its saving is split evenly
            flops = sum((flops_before[n] - flops_after.get(n, 0)) / shared[n] for n in set(change.nodes_before)
                        if n in flops_before)
            change.details["flops_removed"] = int(round(flops))
            change.reason += f"; {params:,} parameters and {int(round(flops)):,} forward FLOPs (example inputs) removed"
            tot_f += flops
        total_params = sum(param.numel() for param in before.module.parameters())
        metrics["params_removed"] = int(tot_p)
        metrics["params_removed_share"] = tot_p / max(total_params, 1)
        metrics["flops_removed"] = int(tot_f)
        metrics["flops_removed_share"] = tot_f / max(sum(flops_before.values()), 1)


def node_flops(graph_module: fx.GraphModule) -> dict[str, int]:
    """Forward FLOPs per call_function node from `fxmem.ops` and the nodes' example-shape metadata."""
    out = {}
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or "fxmem_val" not in node.meta:
            continue
        try:
            args = tuple(node_value(a, literals=True) if not isinstance(a, (list, tuple))
                         else type(a)(node_value(x, literals=True) for x in a)
                         for a in node.args)
            out[node.name] = int(optable.flops(node.target, args, node.meta["fxmem_val"]) or 0)
        except Exception:  # noqa: BLE001 - an op without a FLOP rule counts 0
            out[node.name] = 0
    return out


def _fix_dims(graph_module, masks: dict) -> dict:
    """Channel dims from calibration may be negative (-1 for linear inputs): make them absolute per node."""
    nodes = {n.name: n for n in graph_module.graph.nodes}
    out = {}
    for probe, (dim, idx, fill) in masks.items():
        if dim < 0:
            value = node_value(nodes[probe])
            dim = value.dim() + dim
        out[probe] = (dim, idx, fill)
    return out


def _calibration_items(program: Program, ctx, options: PruningOptions, notes: list) -> list | None:
    """The calibration items used (at most `max_batches`), or None when the pass must not run without them."""
    cal = ctx.calibration
    if cal is None or len(list(cal)) == 0:
        if options.require_calibration:
            notes.append("pruning skipped: no calibration data (the model file has no calibration_data() and "
                         "transform(..., calibration=) was not given) and passes.pruning.require_calibration is true")
            return None
        cal = [(tuple(program.example_args), dict(program.example_kwargs))]
        notes.append("no calibration data: statistics and the guard use the example inputs "
                     "(require_calibration: false)")
    return list(cal)[:options.max_batches]


def _plan(graph_module: fx.GraphModule, options: PruningOptions, stats, metrics: dict) -> tuple[dict, dict]:
    """Per prunable group: (group, units by ascending score) and how many units the policy asks to remove."""
    group_rows = []
    plan: dict[str, tuple[Group, torch.Tensor]] = {}
    counts: dict[str, int] = {}
    for group in find_groups(graph_module):
        row = {"group": group.name, "kind": group.kind, "units": group.size, "ok": group.ok, "reason": group.reason}
        group_rows.append(row)
        if not group.ok:
            continue
        pattern = skipped_by(group_paths(graph_module, group), options.skip)
        if pattern is not None:
            row.update(ok=False, reason=f"skipped by passes.pruning.skip pattern {pattern!r}")
            continue
        plan[group.name] = (group, torch.argsort(unit_scores(graph_module, group, stats, options.score), stable=True))
        counts[group.name] = n_to_prune(group, options, stats)
    metrics["groups"] = group_rows
    return plan, counts


def _masks(graph_module: fx.GraphModule, plan: dict, counts: dict, stats, options: PruningOptions) -> dict:
    """The consumers' inputs to replace (by their calibration mean when compensated, else 0) to simulate `counts`."""
    masks = {}
    for name, (group, order) in plan.items():
        count = counts.get(name, 0)
        if count <= 0:
            continue
        idx = order[:count].sort().values
        for consumer in group.consumers:
            probe_stats = stats.by_node[consumer.probe]
            compensated = options.compensate and compensable(group)
            fill = probe_stats.mean[idx] if compensated else torch.zeros(count, dtype=torch.float64)
            masks[consumer.probe] = (probe_stats.channel_dim if probe_stats.channel_dim >= 0 else -1, idx, fill)
    return _fix_dims(graph_module, masks)


def _backoff(program: Program, plan: dict, counts: dict, stats, options: PruningOptions, items: list, log: list):
    """The counts to try: as asked, then, while the guard refuses, the group whose pruning alone moves the outputs
    most (on the guard's items) keeps `1 - backoff` more of its units, at most `max_backoff_steps` times."""
    cnt, refs = dict(counts), None
    for step in range(options.max_backoff_steps + 1):
        if not any(cnt.values()):
            return
        yield dict(cnt)
        if step == options.max_backoff_steps:
            return
        live = [name for name, k in cnt.items() if k > 0]
        solo = {}
        if len(live) > 1:
            refs = refs if refs is not None else [_run(program, it) for it in items]
            solo = {name: guard_deviation(program, items, refs, _masks(program.module, plan, {name: cnt[name]},
                                                                        stats, options)) for name in live}
        worst = max(solo, key=solo.get) if solo else live[0]
        log.append({"group": worst, "from": cnt[worst], "to": int(cnt[worst] * options.backoff),
                    "solo_deviation": solo.get(worst)})
        cnt[worst] = int(cnt[worst] * options.backoff)


def _setting(options: PruningOptions) -> str:
    return "passes.pruning.threshold" if options.threshold is not None else "passes.pruning.fraction"


def _asked(options: PruningOptions, plan: dict, counts: dict) -> str:
    units = sum(g.size for g, _ in plan.values())
    planned = sum(counts.values())
    if options.threshold is not None:
        return f"the units firing below {options.threshold:g} ({planned} of {units} hidden units)"
    if not units:
        return f"{options.fraction:.0%} of the hidden units"
    wanted = sum(int(math.floor(options.fraction * g.size)) for g, _ in plan.values())
    return f"{options.fraction:.0%} of {units} hidden units" + (f" ({planned} after min_keep)" if planned < wanted
                                                                 else "")


def _nothing(options: PruningOptions, plan: dict, notes: list) -> Intent:
    """The intent when there is nothing to prune: no prunable group (a shortfall), no unit under the threshold or a
    fraction of no unit (done as asked), or every group held at `min_keep` (a shortfall)."""
    if not plan:
        why = "no prunable group (every hidden width is coupled to a residual, a concat, a head split or an output)"
        change = "nothing in the policy (the report's group table says where each width is coupled)"
    elif options.threshold is not None or not sum(int(math.floor(options.fraction * g.size)) for g, _ in plan.values()):
        why = change = ""  # no unit under the threshold, or a fraction that rounds to no unit: done as asked
    else:
        why = f"min_keep ({options.min_keep:g} units per group)"
        change = "lower passes.pruning.min_keep"
    notes.append("nothing to prune: " + ("no prunable dependency group" if not plan else
                                         "every group is at min_keep or has no unit under the threshold"))
    return Intent(_setting(options), _asked(options, plan, {}), "removed nothing", not why, why, change)


def _intent(options: PruningOptions, plan: dict, counts: dict, outcome, params_share: float | None) -> Intent:
    units = sum(g.size for g, _ in plan.values())
    removed = sum(outcome.state.values()) if outcome.program is not None else 0
    achieved = f"removed {removed / max(units, 1):.1%} ({removed} units" + (
        f", {params_share:.1%} of the parameters)" if params_share is not None else ")")
    stopped_by, change = guard_stop(outcome.asked)
    return Intent(_setting(options), _asked(options, plan, counts), achieved, removed >= sum(counts.values()),
                  stopped_by, change)


def _metric_record(verdict, metrics: dict) -> None:
    """The guard's figures on what was kept, under the names the report shows."""
    if verdict is None or not verdict.judged:
        return
    measures = verdict.measures
    metrics["guard_deviation"] = measures.get("rel_error")
    if "top1_agreement" in measures:
        metrics["top1_agreement"] = measures["top1_agreement"]
    if "metric_drop" in measures:
        metrics["metric"] = {"before": measures["metric_before"], "after": measures["metric_after"],
                             "drop": measures["metric_drop"],
                             "tolerance": verdict.limits.get("metric_drop")}
