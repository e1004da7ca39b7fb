"""Checkpoint pass: land the training step under a memory budget with the least extra compute.

The steps, each on a copy of the program: `compact_dropout` (CPU dropout masks drawn as bool), `remat` (cheap
activations recomputed where backward needs them, as many as the limits need), then recompute regions: candidate
sets (`candidates`), a plan per set from the memory model (`solvers`), the cheapest emitted (`emit`) and verified
with the cost model's estimate, re-planned against tighter targets while the estimate misses (`reach`). With remat,
regions are planned on the rewritten program and on the program without remat, and remat with matrix products as
sites is weighed too (alone where it fits, else under regions); the cheapest reachable plan wins.
Options: `options.CheckpointOptions`. Design: docs/design/checkpoint.md.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from functools import partial
from typing import Callable, NamedTuple

from fxmem.costmodel import default_balance, estimate_from_trace, op_cost, program_key, trace_forward
from fxmem.errors import BudgetError
from fxmem.outline import region_boundary
from fxmem.pass_api import Change, Pass, PassContext, PassResult, register
from fxmem.program import Program
from fxmem.units import format_bytes

from .candidates import (CandidateSet, RegionMeter, candidate_regions, glue_regions, is_chain, is_region_node,
                         module_paths, profile_nodes)
from .compact_dropout import compact_dropout
from .emit import emit_regions
from fxmem.matmul_operands import materialize_matmul_operands
from .compiled_fit import CompiledGoal, fit_compiled, planner
from .options import (CheckpointOptions, Limits, compiled_budget, compiler_budgets, resolve_activation_budget,
                      resolve_budget)
from .reach import Reach, reach, refine_targets
from .remat import (RematSite, apply_remat, as_planned, choose_sites, product_site, remat_plan, remat_sites,
                    softmax_site)
from .results import Attempt, Variant, regions_result
from .solvers import CHOICES, Solution, lowest, solve, solve_dp, tie_break, with_need

# what tests and benchmarks reach through the package besides the pass
__all__ = ["BEST_EFFORT_MARGIN", "CHOICES", "CandidateSet", "CheckpointOptions", "CheckpointPass", "CheckpointRun",
           "Limits", "PlanOption", "RematSite", "Solution", "apply_remat", "candidate_regions", "compact_dropout",
           "default_balance", "glue_regions", "is_chain", "is_region_node", "lowest", "op_cost", "profile_nodes",
           "region_boundary", "remat_plan", "remat_sites", "solve", "solve_dp", "tie_break"]

# Two best-effort plans (remat + regions, regions alone) at limits neither reaches: the one planned lowest is
# emitted and verified; the other only if it was planned less than this fraction above the first's estimate (the
# memory model's lowest plans sit close to their estimates, docs/design/checkpoint.md), so a plan planned further
# above cannot come out lower, and its emission (a trace of the whole program) is saved.
BEST_EFFORT_MARGIN = 0.03


@register
class CheckpointPass(Pass):
    name = "checkpoint"
    exact = True
    Options = CheckpointOptions

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        opts: CheckpointOptions = ctx.options
        started = time.perf_counter()
        if ctx.mode != "train":
            return PassResult(program, False, notes=["checkpoint: inference mode saves nothing for backward; "
                                                     "nothing to do"])
        base = ctx.baseline if ctx.baseline is not None else ctx.estimate(program)
        compiled, settings = compiled_budget(opts), compiler_budgets(opts)
        if compiled is not None:  # planned at the eager activation budget whose compiled step fits it
            goal = CompiledGoal(compiled, settings, ctx.budget_strict, ctx.loss_fn)
            return fit_compiled(planner(self.run, program, replace(ctx, baseline=base)), program, base.activations,
                                goal)
        limits = Limits(resolve_budget(opts, ctx, base.peak), resolve_activation_budget(opts, base.activations))
        if limits.peak is None and limits.activations is None:
            return PassResult(program, False, notes=["checkpoint: no budget set (passes.checkpoint.budget, "
                                                     "passes.checkpoint.activation_budget, "
                                                     "passes.checkpoint.compiled_activation_budget or the policy's "
                                                     "budget); nothing to do"])
        if opts.within_blocks is None:
            opts = replace(opts, within_blocks=ctx.distribution == "fsdp")
        job = CheckpointRun(opts, ctx, limits, started)
        variant = job.baseline(program)
        if limits.fits(variant.estimate):
            return variant.result(limits.fits_note(variant.estimate))
        # over the limits: first the free, exact saving (bool dropout masks), then recomputation for the rest
        variant = job.compact_dropout(variant)
        if limits.fits(variant.estimate):
            return variant.result(limits.fits_note(variant.estimate))
        if opts.regions:
            candidate_regions(variant.program, {}, opts.regions)  # names every listed module not in the graph
        rematted = job.remat(variant) if opts.remat else None
        if rematted is None:
            return job.regions(variant, False)
        if limits.fits(rematted.estimate):
            return rematted.result(f"checkpoint: {rematted.metrics['remat']['sites']} cheap activations recomputed "
                                   f"in backward bring the estimate to peak {format_bytes(rematted.estimate.peak)}, "
                                   f"activations {format_bytes(rematted.estimate.activations)}, within "
                                   f"{limits.describe()}; no region recomputed")
        # regions for the rest, planned on the rewritten program and on the program without remat (recipes and
        # regions interact: a region input that is a recipe is recomputed too, and a region can make remat's
        # recomputation redundant); and with matrix products or softmaxes as sites too: remat alone where that fits,
        # else regions over it. The cheapest plan that fits wins
        options = [PlanOption(partial(job.regions, rematted), rematted.rewrite_cost),
                   PlanOption(partial(job.regions, variant), 0.0, "regions without remat")]
        # (and with attention softmaxes among them, recomputed with their scores, with products and without: apart,
        # since every site is applied before regions are planned, and an attention region would recompute those
        # chains again; without products where a model's linears are dear sites, Hugging Face GPT-2's Conv1D)
        no_softmax_site = False
        for products, scores in _site_variants(opts):
            if scores and not products and no_softmax_site:
                # (the plan with products took no softmax site: none exists, or the products, cheaper per byte,
                # covered the need first; without them the softmaxes would cover it at a higher cost per byte, a
                # plan the one with products alone dominates by the cost model; planned anyway, it lengthened the
                # transform by a third on the decoder at compile@0.5's bytes and lost)
                continue
            rematted_more = job.remat(variant, products=products, scores=scores)
            no_softmax_site = scores and rematted_more is None
            if rematted_more is not None and limits.fits(rematted_more.estimate):
                options.append(PlanOption(partial(_remat_alone, rematted_more, limits), rematted_more.rewrite_cost))
            elif rematted_more is not None:
                options.append(PlanOption(partial(job.regions, rematted_more), rematted_more.rewrite_cost,
                                          "regions over remat with " + _sites_named(products, scores)))
        return self._remat_or_not(options, limits)

    @staticmethod
    def _remat_or_not(options: list[PlanOption], limits: Limits) -> PassResult:
        """The cheapest of `options` (regions with remat, regions alone, and remat with matrix products as sites,
        alone or under regions). All are planned (`run(True)`: (cost, planned shortfall, reachable), no tracing);
        the cheapest reachable plan (remat's own recompute counted) is emitted and verified (`run(False)`: a
        PassResult). The next is emitted too only if it may be cheaper after all (the refine loop made the first
        costlier) or the first misses the limits by its estimate (and, when no plan reaches them, the next was not
        planned clearly higher: BEST_EFFORT_MARGIN): the cheaper one that fits wins, else the lower estimate. A
        winner with a label says so in a note. Limits no plan reaches (one by its planner, another by its estimate)
        are a BudgetError once every refusing option's lowest plan, emitted, misses them by its estimate too."""
        plans, refused = [], []
        for option in options:
            try:
                planned_cost, miss, reachable = option.run(True)
            except BudgetError as budget_error:
                refused.append((budget_error, option))
                continue
            # reachable plans first, cheapest first; best-effort plans (unreachable limits) by planned shortfall
            plans.append(((not reachable, planned_cost + option.extra if reachable else miss), option))
        refused.sort(key=_reach_of)  # the refusal reaching lowest first: the one raised
        error = refused[0][0] if refused else None
        if not plans:
            return _first_verified(refused)
        plans.sort(key=lambda t: t[0])
        (_, first_option), rest = plans[0], plans[1:]
        first = first_option.run(False)
        first_extra = first_option.extra
        best, best_option, why = first, first_option, "the cheaper plan"
        if rest and _worth_emitting(first, first_extra, rest[0][0], limits):
            second_option = rest[0][1]
            try:
                second = second_option.run(False)
            except BudgetError:
                second = None
            if second is not None and _fits(second, limits) and (
                    not _fits(first, limits) or _cost(second, second_option.extra) < _cost(first, first_extra)):
                best, best_option = second, second_option
                why = "the cheaper plan that fits" if _fits(first, limits) else "the plan that fits"
            elif second is not None and not _fits(first, limits) and not _fits(second, limits) and \
                    limits.miss_metrics(second.metrics) < limits.miss_metrics(first.metrics):
                best, best_option, why = second, second_option, "the lower estimate"
        if error is not None and not _fits(best, limits):
            # the other plans' planners put the budget out of reach and this one misses it by its estimate: theirs
            # are verified before it is refused (a plan returned over it could peak above what a lower, best-effort
            # budget gives: not monotone)
            return _first_verified(refused)
        if best_option.label:
            best.notes.append(f"checkpoint: {best_option.label}: {why} ({len(options)} plans were planned, remat's "
                              f"own recompute counted)")
        return best

    @staticmethod
    def _candidate_sets(program: Program, traced, estimate, opts: CheckpointOptions,
                        keep_ops: frozenset) -> list[CandidateSet]:
        """Candidate regions at each level (block, sub-block, segments, blocks with their glue), measured, with
        their memory models."""
        meter = RegionMeter(program, traced, opts, keep_ops)
        levels = meter.levels()
        sets, seen = [], set()
        for level, regions in levels:  # (grows: the block level with its glue is planned last)
            key = tuple(tuple(n.name for n in r.nodes) for r in regions)
            if key in seen or not regions:
                continue
            seen.add(key)
            regions = meter.admissible(regions)
            meter.measure(regions)
            if level == "block" and not opts.regions:
                glued = glue_regions(program, regions, meter.measure)
                if glued:
                    levels.append(("block+glue", glued))
            cset = meter.candidate_set(level, regions, estimate)
            if cset is not None:
                sets.append(cset)
        return sets

    @staticmethod
    def _emit(program: Program, regions: list, plan: list[str], keep_ops: frozenset) -> list:
        return emit_regions(program, regions, plan, keep_ops)

    @staticmethod
    def _trace(program: Program, ctx):
        return trace_forward(program, program.example_args, program.example_kwargs, ctx.mode, ctx.loss_fn)


