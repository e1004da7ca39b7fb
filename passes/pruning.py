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


def validate(o: PruningOptions) -> None:
    if not (0.0 <= o.fraction < 1.0):
        raise PolicyError(f"passes.pruning.fraction: must be in [0, 1), got {o.fraction}")
    if o.threshold is not None and not (0.0 <= o.threshold <= 1.0):
        raise PolicyError(f"passes.pruning.threshold: a firing frequency in [0, 1], got {o.threshold}")
    if o.min_keep < 0:
        raise PolicyError(f"passes.pruning.min_keep: must be >= 0, got {o.min_keep}")
    if not (0.0 < o.backoff < 1.0):
        raise PolicyError(f"passes.pruning.backoff: must be in (0, 1), got {o.backoff}")
    if not (0.0 <= o.holdout < 1.0):
        raise PolicyError(f"passes.pruning.holdout: must be in [0, 1), got {o.holdout}")
    if o.max_batches < 1:
        raise PolicyError(f"passes.pruning.max_batches: must be >= 1, got {o.max_batches}")
    if o.heads:
        raise PolicyError("passes.pruning.heads: attention-head pruning is not implemented in this version; "
                          "set heads: false (heads stay coupled through the head reshape and are left alone)")
    if o.score not in ("fluctuation", "magnitude", "frequency"):
        raise PolicyError(f"passes.pruning.score: one of fluctuation, magnitude, frequency; got {o.score!r}")


# ============================================================================================ helpers

def group_paths(gm: fx.GraphModule, g: Group) -> list[str]:
    nodes = {n.name: n for n in gm.graph.nodes}
    out = [g.name]
    for x in list(g.producers) + list(g.consumers):
        n = nodes.get(x.node)
        if n is not None:
            out.append(module_path(n))
    return [p for p in dict.fromkeys(out) if p]


def skipped_by(paths: list[str], patterns) -> str | None:
    for pat in patterns or ():
        for p in paths:
            if fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat + ".*"):
                return pat
    return None


def unit_scores(gm: fx.GraphModule, g: Group, stats, score: str) -> torch.Tensor:
    total = torch.zeros(g.size, dtype=torch.float64)
    for c in g.consumers:
        st = stats.by_node[c.probe]
        if score == "frequency":
            total += st.freq
            continue
        w = attr_of(gm, c.weight).detach().to(torch.float64).movedim(c.wdim, 0).reshape(g.size, -1)
        col = w.norm(dim=1)
        total += st.var * col * col if score == "fluctuation" else st.mean_abs * col
    return total


def n_to_prune(g: Group, o: PruningOptions, stats) -> int:
    C = g.size
    keep_min = int(math.ceil(o.min_keep * C)) if o.min_keep < 1 else int(o.min_keep)
    keep_min = max(1, min(C, keep_min))
    if o.threshold is not None:
        freq = torch.stack([stats.by_node[c.probe].freq for c in g.consumers]).max(0).values
        k = int((freq < o.threshold).sum())
    else:
        k = int(math.floor(o.fraction * C))
    return max(0, min(k, C - keep_min))


def compensable(g: Group) -> bool:
    return all(c.kind == "linear" and c.bias is not None for c in g.consumers)


class _Masked(fx.Interpreter):
    """Runs the graph with the pruned units of each group replaced at their consumers' inputs (by their
    calibration mean when compensated, else 0): numerically what the sliced graph computes."""

    def __init__(self, gm, masks: dict):
        super().__init__(gm)
        self.masks = masks  # probe node -> (channel dim, pruned idx, fill values)

    def run_node(self, n):
        out = super().run_node(n)
        m = self.masks.get(n.name)
        if m is not None:
            d, idx, fill = m
            out = out.clone()
            shape = [1] * out.dim()
            shape[d] = idx.numel()
            out.index_copy_(d, idx, fill.to(out.dtype).reshape(shape).expand(
                *[s if i != d else idx.numel() for i, s in enumerate(out.shape)]).contiguous())
        return out


def _run(program: Program, item, masks=None):
    args, kwargs = normalize_item(item)
    gm = program.module
    was = gm.training
    gm.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            if masks is None:
                return gm(*args, **kwargs)
            flat = program.flat_inputs(args, kwargs)
            outs = _Masked(gm, masks).run(*flat, enable_io_processing=False)
            return outs
    finally:
        gm.train(was)


def _flat_out(x):
    from torch.utils import _pytree as pytree
    return pytree.tree_leaves(x)


