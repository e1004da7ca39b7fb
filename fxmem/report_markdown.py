"""The report as Markdown (report.md): warnings, the summary table and facts, one section per pass, the graph
diff, capture notes, the resolved policy and, unless deterministic, the timing. `report` arguments are
`fxmem.report.Report`s (not imported here: the report imports this module)."""
from __future__ import annotations

import json

from .report_text import (STATUS_MARK, change_text, deviation_lines, flops_text, format_bytes, guard_lines,
                          json_safe, metric_lines, nodes_text, scrub, step_flops, summary_facts, timing_text)


def render_markdown(report, deterministic: bool = False) -> str:
    """The whole report as one Markdown document."""
    lines: list[str] = []
    lines.append(f"# fxmem report: {report.model_name}")
    lines.append("")
    lines.append(f"mode `{report.mode}`, optimizer `{report.optimizer}`, policy `{report.policy.get('name', '?')}`"
                 + (f", budget {format_bytes(report.budget)}" if report.budget is not None else "")
                 + ". Estimated = fxmem cost model (static, no tensors allocated); measured = real steps "
                   "under `fxmem.measure`.")
    lines.append("")
    warnings = report.warning_lines()
    if warnings:
        lines.append("## ⚠ Warnings")
        lines.append("")
        lines.extend(f"- **{warning}**" for warning in warnings)
        lines.append("")
    lines.append("## Summary")
    lines.append("")
    lines.extend(_summary_table(report))
    lines.append("")
    lines.extend(f"- {fact}" for fact in summary_facts(report))
    lines.append("")
    lines.append("![memory timeline, before vs after](memory_timeline.png)")
    lines.append("")
    lines.append("## Passes")
    lines.append("")
    if not report.passes:
        lines.append("No pass ran (the policy enables none).")
        lines.append("")
    for rec in report.passes:
        lines.extend(_pass_section(rec))
    lines.extend(_graph_diff_section(report))
    lines.extend(_closing_sections(report))
    if not deterministic:
        lines.extend(_timing_section(report))
    text = "\n".join(lines).rstrip("\n") + "\n"
    return scrub(text) if deterministic else text


def _cell(text) -> str:
    """Text safe inside a table cell: escaped pipes, no line breaks."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _summary_table(report) -> list[str]:
    head = "| category | before (estimated) | after (estimated) | change |"
    separator = "|---|---:|---:|---:|"
    if report.measured:
        head += " before (measured) | after (measured) | change |"
        separator += "---:|---:|---:|"
    lines = [head, separator]
    for row in report.summary_rows():
        before, after = row["estimated_before"], row["estimated_after"]
        label = f"**{row['label']}**" if row["category"] == "peak" else row["label"]
        line = f"| {label} | {format_bytes(before)} | {format_bytes(after)} | {change_text(before, after)} |"
        if report.measured:
            before, after = row.get("measured_before"), row.get("measured_after")
            line += f" {format_bytes(before)} | {format_bytes(after)} | {change_text(before, after)} |"
        lines.append(line)
    flops_before, flops_after = step_flops(report.before), step_flops(report.after)
    line = (f"| FLOPs per step (fwd + bwd) | {flops_text(flops_before)} | {flops_text(flops_after)} "
            f"| {change_text(flops_before, flops_after)} |")
    if report.measured:
        line += " - | - | - |"
    lines.append(line)
    return lines


def _pass_section(rec) -> list[str]:
    lines = [f"### {rec.name}: {STATUS_MARK.get(rec.status, rec.status)}", ""]
    lines.append(f"- {'exact' if rec.exact else 'lossy'} pass; {len(rec.changes)} change(s)")
    if rec.reason:
        lines.append(f"- **why {rec.status.replace('_', ' ')}:** {rec.reason}")
    if rec.peak_before is not None or rec.peak_after is not None:
        lines.append(f"- estimated peak: {format_bytes(rec.peak_before)} → {format_bytes(rec.peak_after)}"
                     + ("" if rec.peak_after is not None else " (not applied)"))
    lines.extend(f"- {line}" for line in deviation_lines(rec) + guard_lines(rec))
    if rec.changes:
        lines.append("")
        lines.append("| kind | module | why | est. bytes saved |")
        lines.append("|---|---|---|---:|")
        for change in rec.changes:
            lines.append(f"| {_cell(change.kind)} | `{_cell(change.module or '(root)')}` | {_cell(change.reason)} "
                         f"| {format_bytes(change.bytes_saved)} |")
    if rec.notes:
        lines.append("")
        lines.append("Notes:")
        for note in rec.notes:
            note = str(note).rstrip()
            if "\n" in note:
                lines.extend(["", "```", note, "```", ""])
            else:
                lines.append(f"- {note}")
    metrics = metric_lines(rec.metrics)
    if metrics:
        lines.append("")
        lines.append("Metrics (reported by the pass; byte counts are its estimates):")
        lines.extend(f"  - {m.strip()}" if m.startswith("  ") else f"- {m}" for m in metrics)
    lines.append("")
    return lines


def _graph_diff_section(report) -> list[str]:
    lines = ["## Graph diff", ""]
    rows = report.replaced_nodes()
    if rows:
        lines.append("Replaced nodes (bytes saved: estimated by the cost model):")
        lines.append("")
        lines.append("| pass | kind | module | nodes before | nodes after | est. bytes saved |")
        lines.append("|---|---|---|---|---|---:|")
        for row in rows:
            lines.append(f"| {row['pass']} | {_cell(row['kind'])} | `{_cell(row['module'])}` "
                         f"| {_cell(nodes_text(row['nodes_before']))} "
                         f"| {_cell(nodes_text(row['nodes_after']))} | {format_bytes(row['bytes_saved'])} |")
        lines.append("")
    diff = report.graph_diff()
    if diff:
        lines.extend(["```diff", diff, "```"])
    else:
        lines.append("The transformed program's code is identical to the captured one.")
    lines.append("")
    return lines


def _closing_sections(report) -> list[str]:
    """Capture notes, the resolved policy, versions."""
    lines = []
    if report.specialized or report.notes:
        lines.extend(["## Capture notes", ""])
        lines.extend(f"- static dim: {dim}" for dim in report.specialized)
        lines.extend(f"- {note}" for note in report.notes)
        lines.append("")
    lines.extend(["## Policy (resolved)", "", "```json",
                  json.dumps(json_safe(report.policy), indent=2, sort_keys=True), "```", ""])
    if report.versions:
        lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(report.versions.items())) + ".")
        lines.append("")
    return lines


def _timing_section(report) -> list[str]:
    lines = ["## Timing (wall clock; not part of the deterministic report)", ""]
    for key, value in sorted(report.timing.items()):
        lines.append(f"- {key}: {value}")
    lines.extend(f"- {timing_text(rec)}" for rec in report.passes)
    lines.append("")
    return lines
