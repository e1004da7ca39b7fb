"""The report's plots: the memory timeline before and after (estimated and measured, with the budget), as SVG
for the HTML report and PNG beside it, and the pruning pass's coldness histograms. matplotlib is imported only
to draw. `report` arguments are `fxmem.report.Report`s (not imported here: the report imports this module)."""
from __future__ import annotations

import io
import re

from .units import format_bytes


def _points(timeline) -> list[tuple[str, str, int, int]]:
    out = []
    for point in timeline or []:
        if isinstance(point, dict):
            out.append((point["phase"], point["label"], int(point["live"]), int(point["peak"])))
        else:
            out.append((point.phase, point.label, int(point.live), int(point.peak)))
    return out


PHASES = ("forward", "backward", "optimizer")
MAX_POINTS_PER_PHASE = 1500


def _phases(*timelines) -> list[str]:
    """Phases present, canonical ones first in step order, any others in order of appearance."""
    seen: list[str] = []
    for timeline in timelines:
        for phase, *_ in _points(timeline):
            if phase not in seen:
                seen.append(phase)
    return [p for p in PHASES if p in seen] + [p for p in seen if p not in PHASES]


def _series(timeline, phases: list[str]) -> tuple[list[float], list[int]]:
    """x in phase units (phase k spans [k, k+1], so before and after line up phase by phase; each op gets an equal
    share of its phase and the phase ends with a closing point at k+1), y = the most bytes live during each op.
    Long timelines (measured: one point per aten op) keep the max per bucket, so no spike is lost."""
    groups: dict[int, list[int]] = {}
    for phase, _label, live, peak in _points(timeline):
        groups.setdefault(phases.index(phase), []).append(max(live, peak))
    x_values: list[float] = []
    y_values: list[int] = []
    for phase_index in sorted(groups):
        vals = groups[phase_index]
        if len(vals) > MAX_POINTS_PER_PHASE:
            count = len(vals)
            vals = [max(vals[i * count // MAX_POINTS_PER_PHASE:(i + 1) * count // MAX_POINTS_PER_PHASE])
                    for i in range(MAX_POINTS_PER_PHASE)]
        count = len(vals)
        for position, value in enumerate(vals):
            x_values.append(phase_index + position / count)
            y_values.append(value)
        x_values.append(phase_index + 1.0)  # op i spans [k + i/n, k + (i+1)/n] (drawn with steps-post)
        y_values.append(vals[-1])
    return x_values, y_values


def _unit(maxval: int) -> tuple[str, float]:
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if maxval >= scale:
            return unit, float(scale)
    return "B", 1.0


_BEFORE, _AFTER, _BUDGET = "#3b6fb6", "#2e9a5a", "#c0392b"


def timeline_figure(report):
    """A matplotlib Figure (Agg canvas, no pyplot state): estimated timeline before vs after, and the measured
    one in a second panel when the run was measured."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    panels = [("estimated (cost model, static)", report.before, report.after)]
    if report.measured:
        panels.append(("measured (fxmem.measure, real step)", report.measured_before, report.measured_after))
    fig = Figure(figsize=(10, 3.6 * len(panels) + 0.4), dpi=100)
    FigureCanvasAgg(fig)
    values = [report.budget or 0]
    for _title, before, after in panels:
        for estimate in (before, after):
            if estimate is not None:
                values.append(estimate.peak)
                values.extend(max(p[2], p[3]) for p in _points(estimate.timeline))
    unit, scale = _unit(max(values))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for axis, (title, before, after) in zip(axes, panels):
        phases = _phases(*(e.timeline for e in (before, after) if e is not None)) or ["forward"]
        for estimate, color, tag in ((before, _BEFORE, "before"), (after, _AFTER, "after")):
            if estimate is None:
                continue
            x_values, y_values = _series(estimate.timeline, phases)
            if x_values:
                axis.plot(x_values, [y / scale for y in y_values], color=color, lw=1.6, drawstyle="steps-post",
                          label=f"{tag}: peak {format_bytes(estimate.peak)}")
            axis.axhline(estimate.peak / scale, color=color, lw=1, ls="--", alpha=0.8)
        if report.budget is not None:
            axis.axhline(report.budget / scale, color=_BUDGET, lw=1.2, ls=":",
                         label=f"budget {format_bytes(report.budget)}")
        for boundary in range(1, len(phases)):
            axis.axvline(boundary, color="#999999", lw=0.8)
        axis.set_xlim(0, len(phases))
        axis.set_ylim(bottom=0)
        axis.set_xticks([k + 0.5 for k in range(len(phases))])
        axis.set_xticklabels(phases)
        axis.set_ylabel(f"live memory ({unit})")
        axis.set_title(f"{report.model_name}: memory during one {report.mode} step, {title}", fontsize=11)
        axis.grid(axis="y", alpha=0.3)
        axis.legend(loc="upper left", fontsize=9, frameon=False)
    fig.tight_layout()
    return fig


def _render(report, fmt: str) -> bytes:
    import matplotlib  # (heavy: loaded only to draw)
    with matplotlib.rc_context({"svg.hashsalt": "fxmem-report", "svg.fonttype": "path",
                                "font.family": "DejaVu Sans"}):
        fig = timeline_figure(report)
        buf = io.BytesIO()
        meta = {"Date": None} if fmt == "svg" else {"Software": None}
        fig.savefig(buf, format=fmt, metadata=meta)
    return buf.getvalue()


def histograms_svg(hist, title: str = "coldness per layer", max_layers: int = 24) -> str | None:
    """Small multiples of per-layer histograms ({"bin_edges": [...], layer: counts}) as deterministic SVG text;
    None when there is nothing to draw. Layers past `max_layers` are left out (the metrics list keeps them all)."""
    if not isinstance(hist, dict):
        return None
    edges = hist.get("bin_edges")
    layers = [(k, v) for k, v in hist.items() if k != "bin_edges" and isinstance(v, (list, tuple)) and v
              and all(isinstance(c, (int, float)) for c in v)]
    if not layers or not isinstance(edges, (list, tuple)) or len(edges) < 2:
        return None
    shown = layers[:max_layers]
    import matplotlib  # (heavy: loaded only to draw)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(4, len(shown))
    rows = (len(shown) + cols - 1) // cols
    with matplotlib.rc_context({"svg.hashsalt": "fxmem-report", "svg.fonttype": "path",
                                "font.family": "DejaVu Sans"}):
        fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 1.9 * rows + 0.5), squeeze=False)
        for axis in axes.flat[len(shown):]:
            axis.axis("off")
        for axis, (name, counts) in zip(axes.flat, shown):
            left_edges = [float(x) for x in edges[:-1]][:len(counts)]
            width = [float(b) - float(a) for a, b in zip(edges[:-1], edges[1:])][:len(counts)]
            axis.bar(left_edges, counts, width=width, align="edge", color="#1f4e8c", edgecolor="white", linewidth=0.5)
            axis.set_title(str(name) if len(str(name)) <= 34 else "…" + str(name)[-33:], fontsize=8)
            axis.tick_params(labelsize=7)
            axis.set_xlim(float(edges[0]), float(edges[-1]))
        for axis in axes[-1]:
            axis.set_xlabel("firing frequency", fontsize=7)
        for axis in axes[:, 0]:
            axis.set_ylabel("hidden units", fontsize=7)
        more = f" (first {len(shown)} of {len(layers)} layers)" if len(layers) > len(shown) else ""
        fig.suptitle(title + more, fontsize=10)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        plt.close(fig)
    return buf.getvalue().decode("utf-8")


def timeline_svg(report) -> str:
    """The timeline plot as SVG text, byte-for-byte deterministic (fixed hash salt, no date)."""
    return _render(report, "svg").decode("utf-8")


def timeline_png(report) -> bytes:
    return _render(report, "png")


def svg_for_html(svg: str) -> str:
    """Inline SVG for HTML5: no XML prolog, no RDF metadata, no namespace URIs (the HTML parser puts inline
    <svg> and xlink:href in the right namespaces), so the file holds no external URL at all."""
    svg = re.sub(r"<\?xml[^>]*\?>\s*", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>\s*", "", svg)
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    return svg.strip()


