"""The compute stage: bf16 / fp16 compute (and bf16 parameters) planned, applied and judged on the whole model; the
sites whose own error is largest run in fp32 first until the guard accepts."""
from __future__ import annotations

import torch
from torch import nn

from fxmem.intent import Intent, guard_stop
from fxmem.lossguard import exclusion_steps, first_accepted
from fxmem.pass_api import Change, PassContext
from fxmem.program import Program

from .casts import apply_plan, simplify_casts
from .measure import record_values, site_error_compute
from .nodes import node_args, node_by_name
from .options import DTYPE_NAMES, PrecisionOptions
from .params import replace_params
from .plan import ACC, FP32, LOW, Decision, plan
from .stage import SITE_ITEMS, StageLog, back_off_why, by_error, stage_guard


def compute_stage(program: Program, ctx: PassContext, opts: PrecisionOptions, low: torch.dtype, log: StageLog,
                  metrics: dict) -> Program:
    """bf16 / fp16 compute (and bf16 parameters): the plan is applied whole and judged on the whole model; the sites
    whose own error is largest run in fp32 first until the guard accepts. Sites that cannot run in the low dtype
    always stay fp32. Returns the program kept."""
    guard = stage_guard(ctx, program, opts, "compute")
    errors, incapable = _compute_site_errors(program, opts, low, guard, ctx.seed, log)
    recast = opts.recast_params and opts.params == "fp32" and ctx.mode == "train"

    def build(excluded):
        cand = program.snapshot()
        changes = []
        if opts.params == "bf16":
            names = replace_params(cand.module, lambda p: nn.Parameter(p.detach().to(torch.bfloat16),
                                                                        requires_grad=p.requires_grad))
            changes.append(Change("precision.params", "", [], [], f"{len(names)} parameters stored in bf16; use "
                                  "fxmem.make_optimizer for fp32 master weights and fp32 optimizer state", None,
                                  {"params": names}))
        decisions = plan(cand.module, opts, low, set(excluded) | incapable)
        stats = apply_plan(cand.module, decisions, opts, low, recast=recast)
        cand.refresh()
        stats["casts_removed"] = simplify_casts(cand.module)
        return cand, (decisions, stats, changes)
    outcome = first_accepted(guard, build, exclusion_steps(by_error(errors)), "compute")
    log.record(outcome)
    site_count = len(errors) + len(incapable)
    excluded = set(outcome.state) if outcome.program is not None else set(errors)
    for row in log.sites:
        if row["decision"].startswith(("low:", "acc:")):
            row["reverted"] = row["site"] in excluded | incapable
    stopped_by, change = guard_stop(outcome.asked)
    if incapable and not stopped_by:
        stopped_by, change = f"{len(incapable)} op(s) without a {DTYPE_NAMES[low]} kernel here", "nothing to change"
    done = site_count - len(excluded) - len(incapable)
    log.intents.append(Intent("passes.precision.compute", f"{opts.compute} compute at {site_count} site(s)",
                              f"{opts.compute} at {done} of {site_count}", done == site_count, stopped_by, change))
    _record_reverts(log, errors, incapable, excluded, back_off_why(outcome, DTYPE_NAMES[low]), low)
    if outcome.program is None:
        return program
    decisions, stats, changes = outcome.payload
    log.changes.extend(changes)
    metrics.update(stats)
    _record_compute(log, metrics, decisions, low)
    return outcome.program


def _compute_site_errors(program: Program, opts, low, guard, seed: int, log: StageLog) -> tuple[dict, set]:
    """Each LOW/ACC site's own relative error in the low dtype (ordering; an overflow is an infinite error); the
    sites whose op raises in it (no kernel for the dtype here)."""
    decisions = {name: d for name, d in plan(program.module, opts, low).items() if d.cls in (LOW, ACC)}
    errors, incapable = {}, set()
    values = []
    if guard is not None and decisions:
        keep = set()
        for decision in decisions.values():
            node = node_by_name(program.module, decision.node)
            keep.add(node.name)
            keep.update(a.name for a in node_args(node))
        values = record_values(program.module, guard.items[:SITE_ITEMS], keep)
    for decision in decisions.values():
        rel = float("nan")
        if values:
            try:
                rel = site_error_compute(node_by_name(program.module, decision.node), values, low, seed)[1]
            except Exception as error:  # noqa: BLE001 - an op that cannot run in the low dtype stays fp32
                incapable.add(decision.node)
                decision.reason += f" (could not run in {DTYPE_NAMES[low]}: {type(error).__name__})"
        if decision.node not in incapable:
            errors[decision.node] = rel
        log.sites.append({"site": decision.node, "module": decision.module, "op": decision.op,
                          "decision": f"{decision.cls}:{DTYPE_NAMES[low]}", "rel": rel, "reverted": False})
    return errors, incapable


def _record_reverts(log: StageLog, errors: dict, incapable: set, excluded: set, why: str, low) -> None:
    rows = {r["site"]: r for r in log.sites}
    for name in sorted(incapable) + [n for n in by_error(errors) if n in excluded]:
        row = rows[name]
        reason = f"it cannot run in {DTYPE_NAMES[low]} here" if name in incapable else \
            f"{why} (its own relative error {row['rel']:.3g})"
        log.changes.append(Change("precision.reverted", row["module"], [name], [name], f"{row['op']} runs in fp32: "
                                  f"{reason}", 0, {"rel": row["rel"], "decision": row["decision"]}))


def _record_compute(log: StageLog, metrics: dict, decisions: dict, low) -> None:
    """Per-module Changes of the applied plan and its counters."""
    by_cls: dict[str, int] = {}
    for decision in decisions.values():
        by_cls[decision.cls] = by_cls.get(decision.cls, 0) + 1
    metrics["decisions"] = by_cls
    metrics["fp32_islands"] = sorted(d.node for d in decisions.values() if d.cls == FP32)
    groups: dict[str, list[Decision]] = {}
    for decision in decisions.values():
        if decision.cls in (LOW, ACC, FP32):
            groups.setdefault(decision.module, []).append(decision)
    for mod_path, members in groups.items():
        lowd = [d.node for d in members if d.cls == LOW]
        accd = [d.node for d in members if d.cls == ACC]
        f32 = [d.node for d in members if d.cls == FP32]
        reason = "; ".join(x for x in (
            f"{len(lowd)} matmul-class op(s) in {DTYPE_NAMES[low]}" if lowd else "",
            f"{len(accd)} op(s) in {DTYPE_NAMES[low]} with fp32 accumulation in the kernel" if accd else "",
            "fp32 island(s): " + ", ".join(sorted({d.op + ' (' + d.reason + ')' for d in members
                                                   if d.cls == FP32})) if f32 else "") if x)
        log.changes.append(Change("precision.compute", mod_path, [d.node for d in members], [d.node for d in members],
                                  reason, None, {"low": lowd, "acc": accd, "fp32": f32}))
