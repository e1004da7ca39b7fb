"""What a policy asked of a lossy pass against what the pass achieved, said in one line.

    pruning: asked 25% of 512 hidden units, removed 12.5% (64): the guard (top-1 agreement 96.1% < 97.0% on
    2 calibration item(s)) stopped it; lower verify.top1_agreement (now 97.0%) or give evaluate

A pass records an `Intent` per explicit setting (`weights: nf4`, `compute: bf16`, `fraction: 0.25`,
`rewrite: hab`). A shortfall (an intent not fully achieved, or a pass that was rolled back after recording one) is
the first line of the CLI summary and of the report's warnings; `strict` makes it an error (`ShortfallError`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import StrictError


class ShortfallError(StrictError):
    """strict: a lossy pass did less than its policy asked (the guard stopped it). Like every refusal of strict, the
    CLI exits 3."""


@dataclass
class Intent:
    """One explicit setting of a pass: what it asked, what was achieved, and when short, why and what to change."""
    setting: str  # the policy key, e.g. passes.pruning.fraction
    asked: str  # e.g. "25% of 512 hidden units"
    achieved: str  # e.g. "removed 12.5% (64)"
    complete: bool
    stopped_by: str = ""  # e.g. "the guard (top-1 agreement 96.1% < 97.0% on 2 calibration item(s))"
    change: str = ""  # e.g. "lower verify.top1_agreement (now 97.0%) or give evaluate"
    not_covered: str = ""  # what the setting cannot reach, e.g. weights bitsandbytes cannot hold, and why

    def to_dict(self) -> dict:
        return asdict(self)


def guard_stop(verdict) -> tuple[str, str]:
    """(stopped_by, change) for a shortfall the guard caused, from its verdict on what was asked."""
    if verdict is None or verdict.accepted:
        return "", ""
    return f"the guard ({verdict.reason()} on {verdict.data})", verdict.hint()


def intent_line(pass_name: str, intent: dict, status: str = "applied", reason: str = "") -> str:
    """The one line for a recorded intent (a dict from `Intent.to_dict`), given what became of its pass."""
    head = f"{pass_name}: asked {intent['asked']}"
    if status in ("rolled_back", "failed"):
        word = "rolled back" if status == "rolled_back" else "failed and was rolled back"
        return f"{head}, achieved nothing: the pass {word} ({reason or 'no reason recorded'})"
    line = f"{head}, {intent['achieved']}"
    if intent.get("not_covered"):
        line += f"; not covered: {intent['not_covered']}"
    if intent.get("complete"):
        return line
    if intent.get("stopped_by"):
        line += f": {intent['stopped_by']} stopped it"
    if intent.get("change"):
        line += f"; {intent['change']}"
    return line


def is_shortfall(intent: dict, status: str) -> bool:
    return status in ("rolled_back", "failed") or not intent.get("complete", True)


def shortfall_lines(records) -> list[str]:
    """One line per intent a pass did not fully achieve (`PassRecord.intents`), in pass order."""
    return [intent_line(rec.name, it, rec.status, rec.reason) for rec in records
            for it in rec.intents if is_shortfall(it, rec.status)]


def coverage_lines(records) -> list[str]:
    """One line per intent achieved in full whose setting leaves part of the model out (`Intent.not_covered`):
    e.g. int8 weights on every linear while the convolutions keep fp32."""
    return [intent_line(rec.name, it, rec.status, rec.reason) for rec in records
            for it in rec.intents if it.get("not_covered") and not is_shortfall(it, rec.status)]


def require_intents(records) -> None:
    """strict: any shortfall is an error naming each one."""
    lines = shortfall_lines(records)
    if lines:
        raise ShortfallError("strict: a lossy pass did less than the policy asked (" + "; ".join(lines)
                             + "). Run without --strict to write the result and its report, or change the "
                               "setting named above")