class PlanOption(NamedTuple):
    """One plan `_remat_or_not` weighs: `run(True)` plans it ((cost, planned shortfall, limits reachable)),
    `run(False)` emits it (a PassResult); `extra` is remat's recompute cost beside the regions'; `label`, when
    given, is noted if the plan wins."""
    run: Callable
    extra: float
    label: str | None = None


def _site_variants(opts: CheckpointOptions) -> list[tuple[bool, bool]]:
    """The (products, scores) site sets remat is planned with beyond the cheap sites, as the options allow: matrix
    products, products and attention softmaxes, softmaxes alone (none with the profiled cost: its sites are timed,
    not these)."""
    if opts.cost == "profile":
        return []
    return [(True, False)] * opts.remat_products + [(True, True)] * (opts.remat_products and opts.remat_scores) + \
        [(False, True)] * opts.remat_scores


def _sites_named(products: bool, scores: bool) -> str:
    return "matrix products among its sites" + " and attention scores" * scores if products else \
        "attention scores among its sites"


def _remat_alone(variant: Variant, limits: Limits, plan_only: bool):
    """`_remat_or_not`'s run for remat alone (`variant`, fitting the limits): nothing to plan, no regions."""
    if plan_only:
        return 0.0, 0, True
    sites = variant.metrics["remat"]["sites"]
    estimate = variant.estimate
    products, softmaxes = variant.metrics["remat"].get("products"), variant.metrics["remat"].get("softmaxes")
    scores = f"{softmaxes} attention softmax{'es' * (softmaxes > 1)} with their scores" if softmaxes else ""
    among = "matrix products among them (a linear's or a convolution's output under its activation or norm" + \
        (f", and {scores})" if scores else ")") if products else scores + " among them"
    return variant.result(f"checkpoint: {sites} activations recomputed in backward, {among}, bring the "
                          f"estimate to peak {format_bytes(estimate.peak)}, activations "
                          f"{format_bytes(estimate.activations)}, "
                          f"within {limits.describe()}; no region recomputed: cheaper than regions by the cost model")