def guard_deviation(program, items, refs, masks) -> float:
    worst = 0.0
    for item, ref in zip(items, refs):
        got = _run(program, item, masks) if masks else _run(program, item)
        worst = max(worst, deviation(_flat_out(ref), _flat_out(got)).rel)
    return worst


def _param_count(gm, targets) -> int:
    n = 0
    for t in dict.fromkeys(targets):
        try:
            x = attr_of(gm, t)
        except AttributeError:
            continue
        n += x.numel()
    return n


def _group_targets(g: Group) -> list[str]:
    ts = []
    for p in g.producers:
        ts += [p.weight] + ([p.bias] if p.bias else [])
    for c in g.consumers:
        ts.append(c.weight)
    ts += [t for t, _ in g.params]
    return ts


# ============================================================================================ the pass

@register
class PruningPass(Pass):
    name = "pruning"
    exact = False
    Options = PruningOptions

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        o: PruningOptions = ctx.options
        validate(o)
        notes: list[str] = []
        items = _calibration_items(program, ctx, o, notes)
        if items is None:
            return PassResult(program, False, notes=notes)
        n_hold = 0 if len(items) < 2 else max(1, int(round(len(items) * o.holdout)))
        stat_items, hold_items = (items[:-n_hold], items[-n_hold:]) if n_hold else (items, items)
        if not n_hold:
            notes.append("only one calibration item: the guard measures on the same item the statistics came from")
        stats = calibrate(program, stat_items, max_batches=None, eps=o.eps, progress=sys.stderr.isatty())
        metrics: dict = {"histograms": stats.histograms(), "calibration": stats.summary(),
                         "calibration_items": len(stat_items), "holdout_items": len(hold_items)}
        plan, counts = _plan(program.module, o, stats, metrics)
        if not plan or not any(counts.values()):
            return PassResult(program, False, notes=notes, metrics=metrics, intents=[_nothing(o, plan, notes)])
        hold = [normalize_item(it) for it in hold_items]
        guard = guard_for(ctx, program, "pruning", section="passes.pruning", tolerance=o.tolerance,
                          metric_tolerance=o.metric_tolerance, items=hold,
                          data=f"{len(hold)} held-out calibration item(s)") if o.guard else None

        def build(cnt):
            cand = program.snapshot()
            changes = self._slice(cand, plan, cnt, stats, o)
            cand.refresh()
            return cand, changes
        backoff_log: list = []
        outcome = first_accepted(guard, build, _backoff(program, plan, counts, stats, o, hold, backoff_log),
                                 "pruning")
        metrics["backoff"] = backoff_log
        metrics["guard_asked"] = [outcome.asked.to_dict()] if outcome.asked is not None else []
        if outcome.program is None:
            notes.append(f"the guard accepted no pruning after {outcome.tries} candidate(s): nothing pruned")
            return PassResult(program, False, notes=notes, metrics=metrics,
                              intents=[_intent(o, plan, counts, outcome, None)])
        _metric_record(outcome.verdict, metrics)
        self._costs(program, outcome.program, outcome.payload, metrics)
        return PassResult(outcome.program, True, changes=outcome.payload, notes=notes, metrics=metrics,
                          intents=[_intent(o, plan, counts, outcome, metrics["params_removed_share"])],
                          verdicts=[outcome.verdict])

    # --------------------------------------------------------------------------------------------
    def _slice(self, cand: Program, plan, counts, stats, o) -> list[Change]:
        gm = cand.module
        changes = []
        for name, (g, order) in plan.items():
            k = counts.get(name, 0)
            if k <= 0:
                continue
            pruned = order[:k].sort().values
            keep = order[k:].sort().values
            delta = {}
            if o.compensate and compensable(g):
                for c in g.consumers:
                    st = stats.by_node[c.probe]
                    w = attr_of(gm, c.weight).detach()
                    delta[c.node] = (w[:, pruned].to(torch.float64) @ st.mean[pruned]).to(w.dtype)
            before = _param_count(gm, _group_targets(g))
            shapes = slice_group(gm, g, keep, delta)
            after = _param_count(gm, _group_targets(g))
            freq = torch.stack([stats.by_node[c.probe].freq for c in g.consumers]).max(0).values
            changes.append(Change(
                kind="prune", module=name, nodes_before=[p.node for p in g.producers] + [c.node for c in g.consumers],
                nodes_after=[p.node for p in g.producers] + [c.node for c in g.consumers],
                reason=(f"{g.kind} group: removed {k} of {g.size} units (lowest {o.score} score; their firing "
                        f"frequency {float(freq[pruned].mean()):.2f} vs {float(freq[keep].mean()):.2f} kept)"
                        + ("; means folded into the consumer bias" if delta else "")),
                bytes_saved=None,
                details={"units_before": g.size, "units_after": int(keep.numel()), "params_removed": before - after,
                         "shapes": {t: [list(a), list(b)] for t, (a, b) in shapes.items()},
                         "compensated": bool(delta)}))
        return changes

    def _costs(self, before: Program, after: Program, changes: list, metrics: dict) -> None:
        """Parameters and forward FLOPs (op table, at the example shapes) removed, per group and in total."""
        fb, fa = node_flops(before.module), node_flops(after.module)
        tot_p = tot_f = 0
        shared: dict[str, int] = {}
        for ch in changes:
            for n in set(ch.nodes_before):
                shared[n] = shared.get(n, 0) + 1
        for ch in changes:
            p = ch.details["params_removed"]
            tot_p += p
            ch.bytes_saved = p * 4
            # a node shared by two groups (consumer of one, producer of the next): its saving is split evenly
            f = sum((fb[n] - fa.get(n, 0)) / shared[n] for n in set(ch.nodes_before) if n in fb)
            ch.details["flops_removed"] = int(round(f))
            ch.reason += f"; {p:,} parameters and {int(round(f)):,} forward FLOPs (example inputs) removed"
            tot_f += f
        total_params = sum(p.numel() for p in before.module.parameters())
        metrics["params_removed"] = int(tot_p)
        metrics["params_removed_share"] = tot_p / max(total_params, 1)
        metrics["flops_removed"] = int(tot_f)
        metrics["flops_removed_share"] = tot_f / max(sum(fb.values()), 1)


