"""What the candidate sets can reach: the lowest planned peak and activations, and whether the limits are in reach.

Out of reach, the pass either raises `BudgetError` with `budget_message`/`activation_message`, or (a budget that is a
target, or the offload pass taking the rest) plans as low as it goes: `Reach.best_effort` names that limit.
`refine_targets` lowers the planning targets when the cost model's estimate of an emitted plan misses the limits.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxmem.errors import BudgetError
from fxmem.units import format_bytes

from .candidates import CandidateSet
from .options import NO_PEAK, Limits
from .solvers import lowest


@dataclass
class Reach:
    """The lowest the candidate sets plan to, against the limits (all bytes)."""
    min_set: CandidateSet  # the set reaching the lowest planned peak
    min_peak: int
    act_set: CandidateSet  # the set freeing the most activations
    min_acts: int  # the activations left at the end of forward when it frees the most
    before_acts: int  # the activations before the pass (before remat and compact dropout too)
    peak_target: int  # the planning budget of the peak (NO_PEAK when only activations are bounded)
    act_need: int  # the activation bytes the regions must free
    best_effort: str | None = None  # the limit out of reach, planned as low as it goes: "peak", "activations"
    message: str | None = None  # why it is out of reach

    def error(self, limits: Limits, estimate) -> BudgetError:
        """The BudgetError for limits out of reach (`message`, else why no plan meets the refined limits), carrying
        how low the limit missed goes (`lowest`, bytes: the lowest planned peak or activations), so that of several
        plans' errors the pass can raise the one reaching lowest."""
        error = BudgetError(self.message or self.no_plan_message(limits, estimate))
        peak = self.best_effort == "peak" if self.best_effort else \
            limits.peak is not None and (limits.activations is None or self.act_need == 0)
        error.lowest = self.min_peak if peak else self.min_acts
        return error

    def no_plan_message(self, limits: Limits, estimate) -> str:
        """Why no candidate set has a plan within the (refined) limits."""
        if limits.peak is not None and (limits.activations is None or self.act_need == 0):
            return budget_message(limits.peak, self.min_peak, estimate)
        return activation_message(limits.activations, self.min_acts, self.before_acts) \
            + (f" With the budget {format_bytes(limits.peak)} as well, no plan meets both."
               if limits.peak is not None else "")


def reach(sets: list[CandidateSet], limits: Limits, estimate, before_acts: int) -> Reach:
    """How low `sets` go on the program `estimate` is of; which limit is out of reach, if one is."""
    min_set = min(sets, key=lambda cs: max(cs.model.min_peak(), cs.model.floor))
    min_peak = max(min_set.model.min_peak(), min_set.model.floor)
    if limits.peak is not None and min_peak > limits.peak:
        # recomputation spikes can put the plan freeing the most above a lower one: look harder before giving up
        min_set = min(sets, key=lambda cs: max(lowest(cs.model)[0], cs.model.floor))
        min_peak = max(lowest(min_set.model)[0], min_set.model.floor)
    act_set = max(sets, key=lambda cs: cs.model.max_freed())
    found = Reach(min_set, min_peak, act_set, estimate.activations - act_set.model.max_freed(), before_acts,
                  limits.peak if limits.peak is not None else NO_PEAK,
                  max(0, estimate.activations - limits.activations) if limits.activations is not None else 0)
    if limits.peak is not None and min_peak > limits.peak:
        found.message, found.best_effort = budget_message(limits.peak, min_peak, estimate), "peak"
    elif limits.activations is not None and found.min_acts > limits.activations:
        found.message = activation_message(limits.activations, found.min_acts, before_acts)
        found.best_effort = "activations"
    return found


def refine_targets(limits: Limits, estimate, target: int, need: int, found: Reach) -> tuple[int, int] | None:
    """The planning budget lowered, and the activation need raised, by what `estimate` (of the plan planned at
    `target` and `need`) misses the limits by; None when there is nothing left to try."""
    if limits.peak is not None and estimate.peak > limits.peak:
        target = target - (estimate.peak - limits.peak) - max(1, limits.peak // 1000)
    if limits.activations is not None and estimate.activations > limits.activations:
        most = found.act_set.model.max_freed()
        if need >= most:
            return None
        # at most everything the regions can free: the plan freeing the most is the last one to try
        need = min(need + (estimate.activations - limits.activations) + max(1, limits.activations // 1000), most)
    if target < found.min_peak:
        return None
    return target, need


def budget_message(budget: int, min_peak: int, estimate) -> str:
    fixed = estimate.params + estimate.buffers + estimate.grads + estimate.optimizer_state + estimate.inputs
    return (f"checkpoint: budget {format_bytes(budget)} is below the lowest peak checkpointing reaches, "
            f"about {format_bytes(min_peak)} (baseline {format_bytes(estimate.peak)}). What cannot be checkpointed: "
            f"parameters {format_bytes(estimate.params)}, gradients {format_bytes(estimate.grads)}, optimizer state "
            f"{format_bytes(estimate.optimizer_state)}, buffers {format_bytes(estimate.buffers)}, inputs "
            f"{format_bytes(estimate.inputs)} (together {format_bytes(fixed)}), plus the inputs each recomputed "
            f"region keeps and the last region's activations. Raise the budget, enable the offload pass, or make "
            f"the budget a target (budget_strict: false) to get the result over budget.")


def activation_message(act_budget: int, min_acts: int, before: int) -> str:
    return (f"checkpoint: activation budget {format_bytes(act_budget)} is below the lowest activations at the "
            f"end of forward that checkpointing reaches, about {format_bytes(max(0, min_acts))} (before the "
            f"pass {format_bytes(before)}): every recomputed region keeps its inputs, and the model's output and "
            f"what the last region needs stay. Raise the activation budget (the offload pass plans against the "
            f"peak budget, not this one).")
