"""The report as one self-contained HTML file (report.html): the Markdown's content with the memory timeline
inline as SVG, styled sections per pass and a coloured graph diff. `report` arguments are
`fxmem.report.Report`s (not imported here: the report imports this module)."""
from __future__ import annotations

import html
import json
import re

from .report_plots import histograms_svg, svg_for_html, timeline_svg
from .report_text import (STATUS_MARK, change_text, deviation_lines, flops_text, format_bytes, guard_lines,
                          json_safe, metric_lines, nodes_text, scrub, step_flops, summary_facts, timing_text)

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


def render_html(report, deterministic: bool = False, *, svg: str | None = None) -> str:
    """One self-contained file; `svg` is the already rendered `timeline_svg(report)` (saves a render)."""
    escape = html.escape
    parts: list[str] = []
    parts.append("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">")
    parts.append(f"<title>fxmem report: {escape(report.model_name)}</title>")
    parts.append(f"<style>{_CSS}</style>\n</head>\n<body>")
    parts.append(f"<h1>fxmem report: {escape(report.model_name)}</h1>")
    parts.append(f"<p class=\"meta\">mode <code>{escape(report.mode)}</code>, optimizer "
                 f"<code>{escape(report.optimizer)}</code>, "
                 f"policy <code>{escape(str(report.policy.get('name', '?')))}</code>"
                 + (f", budget {escape(format_bytes(report.budget))}" if report.budget is not None else "")
                 + ". <span class=\"est\">estimated</span> = fxmem cost model (static, no tensors allocated); "
                   "<span class=\"meas\">measured</span> = real steps under <code>fxmem.measure</code>.</p>")
    warnings = report.warning_lines()
    if warnings:
        parts.append("<div class=\"warn\" id=\"warnings\"><h2>&#9888; Warnings</h2><ul>")
        parts.extend(f"<li>{_inline_code(warning)}</li>" for warning in warnings)
        parts.append("</ul></div>")
    parts.append("<nav class=\"meta\"><a href=\"#summary\">summary</a> &middot; <a href=\"#timeline\">memory "
                 "timeline</a> &middot; <a href=\"#passes\">passes</a> &middot; <a href=\"#graph-diff\">graph diff"
                 "</a></nav>")
    parts.append("<h2 id=\"summary\">Summary</h2>")
    parts.append(_summary_table(report))
    parts.append("<ul class=\"facts\">" + "".join(f"<li>{_inline_code(fact)}</li>" for fact in summary_facts(report))
                 + "</ul>")
    parts.append("<h2 id=\"timeline\">Memory timeline</h2>")
    parts.append("<figure class=\"plot\">" + svg_for_html(svg if svg is not None else timeline_svg(report))
                 + "<figcaption>Live bytes during one step, before vs after. Each phase is scaled to the same "
                   "width so phases line up; dashed lines mark the peaks.</figcaption></figure>")
    parts.append("<h2 id=\"passes\">Passes</h2>")
    if not report.passes:
        parts.append("<p>No pass ran (the policy enables none).</p>")
    for rec in report.passes:
        parts.append(_pass_section(rec))
    parts.extend(_graph_diff_section(report))
    parts.extend(_closing_sections(report))
    if not deterministic:
        parts.extend(_timing_section(report))
    parts.append("</body>\n</html>\n")
    text = "\n".join(parts)
    return scrub(text) if deterministic else text


def _diff_line(line: str) -> str:
    """One line of a unified diff, escaped and classed by what it is."""
    escaped = html.escape(line)
    if line.startswith(("+++", "---")):
        return f"<span class=\"file\">{escaped}</span>"
    if line.startswith("@@"):
        return f"<span class=\"hunk\">{escaped}</span>"
    if line.startswith("+"):
        return f"<span class=\"add\">{escaped}</span>"
    if line.startswith("-"):
        return f"<span class=\"del\">{escaped}</span>"
    return escaped


def _inline_code(text: str) -> str:
    """Escape, then render `backticks` and **bold** the way the Markdown does."""
    escaped = html.escape(text, quote=False)
    escaped = re.sub(r"`([^`]*)`", r"<code>\1</code>", escaped)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", escaped)


def _summary_table(report) -> str:
    escape = html.escape
    cells = ["<table class=\"summary\"><tr><th>category</th><th class=\"est\">before (estimated)</th>"
             "<th class=\"est\">after (estimated)</th><th>change</th>"]
    if report.measured:
        cells.append("<th class=\"meas\">before (measured)</th><th class=\"meas\">after (measured)</th>"
                     "<th>change</th>")
    cells.append("</tr>")
    for row in report.summary_rows():
        before, after = row["estimated_before"], row["estimated_after"]
        peak_class = " class=\"peak\"" if row["category"] == "peak" else ""
        cells.append(f"<tr{peak_class}><td>{escape(row['label'])}</td>"
                     f"<td class=\"num\">{escape(format_bytes(before))}</td>"
                     f"<td class=\"num\">{escape(format_bytes(after))}</td>"
                     f"<td class=\"num\">{escape(change_text(before, after))}</td>")
        if report.measured:
            before, after = row.get("measured_before"), row.get("measured_after")
            cells.append(f"<td class=\"num\">{escape(format_bytes(before))}</td>"
                         f"<td class=\"num\">{escape(format_bytes(after))}</td>"
                         f"<td class=\"num\">{escape(change_text(before, after))}</td>")
        cells.append("</tr>")
    flops_before, flops_after = step_flops(report.before), step_flops(report.after)
    cells.append(f"<tr><td>FLOPs per step (fwd + bwd)</td><td class=\"num\">{flops_text(flops_before)}</td>"
                 f"<td class=\"num\">{flops_text(flops_after)}</td>"
                 f"<td class=\"num\">{escape(change_text(flops_before, flops_after))}</td>"
                 + ("<td>-</td><td>-</td><td>-</td>" if report.measured else "") + "</tr>")
    cells.append("</table>")
    return "".join(cells)


def _pass_section(rec) -> str:
    escape = html.escape
    status_class = {"rolled_back": "bad", "failed": "bad", "applied": "good"}.get(rec.status, "neutral")
    parts = [f"<section class=\"pass {status_class}\" id=\"pass-{escape(rec.name)}\">"
             f"<h3>{escape(rec.name)}: <span class=\"status\">{escape(STATUS_MARK.get(rec.status, rec.status))}"
             f"</span></h3><ul>"]
    parts.append(f"<li>{'exact' if rec.exact else 'lossy'} pass; {len(rec.changes)} change(s)</li>")
    if rec.reason:
        parts.append(f"<li><strong>why {escape(rec.status.replace('_', ' '))}:</strong> {escape(rec.reason)}</li>")
    if rec.peak_before is not None or rec.peak_after is not None:
        parts.append(f"<li><span class=\"est\">estimated</span> peak: {escape(format_bytes(rec.peak_before))} "
                     f"&rarr; {escape(format_bytes(rec.peak_after))}"
                     f"{'' if rec.peak_after is not None else ' (not applied)'}</li>")
    parts.extend(f"<li>{_inline_code(line)}</li>" for line in deviation_lines(rec) + guard_lines(rec))
    parts.append("</ul>")
    if rec.changes:
        parts.append("<table><tr><th>kind</th><th>module</th><th>why</th><th>est. bytes saved</th></tr>")
        for change in rec.changes:
            parts.append(f"<tr><td>{escape(change.kind)}</td><td><code>{escape(change.module or '(root)')}</code>"
                         f"</td><td>{escape(change.reason)}</td>"
                         f"<td class=\"num\">{escape(format_bytes(change.bytes_saved))}</td></tr>")
        parts.append("</table>")
    if rec.notes:
        parts.append("<p>Notes:</p><ul>")
        for note in rec.notes:
            note = str(note).rstrip()
            parts.append(f"<li><pre>{escape(note)}</pre></li>" if "\n" in note else f"<li>{escape(note)}</li>")
        parts.append("</ul>")
    parts.extend(_pass_plots_and_metrics(rec))
    parts.append("</section>")
    return "".join(parts)


def _pass_plots_and_metrics(rec) -> list[str]:
    """A pass's coldness histograms (pruning) as a plot and its metrics as a list."""
    parts = []
    histograms = histograms_svg(rec.metrics.get("histograms") if isinstance(rec.metrics, dict) else None,
                                title=f"{rec.name}: coldness per layer")
    if histograms:
        parts.append("<figure class=\"plot\">" + svg_for_html(histograms) + "<figcaption>Coldness histograms from "
                     "calibration: how many hidden units of each layer fire on what fraction of the calibration "
                     "inputs (units on the left are cold).</figcaption></figure>")
    metrics = metric_lines(rec.metrics)
    if metrics:
        parts.append("<p>Metrics (reported by the pass; byte counts are its estimates):</p><ul class=\"metrics\">"
                     + "".join(f"<li>{_inline_code(m)}</li>" for m in metrics) + "</ul>")
    return parts


def _graph_diff_section(report) -> list[str]:
    escape = html.escape
    parts = ["<h2 id=\"graph-diff\">Graph diff</h2>"]
    rows = report.replaced_nodes()
    if rows:
        parts.append("<p>Replaced nodes (bytes saved: <span class=\"est\">estimated</span>):</p>")
        parts.append("<table><tr><th>pass</th><th>kind</th><th>module</th><th>nodes before</th><th>nodes after</th>"
                     "<th>est. bytes saved</th></tr>")
        for row in rows:
            parts.append(f"<tr><td>{escape(row['pass'])}</td><td>{escape(row['kind'])}</td>"
                         f"<td><code>{escape(row['module'])}</code></td>"
                         f"<td><code>{escape(nodes_text(row['nodes_before']))}</code></td>"
                         f"<td><code>{escape(nodes_text(row['nodes_after']))}</code></td>"
                         f"<td class=\"num\">{escape(format_bytes(row['bytes_saved']))}</td></tr>")
        parts.append("</table>")
    diff = report.graph_diff()
    if diff:
        parts.append("<pre class=\"diff\">" + "\n".join(_diff_line(line) for line in diff.splitlines()) + "</pre>")
    else:
        parts.append("<p>The transformed program's code is identical to the captured one.</p>")
    return parts


def _closing_sections(report) -> list[str]:
    """Capture notes, the resolved policy, versions."""
    escape = html.escape
    parts = []
    if report.specialized or report.notes:
        parts.append("<h2>Capture notes</h2><ul>")
        parts.extend(f"<li>static dim: {escape(str(dim))}</li>" for dim in report.specialized)
        parts.extend(f"<li>{escape(str(note))}</li>" for note in report.notes)
        parts.append("</ul>")
    parts.append("<details><summary>Policy (resolved)</summary><pre>"
                 + escape(json.dumps(json_safe(report.policy), indent=2, sort_keys=True)) + "</pre></details>")
    if report.versions:
        parts.append("<p class=\"meta\">Versions: "
                     + escape(", ".join(f"{k} {v}" for k, v in sorted(report.versions.items()))) + ".</p>")
    return parts


def _timing_section(report) -> list[str]:
    escape = html.escape
    parts = ["<section id=\"timing\"><h2>Timing (wall clock; not part of the deterministic report)</h2><ul>"]
    parts.extend(f"<li>{escape(str(key))}: {escape(str(value))}</li>" for key, value in sorted(report.timing.items()))
    parts.extend(f"<li>{escape(timing_text(rec))}</li>" for rec in report.passes)
    parts.append("</ul></section>")
    return parts