def node_flops(gm: fx.GraphModule) -> dict[str, int]:
    """Forward FLOPs per call_function node from `fxmem.ops` and the nodes' example-shape metadata."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or "fxmem_val" not in n.meta:
            continue
        try:
            args = tuple(node_value(a, literals=True) if not isinstance(a, (list, tuple))
                         else type(a)(node_value(x, literals=True) for x in a)
                         for a in n.args)
            out[n.name] = int(optable.flops(n.target, args, n.meta["fxmem_val"]) or 0)
        except Exception:  # noqa: BLE001 - an op without a FLOP rule counts 0
            out[n.name] = 0
    return out


def _fix_dims(gm, masks: dict) -> dict:
    """Channel dims from calibration may be negative (-1 for linear inputs): make them absolute per node."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = {}
    for probe, (d, idx, fill) in masks.items():
        if d < 0:
            v = node_value(nodes[probe])
            d = v.dim() + d
        out[probe] = (d, idx, fill)
    return out


def _calibration_items(program: Program, ctx, o: PruningOptions, notes: list) -> list | None:
    """The calibration items used (at most `max_batches`), or None when the pass must not run without them."""
    cal = ctx.calibration
    if cal is None or len(list(cal)) == 0:
        if o.require_calibration:
            notes.append("pruning skipped: no calibration data (the model file has no calibration_data() and "
                         "transform(..., calibration=) was not given) and passes.pruning.require_calibration is true")
            return None
        cal = [(tuple(program.example_args), dict(program.example_kwargs))]
        notes.append("no calibration data: statistics and the guard use the example inputs "
                     "(require_calibration: false)")
    return list(cal)[:o.max_batches]


def _plan(gm: fx.GraphModule, o: PruningOptions, stats, metrics: dict) -> tuple[dict, dict]:
    """Per prunable group: (group, units by ascending score) and how many units the policy asks to remove."""
    group_rows = []
    plan: dict[str, tuple[Group, torch.Tensor]] = {}
    counts: dict[str, int] = {}
    for g in find_groups(gm):
        row = {"group": g.name, "kind": g.kind, "units": g.size, "ok": g.ok, "reason": g.reason}
        group_rows.append(row)
        if not g.ok:
            continue
        pat = skipped_by(group_paths(gm, g), o.skip)
        if pat is not None:
            row.update(ok=False, reason=f"skipped by passes.pruning.skip pattern {pat!r}")
            continue
        plan[g.name] = (g, torch.argsort(unit_scores(gm, g, stats, o.score), stable=True))
        counts[g.name] = n_to_prune(g, o, stats)
    metrics["groups"] = group_rows
    return plan, counts