def _reach_of(refusal: tuple[BudgetError, PlanOption]) -> float:
    """How low a refused option reaches, by its BudgetError (one without a number last)."""
    lowest = refusal[0].lowest
    return lowest if lowest is not None else math.inf


def _first_verified(refused: list[tuple[BudgetError, PlanOption]]) -> PassResult:
    """Before the refusal reaching lowest (`refused` is in that order) is raised: each refusing option's lowest plan,
    emitted and verified (a strict peak budget; other limits raise at once), in order; the first that meets the
    limits, else the first refusal's BudgetError."""
    for _, option in refused:
        try:
            return option.run(False)
        except BudgetError:
            continue
    raise refused[0][0]


def _fits(result: PassResult, limits: Limits) -> bool:
    return limits.miss_metrics(result.metrics) == 0


def _cost(result: PassResult, extra: float) -> float:
    """A result's recompute cost (its regions' in the metrics) plus `extra` (remat's)."""
    return extra + next((result.metrics[m] for m in ("recompute_roofline_flops", "recompute_flops",
                                                     "recompute_seconds") if result.metrics.get(m) is not None), 0.0)


def _worth_emitting(first: PassResult, first_extra: float, other: tuple, limits: Limits) -> bool:
    """Whether the other variant (`other`: its (unreachable, planned cost or shortfall)) may beat `first`, emitted:
    it is no costlier than first's emitted plan, or first misses the limits and the other was not planned clearly
    higher (first comes out lower than a best-effort plan planned to miss them by its shortfall even if the memory
    model put that plan BEST_EFFORT_MARGIN above what it would estimate)."""
    unreachable, planned = other
    if _fits(first, limits) and (unreachable or _cost(first, first_extra) <= planned):
        return False
    if not unreachable:
        return True
    miss = limits.miss_metrics(first.metrics)
    peak = first.metrics.get("estimated_peak") or 0
    acts = first.metrics.get("estimated_activations") or 0
    # (measured against the estimate missing the most)
    missing_most = peak if limits.peak is not None and peak - limits.peak >= miss else acts
    return not planned - miss > BEST_EFFORT_MARGIN * missing_most


