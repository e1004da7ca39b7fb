"""Budget semantics, one rule whatever passes are enabled.

A required budget (`budget_strict: true`: a policy file's default, and what `--budget` / `budget=` give) that the
enabled passes cannot reach is a `BudgetError`: one line naming the budget, the lowest peak the passes reached and
what would go further (a pass not enabled, or an enabled pass with another setting). A target budget
(`budget_strict: false`: the presets) gives the result, with the miss as the first line of the summary and of the
report's warnings. The peak is the cost model's estimate, missed beyond the budget pass's stated slack.
"""
from __future__ import annotations

from .errors import BudgetError, first_line
from .units import format_bytes

_EIGHT_BIT = {"adam": "adam8bit", "adamw": "adamw8bit"}  # optimizers with an 8-bit state variant


def stated_slack(records) -> float:
    """The tolerance the budget pass states (`slack`: peak <= budget * (1 + slack)); 0 when none ran."""
    stated = (record.budget_metrics().slack for record in records)
    return next((value for value in stated if value is not None), 0.0)


def planned_compiler_budget(records) -> float | None:
    """The torch.compile partitioner budget the result was planned for (a kept pass's `compiler_budget`); None: the
    compiler's own setting."""
    planned = (record.budget_metrics().compiler_budget for record in records
               if record.status in ("applied", "unchanged"))
    return next((value for value in planned if value is not None), None)


def over_budget(budget: int | None, peak: int, records) -> bool:
    """Whether `peak` misses `budget` beyond the stated slack."""
    return budget is not None and peak > budget * (1 + stated_slack(records))


def further_steps(policy, estimate, module) -> list[str]:
    """What would take the peak lower than the enabled passes did: passes not enabled, or enabled passes with
    another setting, each with what it acts on. Only what changes the estimate is named."""
    enabled = set(policy.enabled_passes)
    train = policy.mode == "train"
    offload = _options(policy, "offload") if "offload" in enabled else None
    steps = []
    if train and estimate.activations > 0:
        acts = format_bytes(estimate.activations)
        if "checkpoint" not in enabled:
            steps.append(f"passes.checkpoint (recomputes activations, {acts} kept after forward)")
        if offload is None:
            steps.append(f"passes.offload (moves activations off the device, {acts} kept after forward)")
        elif not getattr(offload, "activations", True):
            steps.append(f"passes.offload.activations: true ({acts} kept after forward)")
    frozen = sum(p.numel() * p.element_size() for p in module.parameters() if not (train and p.requires_grad))
    if frozen and not getattr(offload, "weights", False):
        key = "passes.offload.weights: true" if offload is not None else "passes.offload with weights: true"
        steps.append(f"{key} (streams {format_bytes(frozen)} of frozen weights)")
    if estimate.optimizer_state > 0 and policy.optimizer in _EIGHT_BIT:
        steps.append(f"optimizer: {_EIGHT_BIT[policy.optimizer]} (optimizer state "
                     f"{format_bytes(estimate.optimizer_state)})")
    steps += _precision_steps(policy, enabled, train)
    return steps


def _precision_steps(policy, enabled: set, train: bool) -> list[str]:
    """The precision settings not in use that lower the estimate (each lossy: judged by the guard)."""
    if "precision" not in enabled:
        return ["passes.precision (bf16 compute, lossy)"]
    options = _options(policy, "precision")
    steps = []
    if getattr(options, "compute", "bf16") == "fp32":
        steps.append("passes.precision.compute: bf16 (lossy)")
    if not train and getattr(options, "weights", "none") in ("none", "fp32"):
        steps.append("passes.precision.weights: int8 (lossy)")
    return steps


def _options(policy, name: str):
    section = policy.passes.get(name)
    return section.options if section is not None else None


def passes_reached(records, estimate) -> str:
    """How low the passes that ran went, with what became of the ones that did not apply."""
    peak = format_bytes(estimate.peak)
    if not records:
        return f"with no pass enabled the estimated peak is {peak}"
    said = [record.name if record.status in ("applied", "unchanged") else
            f"{record.name} {record.status.replace('_', ' ')}: {first_line(record.reason) or 'no reason recorded'}"
            for record in records]
    return f"the enabled passes ({', '.join(said)}) go as low as an estimated peak of {peak}"


def miss_line(budget: int, baseline, estimate, records, steps: list[str] | None, verdict: str) -> str:
    """One line: the budget and `verdict` ("is out of reach", "missed"), the lowest peak the enabled passes
    reached, and what would go further (`steps`; None: not known, e.g. a report written before they were kept)."""
    line = (f"budget {format_bytes(budget)} {verdict}: {passes_reached(records, estimate)}, "
            f"{format_bytes(estimate.peak - budget)} over (baseline {format_bytes(baseline.peak)})")
    if steps:
        return f"{line}; would go further: " + "; ".join(steps)
    if steps is None:
        return line
    return (f"{line}; nothing fxmem can enable goes further (parameters {format_bytes(estimate.params)}, "
            f"gradients {format_bytes(estimate.grads)}, optimizer state {format_bytes(estimate.optimizer_state)} "
            f"remain)")


def require_reachable(policy, budget: int | None, baseline, estimate, records, module) -> None:
    """A required budget (`policy.budget_strict`) the result misses is a BudgetError; a target is left to the
    report."""
    if not policy.budget_strict or not over_budget(budget, estimate.peak, records):
        return
    line = miss_line(budget, baseline, estimate, records, further_steps(policy, estimate, module),
                     "is out of reach")
    raise BudgetError(f"{line}. Raise the budget, enable what would go further, or make the budget a target "
                      f"(budget_strict: false) to get the result over budget")