def _masks(gm: fx.GraphModule, plan: dict, counts: dict, stats, o: PruningOptions) -> dict:
    """The consumers' inputs to replace (by their calibration mean when compensated, else 0) to simulate `counts`."""
    m = {}
    for name, (g, order) in plan.items():
        k = counts.get(name, 0)
        if k <= 0:
            continue
        idx = order[:k].sort().values
        for c in g.consumers:
            st = stats.by_node[c.probe]
            fill = st.mean[idx] if (o.compensate and compensable(g)) else torch.zeros(k, dtype=torch.float64)
            m[c.probe] = (st.channel_dim if st.channel_dim >= 0 else -1, idx, fill)
    return _fix_dims(gm, m)


def _backoff(program: Program, plan: dict, counts: dict, stats, o: PruningOptions, items: list, log: list):
    """The counts to try: as asked, then, while the guard refuses, the group whose pruning alone moves the outputs
    most (on the guard's items) keeps `1 - backoff` more of its units, at most `max_backoff_steps` times."""
    cnt, refs = dict(counts), None
    for step in range(o.max_backoff_steps + 1):
        if not any(cnt.values()):
            return
        yield dict(cnt)
        if step == o.max_backoff_steps:
            return
        live = [name for name, k in cnt.items() if k > 0]
        solo = {}
        if len(live) > 1:
            refs = refs if refs is not None else [_run(program, it) for it in items]
            solo = {name: guard_deviation(program, items, refs, _masks(program.module, plan, {name: cnt[name]},
                                                                        stats, o)) for name in live}
        worst = max(solo, key=solo.get) if solo else live[0]
        log.append({"group": worst, "from": cnt[worst], "to": int(cnt[worst] * o.backoff),
                    "solo_deviation": solo.get(worst)})
        cnt[worst] = int(cnt[worst] * o.backoff)


def _setting(o: PruningOptions) -> str:
    return "passes.pruning.threshold" if o.threshold is not None else "passes.pruning.fraction"


def _asked(o: PruningOptions, plan: dict, counts: dict) -> str:
    units = sum(g.size for g, _ in plan.values())
    planned = sum(counts.values())
    if o.threshold is not None:
        return f"the units firing below {o.threshold:g} ({planned} of {units} hidden units)"
    if not units:
        return f"{o.fraction:.0%} of the hidden units"
    wanted = sum(int(math.floor(o.fraction * g.size)) for g, _ in plan.values())
    return f"{o.fraction:.0%} of {units} hidden units" + (f" ({planned} after min_keep)" if planned < wanted else "")


def _nothing(o: PruningOptions, plan: dict, notes: list) -> Intent:
    """The intent when there is nothing to prune: no prunable group (a shortfall), no unit under the threshold or a
    fraction of no unit (done as asked), or every group held at `min_keep` (a shortfall)."""
    if not plan:
        why = "no prunable group (every hidden width is coupled to a residual, a concat, a head split or an output)"
        change = "nothing in the policy (the report's group table says where each width is coupled)"
    elif o.threshold is not None or not sum(int(math.floor(o.fraction * g.size)) for g, _ in plan.values()):
        why = change = ""  # no unit under the threshold, or a fraction that rounds to no unit: done as asked
    else:
        why = f"min_keep ({o.min_keep:g} units per group)"
        change = "lower passes.pruning.min_keep"
    notes.append("nothing to prune: " + ("no prunable dependency group" if not plan else
                                         "every group is at min_keep or has no unit under the threshold"))
    return Intent(_setting(o), _asked(o, plan, {}), "removed nothing", not why, why, change)


def _intent(o: PruningOptions, plan: dict, counts: dict, outcome, params_share: float | None) -> Intent:
    units = sum(g.size for g, _ in plan.values())
    removed = sum(outcome.state.values()) if outcome.program is not None else 0
    achieved = f"removed {removed / max(units, 1):.1%} ({removed} units" + (
        f", {params_share:.1%} of the parameters)" if params_share is not None else ")")
    stopped_by, change = guard_stop(outcome.asked)
    return Intent(_setting(o), _asked(o, plan, counts), achieved, removed >= sum(counts.values()), stopped_by, change)


def _metric_record(verdict, metrics: dict) -> None:
    """The guard's figures on what was kept, under the names the report shows."""
    if verdict is None or not verdict.judged:
        return
    m = verdict.measures
    metrics["guard_deviation"] = m.get("rel_error")
    if "top1_agreement" in m:
        metrics["top1_agreement"] = m["top1_agreement"]
    if "metric_drop" in m:
        metrics["metric"] = {"before": m["metric_before"], "after": m["metric_after"], "drop": m["metric_drop"],
                             "tolerance": verdict.limits.get("metric_drop")}
