"""The report of one `fxmem.transform` run: Markdown, JSON (schema-versioned), one self-contained HTML file, plots.

What it shows:
- summary: memory before/after by category, estimated (cost model, no tensors allocated) and, when the run was
  measured, measured (real steps under `fxmem.measure`); FLOPs per step before/after (estimated);
- warnings first: a missed budget (the lowest peak reached and what would go further, `fxmem.budgets`), what a
  lossy pass was asked and did not do (one line each, `fxmem.intent`), passes that were
  rolled back or failed, ops the cost model does not know;
- per pass: status, what changed and where (module paths), why, the measured output deviation;
- the graph diff (unified diff of the generated code, without codegen's `; x = None` tails) and a table of the
  nodes each change replaced;
- a memory timeline plot, before vs after (matplotlib Agg; SVG inline in the HTML, PNG beside it).

Determinism: with `deterministic=True` every renderer leaves out the one non-deterministic part (wall-clock
timing, and what passes derive from probes of the machine: metrics and change details named like `*_s`,
`*_seconds`, `*_ms`, which the timing section shows), and the SVG is written with a fixed `svg.hashsalt` and no date, so the same model, inputs and policy give
byte-identical files. Every number says whether it is estimated or measured.
"""
from __future__ import annotations

import difflib
import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .costmodel import MemoryEstimate
from .files import write_bytes, write_text
from .budgets import miss_line, stated_slack
from .intent import coverage_lines, intent_line, shortfall_lines
from .lossguard import KIND_WORDS
from .measure import MemoryProfile, TimelinePoint
from .report_plots import histograms_svg, svg_for_html, timeline_png, timeline_svg
from .pass_api import Change, GuardMetrics, PassRecord
from .units import format_bytes as _format_bytes

SCHEMA_VERSION = 1
ESTIMATE_WARN_FRACTION = 0.10  # warn when the estimated peak is further than this from the measured one

# summary rows: (attribute, label)
CATEGORIES = (("params", "parameters"), ("buffers", "buffers"), ("grads", "gradients"),
              ("optimizer_state", "optimizer state"), ("inputs", "inputs"),
              ("activations", "activations (saved for backward)"), ("peak", "peak"))

STATUS_MARK = {"applied": "applied", "unchanged": "unchanged", "rolled_back": "ROLLED BACK", "failed": "FAILED"}


