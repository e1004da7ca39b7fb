"""The report of one `fxmem.transform` run: its data, JSON (schema-versioned), warnings and budget lines, and the
files it is saved as (report.md, report.html, report.json, the memory timeline as SVG and PNG).

What it holds: memory before/after by category, estimated (cost model, no tensors allocated) and, when the run
was measured, measured (real steps under `fxmem.measure`); per pass its record (status, changes, why, the
measured deviation); the graph diff (unified diff of the generated code, without codegen's `; x = None` tails)
and the nodes each change replaced. Warnings come first: a missed budget (`fxmem.budgets`), what a lossy pass
was asked and did not do (`fxmem.intent`), passes rolled back or failed, ops the cost model does not know.

Renderings live beside it: `fxmem.report_markdown`, `fxmem.report_html`, `fxmem.report_plots`, with the text
pieces they share in `fxmem.report_text`. Determinism: with `deterministic=True` every rendering leaves out
wall-clock timing and what passes derive from probes of the machine (metrics and change details named like
`*_s`, `*_seconds`, `*_ms`), and the SVG is written with a fixed `svg.hashsalt` and no date, so the same model,
inputs and policy give byte-identical files. Every number says whether it is estimated or measured.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .budgets import miss_line, stated_slack
from .costmodel import UNMEASURED_FORMULA, MemoryEstimate
from .files import write_bytes, write_text
from .intent import coverage_lines, shortfall_lines
from .measure import MemoryProfile, TimelinePoint
from .pass_api import Change, PassRecord
from .report_html import render_html
from .report_markdown import render_markdown
from .report_plots import timeline_png, timeline_svg
from .report_text import format_bytes, is_timing_key, json_safe, scrub

__all__ = ["Report", "SCHEMA_VERSION", "clean_code", "diff_text", "format_bytes", "graph_diff", "is_timing_key",
           "replaced_nodes"]

SCHEMA_VERSION = 1
ESTIMATE_WARN_FRACTION = 0.10  # warn when the estimated peak is further than this from the measured one

# summary rows: (attribute, label)
CATEGORIES = (("params", "parameters"), ("buffers", "buffers"), ("grads", "gradients"),
              ("optimizer_state", "optimizer state"), ("inputs", "inputs"),
              ("activations", "activations (saved for backward)"), ("peak", "peak"))


# ============================================================================================ graph diff

_TAIL = re.compile(r";\s+(?:[A-Za-z_][\w.]*\s*=\s*)+None\s*$")


def clean_code(code: str) -> list[str]:
    """Generated code, readable: drop the `;  a = b = None` tails GraphModule codegen adds to free values,
    trailing whitespace and blank runs."""
    out: list[str] = []
    for line in code.splitlines():
        line = _TAIL.sub("", line).rstrip()
        if not line and (not out or not out[-1]):
            continue
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def diff_text(a_code: str, b_code: str, a_label: str = "before", b_label: str = "after", context: int = 3) -> str:
    """Unified diff of two generated programs (cleaned by `clean_code`); '' when they are the same."""
    lines = difflib.unified_diff(clean_code(a_code), clean_code(b_code), fromfile=a_label, tofile=b_label,
                                 n=context, lineterm="")
    return "\n".join(lines)


def graph_diff(code_before: str, code_after: str, context: int = 3) -> str:
    """The graph diff of a report: generated code of the captured program vs the transformed one."""
    return diff_text(code_before, code_after, "captured", "transformed", context)


def replaced_nodes(passes) -> list[dict]:
    """One row per Change: which pass replaced which nodes with which, where, and the estimated saving."""
    rows = []
    for rec in passes:
        for change in rec.changes:
            rows.append({"pass": rec.name, "status": rec.status, "kind": change.kind,
                         "module": change.module or "(root)",
                         "nodes_before": [str(n) for n in change.nodes_before],
                         "nodes_after": [str(n) for n in change.nodes_after], "bytes_saved": change.bytes_saved,
                         "reason": change.reason})
    return rows


# ============================================================================================ the report

@dataclass
class Report:
    model_name: str
    policy: dict
    mode: str
    optimizer: str
    before: Any  # fxmem.costmodel.MemoryEstimate
    after: Any
    measured_before: Any = None  # fxmem.measure.MemoryProfile
    measured_after: Any = None
    passes: list = field(default_factory=list)  # fxmem.pass_api.PassRecord
    code_before: str = ""
    code_after: str = ""
    specialized: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    budget: int | None = None
    budget_further: list | None = None  # over the budget: what would go further (`fxmem.budgets.further_steps`)
    versions: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)  # the only non-deterministic part

    # ------------------------------------------------------------------------------------------ derived
    @property
    def measured(self) -> bool:
        return self.measured_before is not None or self.measured_after is not None

    def graph_diff(self, context: int = 3) -> str:
        return graph_diff(self.code_before, self.code_after, context)

    def replaced_nodes(self) -> list[dict]:
        return replaced_nodes(self.passes)

    def problem_passes(self) -> list:
        return [r for r in self.passes if r.status in ("rolled_back", "failed")]

    def shortfalls(self) -> list[str]:
        """One line per explicit lossy setting a pass did not fully achieve (what was asked, what was achieved,
        what stopped it, which setting to change); rolled-back passes have their own warning."""
        return shortfall_lines([r for r in self.passes if r.status not in ("rolled_back", "failed")])

    def not_covered(self) -> list[str]:
        """One line per lossy setting achieved where it applies that leaves part of the model out, with why."""
        return coverage_lines(self.passes)

    def unknown_ops(self) -> list[str]:
        ops: set[str] = set()
        for estimate in (self.before, self.after, self.measured_before, self.measured_after):
            if estimate is not None:
                ops.update(str(op) for op in (estimate.unknown_ops or []))
        return sorted(ops)

    def summary_rows(self) -> list[dict]:
        rows = []
        for attr, label in CATEGORIES:
            row = {"category": attr, "label": label, "estimated_before": getattr(self.before, attr),
                   "estimated_after": getattr(self.after, attr)}
            if self.measured:
                row["measured_before"] = getattr(self.measured_before, attr, None)
                row["measured_after"] = getattr(self.measured_after, attr, None)
            rows.append(row)
        return rows

    # ------------------------------------------------------------------------------------------ warnings
    def warning_lines(self) -> list[str]:
        """The report's warnings, most important first: budgets missed, lossy settings short of the policy or
        leaving part of the model out, passes rolled back, unknown ops, a cost model far from the measurement."""
        out = [miss for miss in (self.budget_miss(), self.activation_budget_miss()) if miss]
        out += [f"short of the policy: {line}" for line in self.shortfalls()]
        out += [f"not covered by the policy: {line}" for line in self.not_covered()]
        for rec in self.problem_passes():
            what = "was ROLLED BACK" if rec.status == "rolled_back" else "FAILED and was rolled back"
            out.append(f"pass `{rec.name}` {what}: {rec.reason or 'no reason recorded'}")
        unknown = self.unknown_ops()
        unseen = [op for op in unknown if not op.endswith(UNMEASURED_FORMULA)]
        if unseen:
            out.append(f"{len(unseen)} op(s) unknown to the cost model (estimated as outputs only, nothing saved "
                       f"for backward): {', '.join(unseen)}")
        if len(unseen) < len(unknown):
            ops = [op[:-len(UNMEASURED_FORMULA)] for op in unknown if op.endswith(UNMEASURED_FORMULA)]
            out.append(f"{len(ops)} op(s) whose backward could not be run on fake tensors (what they save is counted, "
                       f"the temporaries their backward makes are not): {', '.join(ops)}")
        for tag, estimate, measured in (("before", self.before, self.measured_before),
                                        ("after", self.after, self.measured_after)):
            if measured is not None and measured.peak and \
                    abs(estimate.peak - measured.peak) > ESTIMATE_WARN_FRACTION * measured.peak:
                out.append(f"the cost model's peak {tag} ({format_bytes(estimate.peak)}, estimated) is "
                           f"{(estimate.peak - measured.peak) / measured.peak * 100:+.1f}% off the measured "
                           f"{format_bytes(measured.peak)}: plans made from the estimate (checkpoint, offload) may "
                           "be off")
        return out

    def budget_line(self) -> str | None:
        if self.budget is None:
            return None
        peak = self.after.peak
        if peak <= self.budget:
            verdict = f"fits ({format_bytes(self.budget - peak)} to spare)"
        else:
            verdict = f"OVER the budget by {format_bytes(peak - self.budget)}"
        target = " (the policy's target, budget_strict: false)" if (self.policy or {}).get("budget_strict") is False \
            else ""
        line = f"budget {format_bytes(self.budget)}{target}: estimated peak after {format_bytes(peak)}, {verdict}"
        if self.measured_after is not None:
            measured_peak = self.measured_after.peak
            line += (f"; measured peak after {format_bytes(measured_peak)}, "
                     + ("fits" if measured_peak <= self.budget
                        else f"OVER by {format_bytes(measured_peak - self.budget)}"))
        return line

    def budget_miss(self) -> str | None:
        """Over the budget (the estimate): one line naming the budget, the lowest peak the passes reached and what
        would go further; the first warning of the report and the first line of the CLI summary."""
        if self.budget is None or self.after.peak <= self.budget:
            return None
        slack = stated_slack(self.passes)
        if (self.policy or {}).get("budget_strict") is False:
            verdict = "missed (a target, budget_strict: false)"
        elif slack:  # required, and within the budget pass's tolerance (beyond it, transform raises a BudgetError)
            verdict = f"missed (within the stated tolerance of {slack:.0%})"
        else:
            verdict = "missed"
        return miss_line(self.budget, self.before, self.after, self.passes, self.budget_further, verdict)

    def activation_budget(self) -> int | None:
        """The activation budget in bytes a pass planned for (passes.checkpoint.activation_budget), if one did."""
        stated = (r.budget_metrics().activation_budget for r in self.passes)
        return next((value for value in stated if value is not None), None)

    def activation_budget_miss(self) -> str | None:
        """Over the activation budget (the estimate): its line, beside `budget_miss` at the top of the warnings and
        of the CLI summary."""
        budget = self.activation_budget()
        return self.activation_budget_line() if budget is not None and self.after.activations > budget else None

    def activation_budget_line(self) -> str | None:
        budget = self.activation_budget()
        if budget is None:
            return None
        activations = self.after.activations
        line = (f"activation budget {format_bytes(budget)}: estimated activations after forward "
                f"{format_bytes(activations)}, "
                + (f"fits ({format_bytes(budget - activations)} to spare)" if activations <= budget
                   else f"OVER the activation budget by {format_bytes(activations - budget)}"))
        if self.measured_after is not None:
            measured = self.measured_after.activations
            line += (f"; measured {format_bytes(measured)}, "
                     + ("fits" if measured <= budget else f"OVER by {format_bytes(measured - budget)}"))
        return line

    # ------------------------------------------------------------------------------------------ JSON
    def to_dict(self, deterministic: bool = False) -> dict:
        out = {
            "schema_version": SCHEMA_VERSION,
            "model_name": self.model_name,
            "mode": self.mode,
            "optimizer": self.optimizer,
            "policy": self.policy,
            "budget": self.budget,
            "estimated": {"before": self.before.to_dict(), "after": self.after.to_dict()},
            "measured": ({"before": self.measured_before.to_dict() if self.measured_before is not None else None,
                          "after": self.measured_after.to_dict() if self.measured_after is not None else None}
                         if self.measured else None),
            "summary": self.summary_rows(),
            "passes": [_pass_dict(r, deterministic) for r in self.passes],
            "graph": {"code_before": self.code_before, "code_after": self.code_after, "diff": self.graph_diff(),
                      "replaced_nodes": self.replaced_nodes()},
            "budget_further": self.budget_further,
            "warnings": {"budget": self.budget_miss(), "activation_budget": self.activation_budget_miss(),
                         "shortfalls": self.shortfalls(),
                         "not_covered": self.not_covered(),
                         "rolled_back": [{"pass": r.name, "status": r.status, "reason": r.reason}
                                         for r in self.problem_passes()],
                         "unknown_ops": self.unknown_ops()},
            "specialized": [str(s) for s in self.specialized],
            "notes": [str(n) for n in self.notes],
            "versions": dict(self.versions),
        }
        if not deterministic:
            out["timing"] = dict(self.timing)
        out = json_safe(out)
        return scrub(out) if deterministic else out

    def to_json(self, deterministic: bool = False) -> str:
        return json.dumps(self.to_dict(deterministic), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        """Rebuild a report from `to_dict`/`report.json` (to re-render or compare saved results)."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"report schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
        passes = []
        for entry in data.get("passes", []):
            fields = {k: v for k, v in entry.items() if k in PassRecord.__dataclass_fields__}
            fields["changes"] = [Change(**change) for change in entry.get("changes", [])]
            passes.append(PassRecord(**fields))
        measured = data.get("measured") or {}
        return cls(model_name=data["model_name"], policy=data["policy"], mode=data["mode"],
                   optimizer=data["optimizer"],
                   before=_memory_from_dict(data["estimated"]["before"], MemoryEstimate),
                   after=_memory_from_dict(data["estimated"]["after"], MemoryEstimate),
                   measured_before=_memory_from_dict(measured.get("before"), MemoryProfile),
                   measured_after=_memory_from_dict(measured.get("after"), MemoryProfile), passes=passes,
                   code_before=data["graph"]["code_before"], code_after=data["graph"]["code_after"],
                   specialized=list(data.get("specialized", [])), notes=list(data.get("notes", [])),
                   budget=data.get("budget"), budget_further=data.get("budget_further"),
                   versions=dict(data.get("versions", {})), timing=dict(data.get("timing", {})))

    @classmethod
    def load(cls, path) -> "Report":
        path = Path(path)
        if path.is_dir():
            path = path / "report.json"
        return cls.from_dict(json.loads(path.read_text()))

    # ------------------------------------------------------------------------------------------ renderings
    def to_markdown(self, deterministic: bool = False) -> str:
        """report.md (`fxmem.report_markdown`)."""
        return render_markdown(self, deterministic)

    def to_html(self, deterministic: bool = False, *, svg: str | None = None) -> str:
        """report.html, one self-contained file (`fxmem.report_html`); `svg` is the already rendered
        `timeline_svg(self)` (saves a render)."""
        return render_html(self, deterministic, svg=svg)

    # ------------------------------------------------------------------------------------------ files
    def save(self, directory, deterministic: bool = False) -> dict[str, Path]:
        """Write report.md, report.html, report.json, memory_timeline.png and memory_timeline.svg."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": directory / "report.md", "html": directory / "report.html",
                 "json": directory / "report.json", "png": directory / "memory_timeline.png",
                 "svg": directory / "memory_timeline.svg"}
        svg = timeline_svg(self)
        write_text(paths["markdown"], self.to_markdown(deterministic))
        write_text(paths["html"], self.to_html(deterministic, svg=svg))
        write_text(paths["json"], self.to_json(deterministic))
        write_text(paths["svg"], svg)
        write_bytes(paths["png"], timeline_png(self))
        return paths


def _memory_from_dict(data: dict | None, klass):
    """A MemoryEstimate or MemoryProfile from its `to_dict` (None stays None)."""
    if data is None:
        return None
    names = set(klass.__dataclass_fields__)
    fields = {k: v for k, v in data.items() if k in names}
    fields["timeline"] = [TimelinePoint(**point) for point in data.get("timeline", [])]
    if "by_module" in names:
        fields["by_module"] = [(entry["module"], entry["bytes"]) for entry in data.get("by_module", [])]
    return klass(**fields)


def _pass_dict(rec, deterministic: bool) -> dict:
    """A pass record for the JSON; deterministic: without wall-clock timings and what probes of the machine gave."""
    out = rec.to_dict(with_timing=not deterministic)
    if deterministic:
        out["metrics"] = {k: v for k, v in out.get("metrics", {}).items() if not is_timing_key(k)}
        for change in out.get("changes", []):  # e.g. offload's per-region transfer times, from probes of this machine
            if isinstance(change.get("details"), dict):
                change["details"] = {k: v for k, v in change["details"].items() if not is_timing_key(k)}
    return out