class CheckpointRun:
    """One run of the pass: its options, context and limits, and its steps (each on a copy of the program)."""

    def __init__(self, opts: CheckpointOptions, ctx: PassContext, limits: Limits, started: float):
        self.opts, self.ctx, self.limits, self.started = opts, ctx, limits, started
        self.keep_ops = frozenset(opts.keep_ops)
        # variant -> it with matmul operand copies as nodes: both softmax-site variants start from the same one
        self._explicit: dict[int, tuple[Variant, Variant]] = {}

    def trace(self, program: Program):
        return CheckpointPass._trace(program, self.ctx)

    def estimate(self, program: Program, traced):
        ctx = self.ctx
        return estimate_from_trace(program, traced, mode=ctx.mode, optimizer=ctx.optimizer, loss_fn=ctx.loss_fn)

    def baseline(self, program: Program) -> Variant:
        """The program as given, with its estimate (the context's baseline when it was made for this program)."""
        limits, traced = self.limits, None
        estimate = _current_estimate(program, self.ctx)
        if estimate is None:
            traced = self.trace(program)
            estimate = self.estimate(program, traced)
        # best_effort: the limit out of reach that the pass planned as low as it goes instead ("peak",
        # "activations"); None when the limits are reachable
        metrics = {"budget": limits.peak, "peak_before": estimate.peak, "slack": self.opts.slack, "best_effort": None}
        if limits.activations is not None:
            metrics.update({"activation_budget": limits.activations, "activations_before": estimate.activations})
        return Variant(program, traced, estimate, metrics=metrics)

    def compact_dropout(self, variant: Variant) -> Variant:
        """`variant` with CPU dropout masks drawn as bool (`compact_dropout`), when enabled and there are any;
        traced either way."""
        if self.opts.compact_dropout:
            compacted = variant.program.snapshot()
            changes = compact_dropout(compacted)
            if changes:
                compacted.graph.lint()  # the new nodes carry the replaced nodes' metadata (same shapes and dtypes)
                compacted.module.recompile()
                traced = self.trace(compacted)
                before, after = variant.estimate, self.estimate(compacted, traced)
                metrics = {**variant.metrics, "compact_dropout": {
                    "sites": len(changes), "peak_after": after.peak,
                    "activations_saved": before.activations - after.activations}}
                self.ctx.log(f"[checkpoint] {len(changes)} dropout masks drawn as bool: estimated peak "
                             f"{format_bytes(before.peak)} -> {format_bytes(after.peak)}")
                variant = Variant(compacted, traced, after, list(changes), list(variant.notes), metrics)
        if variant.traced is None:
            variant = replace(variant, traced=self.trace(variant.program))
        return variant

    def remat(self, variant: Variant, products: bool = False, scores: bool = False) -> Variant | None:
        """`variant` with the cheapest remat sites the limits need applied (all when they need more); None when
        there are none or they do not lower the estimate. `products`: matrix products with held inputs are sites
        too (`remat_sites`), and there must be some; `scores`: softmaxes too, recomputed with their scores from
        matmul operand copies made nodes (`_matmul_operands_explicit`), and there must be some."""
        opts = self.opts
        if scores:
            given, explicit = self._explicit.get(id(variant), (None, None))
            if given is not variant:  # (the pair keeps `variant` alive, so its id is not reused)
                explicit = self._matmul_operands_explicit(variant)
                self._explicit[id(variant)] = (variant, explicit)
            variant = explicit
        program, traced, before = variant.program, variant.traced, variant.estimate
        balance = opts.balance if opts.balance is not None \
            else default_balance(program) if opts.cost == "roofline" else None
        sites = remat_sites(program, traced, balance, products, scores)
        if not sites or (products and not any(map(product_site, sites))) or \
                (scores and not any(map(softmax_site, sites))):
            return None
        misses = partial(self._misses, program, traced)
        chosen = choose_sites(sites, misses)
        if scores and not any(map(softmax_site, chosen)):
            return None  # (the plan with products alone)
        rematted = program.snapshot()
        changes = apply_remat(rematted, chosen)
        rematted.graph.lint()
        traced_remat = self.trace(rematted)
        after = self.estimate(rematted, traced_remat)
        if not (after.peak < before.peak or ((after.peak == before.peak or self.limits.peak is None)
                                              and after.activations < before.activations)):
            return None
        cost = sum(s.cost for s in chosen) if opts.cost != "profile" else None
        # (recompute: the sites' cost in the pass's cost unit, beside the regions' recompute_* metric)
        metrics = {**variant.metrics, "remat": {"sites": len(changes), "candidates": len(sites),
                                                "peak_after": after.peak, "recompute": cost,
                                                "activations_saved": before.activations - after.activations}}
        if products:  # (how many of the sites are linears, matrix products or convolutions)
            metrics["remat"]["products"] = sum(map(product_site, chosen))
        if scores:  # (how many are softmaxes recomputed with their scores)
            metrics["remat"]["softmaxes"] = sum(map(softmax_site, chosen))
        self.ctx.log(f"[checkpoint] {len(changes)} of {len(sites)} activations recomputed in backward: "
                     f"estimated peak {format_bytes(before.peak)} -> {format_bytes(after.peak)}")
        return Variant(rematted, traced_remat, after, variant.changes + changes, list(variant.notes), metrics,
                       rewrite_cost=cost or 0.0)

    def _matmul_operands_explicit(self, variant: Variant) -> Variant:
        """`variant` with the copies batched matmuls make of strided operands as graph nodes
        (`materialize_matmul_operands`), so remat can recompute a product (attention scores) from them; as it was
        when there are none or the cost model sees any byte change."""
        program = variant.program.snapshot()
        rewritten = materialize_matmul_operands(program.graph)
        if not rewritten:
            return variant
        program.graph.lint()
        program.module.recompile()
        traced = self.trace(program)
        after, before = self.estimate(program, traced), variant.estimate
        if (after.peak, after.activations) != (before.peak, before.activations):
            return variant
        nodes = {n.name: n for n in program.graph.nodes}
        changes = [Change(kind="checkpoint_operand_copy", module=(module_paths(nodes[name]) or ["<root>"])[-1],
                          nodes_before=[name], nodes_after=[name], bytes_saved=0,
                          reason="the copies matmul makes of its strided operands written as nodes (the same bytes "
                                 "and values), so remat can recompute its product from them")
                   for name in rewritten]
        return replace(variant, program=program, traced=traced, estimate=after, changes=variant.changes + changes,
                       sets=None)

    def _misses(self, program: Program, traced, sites: list[RematSite]) -> int:
        """Bytes the estimate of `program` with `sites` applied misses the limits by."""
        estimate = self.estimate(program, as_planned(traced, sites))
        return self.limits.over(estimate.peak, estimate.activations)

    def regions(self, variant: Variant, plan_only: bool):
        """Recompute regions on `variant` for the rest of the way to the limits: plan, emit on a copy, verify with
        the cost model; while the estimate misses the limits, refine (plan again against a peak budget lowered, or
        an activation need raised, by the miss; at most `refine` times). `plan_only`: the first plan's (cost,
        planned shortfall, limits reachable) without emitting it."""
        if variant.sets is None:  # (built once: planning, then emitting, use the same sets and their solutions)
            variant.sets = CheckpointPass._candidate_sets(variant.program, variant.traced, variant.estimate,
                                                          self.opts, self.keep_ops)
        work = replace(variant, notes=list(variant.notes), metrics=dict(variant.metrics))
        limits, estimate = self.limits, work.estimate
        if not work.sets:
            if plan_only:
                return 0.0, limits.over(estimate.peak, estimate.activations), False
            return work.result("checkpoint: no candidate region saves activations; nothing to do")
        work.metrics["candidates"] = {cs.level: len(cs.regions) for cs in work.sets}
        found = reach(work.sets, limits, estimate, work.metrics.get("activations_before", estimate.activations))
        # a strict peak budget the planner's memory model puts out of reach: its lowest plan is emitted and verified
        # before the budget is refused (the model errs both ways; the estimate decides)
        verify_lowest = not plan_only and found.best_effort == "peak" and self._verify_before_refusing()
        if found.message is not None and not verify_lowest:
            work.notes.append(self._going_as_low_as_it_reaches(found))
        work.metrics["best_effort"] = None if verify_lowest else found.best_effort
        best, target, need = None, found.peak_target, found.act_need
        for _ in range(1 + max(0, self.opts.refine)):
            planned = self._plan(work.sets, found, target, need)
            if planned is None:
                if best is not None:
                    break
                raise found.error(limits, estimate)
            sol, cset = planned
            if plan_only:
                return sol.cost, limits.over(cset.model.peak(sol.plan), estimate.activations
                                             - cset.model.freed(sol.plan)), found.best_effort is None
            attempt = self._emit_and_verify(work, sol, cset, target)
            if best is None or best.estimate is None or attempt.estimate is None or attempt.rank < best.rank:
                best = attempt
            if found.best_effort is not None or attempt.estimate is None or attempt.rank[0] == 0:
                break
            refined = refine_targets(limits, attempt.estimate, target, need, found)
            if refined is None:
                break
            target, need = refined
        if not plan_only and not verify_lowest and best.rank[0] != 0 and self._verify_before_refusing():
            # the cheapest plans within the strict budget all miss it by their estimates: the lowest plan may not
            best = min(best, self._emit_and_verify(work, *self._plan(work.sets, replace(found, best_effort="peak"),
                                                                     target, need), target), key=lambda a: a.rank)
        if verify_lowest and best.rank[0] != 0:
            raise found.error(limits, estimate)
        return regions_result(work, best, limits, self.opts, self.ctx.log, self.started)

    def _verify_before_refusing(self) -> bool:
        """Whether the lowest plan is emitted and verified before a peak budget is refused or missed: a strict peak
        budget (nothing takes the rest), with verification on."""
        return self.limits.peak is not None and self.ctx.budget_strict and not self.ctx.rest_taken \
            and self.opts.verify

    def _going_as_low_as_it_reaches(self, found: Reach) -> str:
        """The note for limits out of reach that the pass goes as low as it can for; BudgetError when it may not."""
        if self.ctx.rest_taken and found.best_effort == "peak":
            # (the offload pass plans against the peak budget: it does not take over an activation budget)
            return found.message + " The offload pass is enabled and takes the rest: checkpointing goes as low " \
                                   "as it reaches."
        if not self.ctx.budget_strict:
            # a preset's budget is a target: go as low as checkpointing can and say so
            return found.message + " The policy's budget is a target (budget_strict: false): checkpointing goes " \
                                   "as low as it reaches."
        raise found.error(self.limits, None)

    def _plan(self, sets: list[CandidateSet], found: Reach, target: int, need: int):
        """(solution, its candidate set): the best-effort plan when a limit is out of reach, else the cheapest
        plan of any set within `target` freeing `need` (ties: the lowest planned peak); None when none has one."""
        opts = self.opts
        if found.best_effort is not None:
            peak = found.best_effort == "peak"
            cset = found.min_set if peak else found.act_set
            model = cset.model if peak else with_need(cset.model, cset.model.max_freed())
            # (the lowest peak within `lowest`'s resolution: a solver asked for exactly it may miss it)
            low = lowest(cset.model)[0]
            sol = solve(model, max(low + max(1, low // 2048), cset.model.floor) if peak else found.peak_target,
                        opts.solver, opts.time_limit, cset.chain)
            if sol is None:
                plan = lowest(cset.model)[1] if peak else cset.model.max_plan()
                sol = Solution(plan, cset.model.cost(plan), cset.model.peak(plan), "lowest" if peak else "max", True)
            return sol, cset
        key, found_plans = (target, need), []
        for cset in sets:
            if key not in cset.solved:  # planning, then emitting, solve the same limits
                cset.solved[key] = [solve(with_need(cset.model, need), target, opts.solver, opts.time_limit,
                                          cset.chain, tiebreak=False), None]
            if cset.solved[key][0] is not None:
                found_plans.append(cset)
        if not found_plans:
            return None
        # cheapest, then lowest planned peak: only the sets at the lowest cost can win, so only their plans go
        # through the (costly) lowest-peak tie-break
        cheapest = min(cs.solved[key][0].cost for cs in found_plans)
        tied = [cs for cs in found_plans if cs.solved[key][0].cost <= cheapest * (1 + 1e-9) + 1e-9]
        for cset in tied:
            if cset.solved[key][1] is None:
                cset.solved[key][1] = tie_break(cset.solved[key][0], with_need(cset.model, need), target,
                                                opts.time_limit)
        order = {id(cs): i for i, cs in enumerate(found_plans)}
        cset = min(tied, key=lambda cs: (cs.solved[key][0].cost, cs.solved[key][1].peak, order[id(cs)]))
        return cset.solved[key][1], cset

    def _emit_and_verify(self, work: Variant, sol: Solution, cset: CandidateSet, target: int) -> Attempt:
        """`sol` emitted on a copy of the variant's program, with the cost model's estimate of it (verify)."""
        trial = work.program.snapshot()
        changes = CheckpointPass._emit(trial, cset.regions, sol.plan, self.keep_ops)
        # (_emit linted and recompiled; the manager refreshes meta after the pass)
        estimate = self.ctx.estimate(trial) if self.opts.verify else None
        if estimate is None:
            return Attempt(sol, trial, changes, None, target, cset, (0, 0))
        return Attempt(sol, trial, changes, estimate, target, cset,
                       (self.limits.over(estimate.peak, estimate.activations), estimate.peak))


def _current_estimate(program: Program, ctx):
    """The context's baseline if it was made for this very program (same code, mode and optimizer), else None."""
    base = ctx.baseline
    if base is not None and getattr(base, "program_key", "") and base.program_key == program_key(program) \
            and getattr(base, "mode", ctx.mode) == ctx.mode \
            and getattr(base, "optimizer", ctx.optimizer) == ctx.optimizer:
        return base
    return None