def format_bytes(n) -> str:
    """`fxmem.units.format_bytes`, with '-' for a missing value."""
    return "-" if n is None else _format_bytes(int(n))


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
        for c in rec.changes:
            rows.append({"pass": rec.name, "status": rec.status, "kind": c.kind, "module": c.module or "(root)",
                         "nodes_before": [str(n) for n in c.nodes_before],
                         "nodes_after": [str(n) for n in c.nodes_after], "bytes_saved": c.bytes_saved,
                         "reason": c.reason})
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
        for e in (self.before, self.after, self.measured_before, self.measured_after):
            if e is not None:
                ops.update(str(o) for o in (e.unknown_ops or []))
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
            mp = self.measured_after.peak
            line += (f"; measured peak after {format_bytes(mp)}, "
                     + ("fits" if mp <= self.budget else f"OVER by {format_bytes(mp - self.budget)}"))
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
        ab = self.activation_budget()
        if ab is None:
            return None
        acts = self.after.activations
        line = (f"activation budget {format_bytes(ab)}: estimated activations after forward "
                f"{format_bytes(acts)}, " + (f"fits ({format_bytes(ab - acts)} to spare)" if acts <= ab
                                             else f"OVER the activation budget by {format_bytes(acts - ab)}"))
        if self.measured_after is not None:
            ma = self.measured_after.activations
            line += (f"; measured {format_bytes(ma)}, " + ("fits" if ma <= ab else f"OVER by {format_bytes(ma - ab)}"))
        return line

    # ------------------------------------------------------------------------------------------ JSON
    def to_dict(self, deterministic: bool = False) -> dict:
        d = {
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
            d["timing"] = dict(self.timing)
        d = _json_safe(d)
        return _scrub(d) if deterministic else d

    def to_json(self, deterministic: bool = False) -> str:
        return json.dumps(self.to_dict(deterministic), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        """Rebuild a report from `to_dict`/`report.json` (to re-render or compare saved results)."""
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"report schema_version {d.get('schema_version')!r} is not {SCHEMA_VERSION}")

        def est(x, klass):
            if x is None:
                return None
            names = set(klass.__dataclass_fields__)
            kw = {k: v for k, v in x.items() if k in names}
            kw["timeline"] = [TimelinePoint(**p) for p in x.get("timeline", [])]
            if "by_module" in names:
                kw["by_module"] = [(m["module"], m["bytes"]) for m in x.get("by_module", [])]
            return klass(**kw)

        passes = []
        for p in d.get("passes", []):
            kw = {k: v for k, v in p.items() if k in PassRecord.__dataclass_fields__}
            kw["changes"] = [Change(**c) for c in p.get("changes", [])]
            passes.append(PassRecord(**kw))
        m = d.get("measured") or {}
        return cls(model_name=d["model_name"], policy=d["policy"], mode=d["mode"], optimizer=d["optimizer"],
                   before=est(d["estimated"]["before"], MemoryEstimate),
                   after=est(d["estimated"]["after"], MemoryEstimate),
                   measured_before=est(m.get("before"), MemoryProfile),
                   measured_after=est(m.get("after"), MemoryProfile), passes=passes,
                   code_before=d["graph"]["code_before"], code_after=d["graph"]["code_after"],
                   specialized=list(d.get("specialized", [])), notes=list(d.get("notes", [])),
                   budget=d.get("budget"), budget_further=d.get("budget_further"), versions=dict(d.get("versions", {})), timing=dict(d.get("timing", {})))

    @classmethod
    def load(cls, path) -> "Report":
        p = Path(path)
        if p.is_dir():
            p = p / "report.json"
        return cls.from_dict(json.loads(p.read_text()))

    # ------------------------------------------------------------------------------------------ Markdown
    def to_markdown(self, deterministic: bool = False) -> str:
        L: list[str] = []
        L.append(f"# fxmem report: {self.model_name}")
        L.append("")
        L.append(f"mode `{self.mode}`, optimizer `{self.optimizer}`, policy `{self.policy.get('name', '?')}`"
                 + (f", budget {format_bytes(self.budget)}" if self.budget is not None else "")
                 + ". Estimated = fxmem cost model (static, no tensors allocated); measured = real steps "
                   "under `fxmem.measure`.")
        L.append("")
        warn = self._warning_lines()
        if warn:
            L.append("## ⚠ Warnings")
            L.append("")
            L.extend(f"- **{w}**" for w in warn)
            L.append("")
        L.append("## Summary")
        L.append("")
        L.extend(self._summary_table_md())
        L.append("")
        L.extend(f"- {s}" for s in self._summary_facts())
        L.append("")
        L.append("![memory timeline, before vs after](memory_timeline.png)")
        L.append("")
        L.append("## Passes")
        L.append("")
        if not self.passes:
            L.append("No pass ran (the policy enables none).")
            L.append("")
        for rec in self.passes:
            L.extend(self._pass_md(rec))
        L.append("## Graph diff")
        L.append("")
        rows = self.replaced_nodes()
        if rows:
            L.append("Replaced nodes (bytes saved: estimated by the cost model):")
            L.append("")
            L.append("| pass | kind | module | nodes before | nodes after | est. bytes saved |")
            L.append("|---|---|---|---|---|---:|")
            for r in rows:
                L.append(f"| {r['pass']} | {_md(r['kind'])} | `{_md(r['module'])}` | {_md(_nodes(r['nodes_before']))} "
                         f"| {_md(_nodes(r['nodes_after']))} | {format_bytes(r['bytes_saved'])} |")
            L.append("")
        diff = self.graph_diff()
        if diff:
            L.append("```diff")
            L.append(diff)
            L.append("```")
        else:
            L.append("The transformed program's code is identical to the captured one.")
        L.append("")
        if self.specialized or self.notes:
            L.append("## Capture notes")
            L.append("")
            L.extend(f"- static dim: {s}" for s in self.specialized)
            L.extend(f"- {n}" for n in self.notes)
            L.append("")
        L.append("## Policy (resolved)")
        L.append("")
        L.append("```json")
        L.append(json.dumps(_json_safe(self.policy), indent=2, sort_keys=True))
        L.append("```")
        L.append("")
        if self.versions:
            L.append("Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(self.versions.items())) + ".")
            L.append("")
        if not deterministic:
            L.extend(self._timing_md())
        text = "\n".join(L).rstrip("\n") + "\n"
        return _scrub(text) if deterministic else text

    def _warning_lines(self) -> list[str]:
        out = [miss for miss in (self.budget_miss(), self.activation_budget_miss()) if miss]
        out += [f"short of the policy: {line}" for line in self.shortfalls()]
        out += [f"not covered by the policy: {line}" for line in self.not_covered()]
        for r in self.problem_passes():
            what = "was ROLLED BACK" if r.status == "rolled_back" else "FAILED and was rolled back"
            out.append(f"pass `{r.name}` {what}: {r.reason or 'no reason recorded'}")
        unk = self.unknown_ops()
        if unk:
            out.append(f"{len(unk)} op(s) unknown to the cost model (estimated as outputs only, nothing saved "
                       f"for backward): {', '.join(unk)}")
        for tag, e, m in (("before", self.before, self.measured_before), ("after", self.after, self.measured_after)):
            if m is not None and m.peak and abs(e.peak - m.peak) > ESTIMATE_WARN_FRACTION * m.peak:
                out.append(f"the cost model's peak {tag} ({format_bytes(e.peak)}, estimated) is "
                           f"{(e.peak - m.peak) / m.peak * 100:+.1f}% off the measured {format_bytes(m.peak)}: "
                           "plans made from the estimate (checkpoint, offload) may be off")
        return out

    def _summary_table_md(self) -> list[str]:
        head = "| category | before (estimated) | after (estimated) | change |"
        sep = "|---|---:|---:|---:|"
        if self.measured:
            head += " before (measured) | after (measured) | change |"
            sep += "---:|---:|---:|"
        L = [head, sep]
        for row in self.summary_rows():
            b, a = row["estimated_before"], row["estimated_after"]
            label = f"**{row['label']}**" if row["category"] == "peak" else row["label"]
            line = f"| {label} | {format_bytes(b)} | {format_bytes(a)} | {_change(b, a)} |"
            if self.measured:
                b2, a2 = row.get("measured_before"), row.get("measured_after")
                line += f" {format_bytes(b2)} | {format_bytes(a2)} | {_change(b2, a2)} |"
            L.append(line)
        fb = self.before.flops_forward + self.before.flops_backward
        fa = self.after.flops_forward + self.after.flops_backward
        line = f"| FLOPs per step (fwd + bwd) | {_flops(fb)} | {_flops(fa)} | {_change(fb, fa)} |"
        if self.measured:
            line += " - | - | - |"
        L.append(line)
        return L

    def _summary_facts(self) -> list[str]:
        out = []
        for tag, e in (("before", self.before), ("after", self.after)):
            out.append(f"peak {tag} (estimated, {e.method}): {format_bytes(e.peak)} at `{e.peak_at}` "
                       f"({e.peak_phase}" + (f", module `{e.peak_module}`" if e.peak_module else "") + ")")
        for tag, e in (("before", self.measured_before), ("after", self.measured_after)):
            if e is not None:
                out.append(f"peak {tag} (measured): {format_bytes(e.peak)} at `{e.peak_at}` ({e.peak_phase})")
                if getattr(e, "allocator", None):
                    out.append(f"{tag}: {e.allocator_line()}")
        for tag, e, m in (("before", self.before, self.measured_before), ("after", self.after, self.measured_after)):
            if m is not None and m.peak:
                out.append(f"cost model vs measurement, peak {tag}: estimated {format_bytes(e.peak)} vs measured "
                           f"{format_bytes(m.peak)} ({(e.peak - m.peak) / m.peak * 100:+.1f}%)")
        for tag, e in (("before", self.before), ("after", self.after)):
            out.append(f"FLOPs {tag} (estimated): forward {_flops(e.flops_forward)}, "
                       f"backward {_flops(e.flops_backward)}")
        for bl in (self.budget_line(), self.activation_budget_line()):
            if bl:
                out.append(bl)
        for tag, e in (("before", self.before), ("after", self.after)):
            if e.by_module:
                top = ", ".join(f"`{m or '(root)'}` {format_bytes(b)}" for m, b in list(e.by_module)[:5])
                out.append(f"heaviest modules {tag} (estimated bytes saved for backward): {top}")
        return out

    def _pass_md(self, rec) -> list[str]:
        L = [f"### {rec.name}: {STATUS_MARK.get(rec.status, rec.status)}", ""]
        L.append(f"- {'exact' if rec.exact else 'lossy'} pass; {len(rec.changes)} change(s)")
        if rec.reason:
            L.append(f"- **why {rec.status.replace('_', ' ')}:** {rec.reason}")
        if rec.peak_before is not None or rec.peak_after is not None:
            L.append(f"- estimated peak: {format_bytes(rec.peak_before)} → {format_bytes(rec.peak_after)}"
                     + ("" if rec.peak_after is not None else " (not applied)"))
        L.extend(f"- {line}" for line in _deviation_lines(rec) + _guard_lines(rec))
        if rec.changes:
            L.append("")
            L.append("| kind | module | why | est. bytes saved |")
            L.append("|---|---|---|---:|")
            for c in rec.changes:
                L.append(f"| {_md(c.kind)} | `{_md(c.module or '(root)')}` | {_md(c.reason)} "
                         f"| {format_bytes(c.bytes_saved)} |")
        if rec.notes:
            L.append("")
            L.append("Notes:")
            for n in rec.notes:
                n = str(n).rstrip()
                if "\n" in n:
                    L.extend(["", "```", n, "```", ""])
                else:
                    L.append(f"- {n}")
        mlines = _metric_lines(rec.metrics)
        if mlines:
            L.append("")
            L.append("Metrics (reported by the pass; byte counts are its estimates):")
            L.extend(f"  - {m.strip()}" if m.startswith("  ") else f"- {m}" for m in mlines)
        L.append("")
        return L

    def _timing_md(self) -> list[str]:
        L = ["## Timing (wall clock; not part of the deterministic report)", ""]
        for k, v in sorted(self.timing.items()):
            L.append(f"- {k}: {v}")
        L.extend(f"- {_timing_text(r)}" for r in self.passes)
        L.append("")
        return L

    # ------------------------------------------------------------------------------------------ HTML
    def to_html(self, deterministic: bool = False, *, svg: str | None = None) -> str:
        """One self-contained file; `svg` is the already rendered `timeline_svg(self)` (saves a render)."""
        e = html.escape
        P: list[str] = []
        P.append("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">")
        P.append(f"<title>fxmem report: {e(self.model_name)}</title>")
        P.append(f"<style>{_CSS}</style>\n</head>\n<body>")
        P.append(f"<h1>fxmem report: {e(self.model_name)}</h1>")
        P.append(f"<p class=\"meta\">mode <code>{e(self.mode)}</code>, optimizer <code>{e(self.optimizer)}</code>, "
                 f"policy <code>{e(str(self.policy.get('name', '?')))}</code>"
                 + (f", budget {e(format_bytes(self.budget))}" if self.budget is not None else "")
                 + ". <span class=\"est\">estimated</span> = fxmem cost model (static, no tensors allocated); "
                   "<span class=\"meas\">measured</span> = real steps under <code>fxmem.measure</code>.</p>")
        warn = self._warning_lines()
        if warn:
            P.append("<div class=\"warn\" id=\"warnings\"><h2>&#9888; Warnings</h2><ul>")
            P.extend(f"<li>{_inline_code(x)}</li>" for x in warn)
            P.append("</ul></div>")
        P.append("<nav class=\"meta\"><a href=\"#summary\">summary</a> &middot; <a href=\"#timeline\">memory timeline"
                 "</a> &middot; <a href=\"#passes\">passes</a> &middot; <a href=\"#graph-diff\">graph diff</a></nav>")
        P.append("<h2 id=\"summary\">Summary</h2>")
        P.append(self._summary_table_html())
        P.append("<ul class=\"facts\">" + "".join(f"<li>{_inline_code(s)}</li>" for s in self._summary_facts())
                 + "</ul>")
        P.append("<h2 id=\"timeline\">Memory timeline</h2>")
        P.append("<figure class=\"plot\">" + svg_for_html(svg if svg is not None else timeline_svg(self))
                 + "<figcaption>Live bytes during one step, before vs after. Each phase is scaled to the same "
                   "width so phases line up; dashed lines mark the peaks.</figcaption></figure>")
        P.append("<h2 id=\"passes\">Passes</h2>")
        if not self.passes:
            P.append("<p>No pass ran (the policy enables none).</p>")
        for rec in self.passes:
            P.append(self._pass_html(rec))
        P.append("<h2 id=\"graph-diff\">Graph diff</h2>")
        rows = self.replaced_nodes()
        if rows:
            P.append("<p>Replaced nodes (bytes saved: <span class=\"est\">estimated</span>):</p>")
            P.append("<table><tr><th>pass</th><th>kind</th><th>module</th><th>nodes before</th><th>nodes after</th>"
                     "<th>est. bytes saved</th></tr>")
            for r in rows:
                P.append(f"<tr><td>{e(r['pass'])}</td><td>{e(r['kind'])}</td><td><code>{e(r['module'])}</code></td>"
                         f"<td><code>{e(_nodes(r['nodes_before']))}</code></td>"
                         f"<td><code>{e(_nodes(r['nodes_after']))}</code></td>"
                         f"<td class=\"num\">{e(format_bytes(r['bytes_saved']))}</td></tr>")
            P.append("</table>")
        diff = self.graph_diff()
        if diff:
            P.append("<pre class=\"diff\">" + "\n".join(_diff_line_html(x) for x in diff.splitlines()) + "</pre>")
        else:
            P.append("<p>The transformed program's code is identical to the captured one.</p>")
        if self.specialized or self.notes:
            P.append("<h2>Capture notes</h2><ul>")
            P.extend(f"<li>static dim: {e(str(s))}</li>" for s in self.specialized)
            P.extend(f"<li>{e(str(n))}</li>" for n in self.notes)
            P.append("</ul>")
        P.append("<details><summary>Policy (resolved)</summary><pre>"
                 + e(json.dumps(_json_safe(self.policy), indent=2, sort_keys=True)) + "</pre></details>")
        if self.versions:
            P.append("<p class=\"meta\">Versions: "
                     + e(", ".join(f"{k} {v}" for k, v in sorted(self.versions.items()))) + ".</p>")
        if not deterministic:
            P.append("<section id=\"timing\"><h2>Timing (wall clock; not part of the deterministic report)</h2><ul>")
            P.extend(f"<li>{e(str(k))}: {e(str(v))}</li>" for k, v in sorted(self.timing.items()))
            P.extend(f"<li>{e(_timing_text(r))}</li>" for r in self.passes)
            P.append("</ul></section>")
        P.append("</body>\n</html>\n")
        text = "\n".join(P)
        return _scrub(text) if deterministic else text

    def _summary_table_html(self) -> str:
        e = html.escape
        h = ["<table class=\"summary\"><tr><th>category</th><th class=\"est\">before (estimated)</th>"
             "<th class=\"est\">after (estimated)</th><th>change</th>"]
        if self.measured:
            h.append("<th class=\"meas\">before (measured)</th><th class=\"meas\">after (measured)</th>"
                     "<th>change</th>")
        h.append("</tr>")
        for row in self.summary_rows():
            b, a = row["estimated_before"], row["estimated_after"]
            cls = " class=\"peak\"" if row["category"] == "peak" else ""
            h.append(f"<tr{cls}><td>{e(row['label'])}</td><td class=\"num\">{e(format_bytes(b))}</td>"
                     f"<td class=\"num\">{e(format_bytes(a))}</td><td class=\"num\">{e(_change(b, a))}</td>")
            if self.measured:
                b2, a2 = row.get("measured_before"), row.get("measured_after")
                h.append(f"<td class=\"num\">{e(format_bytes(b2))}</td><td class=\"num\">{e(format_bytes(a2))}</td>"
                         f"<td class=\"num\">{e(_change(b2, a2))}</td>")
            h.append("</tr>")
        fb = self.before.flops_forward + self.before.flops_backward
        fa = self.after.flops_forward + self.after.flops_backward
        h.append(f"<tr><td>FLOPs per step (fwd + bwd)</td><td class=\"num\">{_flops(fb)}</td>"
                 f"<td class=\"num\">{_flops(fa)}</td><td class=\"num\">{e(_change(fb, fa))}</td>"
                 + ("<td>-</td><td>-</td><td>-</td>" if self.measured else "") + "</tr>")
        h.append("</table>")
        return "".join(h)

    def _pass_html(self, rec) -> str:
        e = html.escape
        cls = {"rolled_back": "bad", "failed": "bad", "applied": "good"}.get(rec.status, "neutral")
        P = [f"<section class=\"pass {cls}\" id=\"pass-{e(rec.name)}\">"
             f"<h3>{e(rec.name)}: <span class=\"status\">{e(STATUS_MARK.get(rec.status, rec.status))}</span></h3><ul>"]
        P.append(f"<li>{'exact' if rec.exact else 'lossy'} pass; {len(rec.changes)} change(s)</li>")
        if rec.reason:
            P.append(f"<li><strong>why {e(rec.status.replace('_', ' '))}:</strong> {e(rec.reason)}</li>")
        if rec.peak_before is not None or rec.peak_after is not None:
            P.append(f"<li><span class=\"est\">estimated</span> peak: {e(format_bytes(rec.peak_before))} &rarr; "
                     f"{e(format_bytes(rec.peak_after))}{'' if rec.peak_after is not None else ' (not applied)'}</li>")
        P.extend(f"<li>{_inline_code(x)}</li>" for x in _deviation_lines(rec) + _guard_lines(rec))
        P.append("</ul>")
        if rec.changes:
            P.append("<table><tr><th>kind</th><th>module</th><th>why</th><th>est. bytes saved</th></tr>")
            for c in rec.changes:
                P.append(f"<tr><td>{e(c.kind)}</td><td><code>{e(c.module or '(root)')}</code></td>"
                         f"<td>{e(c.reason)}</td><td class=\"num\">{e(format_bytes(c.bytes_saved))}</td></tr>")
            P.append("</table>")
        if rec.notes:
            P.append("<p>Notes:</p><ul>")
            for n in rec.notes:
                n = str(n).rstrip()
                P.append(f"<li><pre>{e(n)}</pre></li>" if "\n" in n else f"<li>{e(n)}</li>")
            P.append("</ul>")
        hsvg = histograms_svg(rec.metrics.get("histograms") if isinstance(rec.metrics, dict) else None,
                              title=f"{rec.name}: coldness per layer")
        if hsvg:
            P.append("<figure class=\"plot\">" + svg_for_html(hsvg) + "<figcaption>Coldness histograms from "
                     "calibration: how many hidden units of each layer fire on what fraction of the calibration "
                     "inputs (units on the left are cold).</figcaption></figure>")
        mlines = _metric_lines(rec.metrics)
        if mlines:
            P.append("<p>Metrics (reported by the pass; byte counts are its estimates):</p><ul class=\"metrics\">"
                     + "".join(f"<li>{_inline_code(m)}</li>" for m in mlines) + "</ul>")
        P.append("</section>")
        return "".join(P)

    # ------------------------------------------------------------------------------------------ files
    def save(self, directory, deterministic: bool = False) -> dict[str, Path]:
        """Write report.md, report.html, report.json, memory_timeline.png and memory_timeline.svg."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": d / "report.md", "html": d / "report.html", "json": d / "report.json",
                 "png": d / "memory_timeline.png", "svg": d / "memory_timeline.svg"}
        svg = timeline_svg(self)
        write_text(paths["markdown"], self.to_markdown(deterministic))
        write_text(paths["html"], self.to_html(deterministic, svg=svg))
        write_text(paths["json"], self.to_json(deterministic))
        write_text(paths["svg"], svg)
        write_bytes(paths["png"], timeline_png(self))
        return paths


# ============================================================================================ helpers

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1200px;margin:24px auto;
padding:0 16px;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:4px}h2{border-bottom:1px solid #ddd;padding-bottom:3px;margin-top:28px}
code,pre{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:0.9em}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3;white-space:nowrap}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.peak td{font-weight:bold}.meta{color:#555}
.est{color:#1f4e8c}.meas{color:#1e7b34}
.warn{border:2px solid #c0392b;background:#fdecea;padding:4px 16px;margin:12px 0;border-radius:4px}
.warn h2{color:#c0392b;border:none;margin-top:8px}
section.pass{border-left:5px solid #bbb;padding:2px 12px;margin:12px 0;background:#fafafa}
section.pass.good{border-color:#2e8b57}section.pass.bad{border-color:#c0392b;background:#fdecea}
section.pass.bad .status{color:#c0392b}
figure.plot{margin:8px 0}figure.plot svg{width:100%;height:auto}
figcaption{color:#555;font-size:0.9em}
pre.diff{background:#f7f7f7;border:1px solid #ddd;padding:8px;overflow-x:auto;white-space:pre}
pre.diff .add{background:#e6ffed;color:#22863a;display:inline-block;min-width:100%}
pre.diff .del{background:#ffeef0;color:#b31d28;display:inline-block;min-width:100%}
pre.diff .hunk{color:#6f42c1}pre.diff .file{color:#555;font-weight:bold}
""".strip().replace("\n", "")


def _diff_line_html(line: str) -> str:
    e = html.escape(line)
    if line.startswith(("+++", "---")):
        return f"<span class=\"file\">{e}</span>"
    if line.startswith("@@"):
        return f"<span class=\"hunk\">{e}</span>"
    if line.startswith("+"):
        return f"<span class=\"add\">{e}</span>"
    if line.startswith("-"):
        return f"<span class=\"del\">{e}</span>"
    return e


def _inline_code(text: str) -> str:
    """Escape, then render `backticks` and **bold** the way the Markdown does."""
    t = html.escape(text, quote=False)
    t = re.sub(r"`([^`]*)`", r"<code>\1</code>", t)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)


def _md(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _nodes(nodes) -> str:
    nodes = [str(n) for n in nodes]
    if len(nodes) > 12:
        return ", ".join(nodes[:12]) + f", … (+{len(nodes) - 12})"
    return ", ".join(nodes) if nodes else "-"


def _change(b, a) -> str:
    if b is None or a is None:
        return "-"
    if b == a:
        return "0"
    if b == 0:
        return "new"
    return f"{(a - b) / b * 100:+.1f}%"


def _flops(n) -> str:
    n = float(n or 0)
    for unit, s in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= s:
            return f"{n / s:.3g} {unit}FLOP"
    return f"{n:.0f} FLOP"


_TIMING_KEY = re.compile(r"(^|_)(seconds|secs|s|time_s|ms)$")


def is_timing_key(key) -> bool:
    """Pass metrics named like `solve_seconds`, `transform_s`, `seconds`, `step_ms` are wall-clock timings: they
    go to the timing section and are left out of the deterministic report."""
    return bool(_TIMING_KEY.search(str(key)))


def _timing_metrics(metrics: dict) -> dict:
    return {str(k): v for k, v in sorted((metrics or {}).items(), key=lambda kv: str(kv[0])) if is_timing_key(k)}


def _num(x) -> str:
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return f"{x:.3g}"
    return str(x)


def _pass_dict(rec, deterministic: bool) -> dict:
    d = rec.to_dict(with_timing=not deterministic)
    if deterministic:
        d["metrics"] = {k: v for k, v in d.get("metrics", {}).items() if not is_timing_key(k)}
        for c in d.get("changes", []):  # e.g. offload's per-region transfer times, from probes of this machine
            if isinstance(c.get("details"), dict):
                c["details"] = {k: v for k, v in c["details"].items() if not is_timing_key(k)}
    return d


def _timing_text(rec) -> str:
    extra = _timing_metrics(rec.metrics)
    return f"pass {rec.name}: {rec.seconds:.3f} s" + (
        " (" + ", ".join(f"{k} {_num(v)}" for k, v in extra.items()) + ")" if extra else "")


def _deviation_lines(rec) -> list[str]:
    out = []
    dev = rec.deviation or {}
    for key, label in (("vs_original", "the original model"), ("vs_previous", "the previous pass")):
        d = dev.get(key)
        if d:
            out.append(f"output deviation vs {label} (measured on the example inputs): max abs "
                       f"{_num(d.get('max_abs'))}, relative {_num(d.get('rel'))}")
    if dev.get("precision"):
        out.append(f"compared in {dev['precision']}")
    g = rec.grad_deviation
    if g:
        if "ok" in g:
            out.append(f"gradients (measured on the example inputs): {g.get('checked', '?')} checked, "
                       + ("equal within tolerance" if g["ok"] else "**differ**"))
        else:
            out.append("gradient deviation (measured): " + json.dumps(_json_safe(g), sort_keys=True))
    t = getattr(rec, "train_check", None)
    if t:
        if t.get("compared"):
            out.append(f"training-mode step (seeded, dropout and checkpoint/offload regions at work, measured): "
                       f"outputs, {t.get('checked', '?')} gradients and buffers "
                       + ("equal to the previous pass's within tolerance" if t.get("ok") else
                          f"**differ**: {t.get('why', '')}"))
        else:
            out.append("training-mode step: " + ("runs" if t.get("ok") else "**fails**") +
                       (f" ({t['why']})" if t.get("why") else ""))
    if not dev and rec.status == "applied":
        out.append("output deviation: not measured (verification disabled)")
    return out


def _guard_lines(rec) -> list[str]:
    """A lossy pass's intents (asked against achieved) and the guard's verdicts on what it kept and was asked."""
    out = [intent_line(rec.name, it, rec.status, rec.reason) for it in rec.intents]
    guard = rec.guard_metrics()
    asked = [v for v in guard.asked if not v.get("accepted")]  # what was asked and accepted is what was kept
    for label, verdicts in (("guard, on what was kept", guard.kept), ("guard, on what was asked", asked)):
        for v in verdicts:
            if v.get("summary"):
                verdict = "accepted" if v.get("accepted") else "refused"
                out.append(f"{label} ({KIND_WORDS.get(v.get('kind'), v.get('kind'))}): {verdict}: {v['summary']}")
    return out


_BYTES_KEY = re.compile(r"(bytes|peak|budget|memory|saved|freed|size)", re.I)
_SPARK = "▁▂▃▄▅▆▇█"


def _sparkline(counts) -> str:
    vals = [float(c) for c in counts]
    top = max(vals) if vals else 0
    if top <= 0:
        return _SPARK[0] * len(vals)
    return "".join(_SPARK[min(len(_SPARK) - 1, int(v / top * (len(_SPARK) - 1) + 0.5))] for v in vals)


def _metric_lines(metrics: dict) -> list[str]:
    """Compact, deterministic lines for a pass's metrics; histograms become sparklines."""
    out = []
    for key in sorted(metrics or {}, key=str):
        if is_timing_key(key) or key in GuardMetrics.KEYS:
            continue  # wall clock: shown in the timing section; the guard's verdicts have their own lines
        val = metrics[key]
        if key == "histograms" and isinstance(val, dict):
            edges = val.get("bin_edges")
            rng = (f" (bins {_num(float(edges[0]))} … {_num(float(edges[-1]))})"
                   if isinstance(edges, (list, tuple)) and len(edges) >= 2 else "")
            out.append(f"histograms{rng}:")
            for layer in sorted((k for k in val if k != "bin_edges"), key=str):
                counts = val[layer]
                if isinstance(counts, (list, tuple)) and counts and all(isinstance(c, (int, float)) for c in counts):
                    out.append(f"  `{layer}` {_sparkline(counts)} (n={_num(sum(counts))})")
            continue
        if isinstance(val, int) and not isinstance(val, bool) and _BYTES_KEY.search(str(key)):
            out.append(f"{key}: {format_bytes(val)} ({val} B)")
        elif isinstance(val, (int, float, str, bool)) or val is None:
            out.append(f"{key}: {_num(val)}")
        else:
            text = json.dumps(_json_safe(val), sort_keys=True)
            out.append(f"{key}: `{text if len(text) <= 300 else text[:297] + '...'}`")
    return out


_ADDRESS = re.compile(r"\b(at|object at) 0x[0-9a-fA-F]{6,}")


def _scrub(x):
    """Deterministic output: object addresses in reprs (`<function f at 0x7f...>`) differ run to run."""
    if isinstance(x, str):
        return _ADDRESS.sub(r"\1 0x...", x)
    if isinstance(x, dict):
        return {k: _scrub(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_scrub(v) for v in x]
    return x


def _json_safe(x):
    """JSON-ready, deterministic: str keys, non-finite floats as strings, tuples as lists, objects via to_dict."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if hasattr(x, "to_dict"):
        return _json_safe(x.to_dict())
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return _json_safe(x.item())
    if hasattr(x, "tolist"):
        return _json_safe(x.tolist())
    return str(x)
