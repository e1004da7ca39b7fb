"""What the two stages of the precision pass (weights, compute) share: the log they write, the guard of one kind of
change, and the order in which the guard backs sites off."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fxmem.lossguard import guard_for
from fxmem.pass_api import PassContext
from fxmem.program import Program

from .options import PrecisionOptions


# guard items each site's own error is measured on (it only orders the back-off; every site's inputs and outputs are
# held for each item, so few)
SITE_ITEMS = 2


@dataclass
class StageLog:
    """What the stages of one run of the pass record: Changes, notes, per-site rows, verdicts, intents."""
    changes: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    sites: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)  # the guard's verdicts on what was kept
    asked: list = field(default_factory=list)  # its verdicts on what was asked (the first candidate of each stage)
    intents: list = field(default_factory=list)

    def record(self, outcome) -> None:
        if outcome.verdict is not None:
            self.verdicts.append(outcome.verdict)
        if outcome.asked is not None:
            self.asked.append(outcome.asked)


def stage_guard(ctx: PassContext, program: Program, opts: PrecisionOptions, kind: str):
    """The guard of one kind of change made by this pass (None with `guard: false`)."""
    if not opts.guard:
        return None
    return guard_for(ctx, program, kind, section="passes.precision", tolerance=opts.tolerance)


def by_error(rows: dict) -> list[str]:
    """Site names by their own relative error, largest first (the order the guard backs off in)."""
    return sorted(rows, key=lambda name: -rows[name] if math.isfinite(rows[name]) else -math.inf)


def back_off_why(outcome, what: str) -> str:
    """Why a site was backed off: the guard's verdict on what was asked, and whether it accepted anything."""
    asked = outcome.asked
    if asked is None or asked.accepted:
        return "kept as it was"
    refused = f"the guard refused {what} on the whole model ({asked.reason()} on {asked.data})"
    if outcome.program is None:
        return refused + " and at every back-off step"
    return refused + "; this site's own error is among the largest, so it went back first"
