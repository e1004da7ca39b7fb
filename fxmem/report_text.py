"""Text pieces that the report's JSON, Markdown and HTML share: numbers, byte sizes, FLOPs and changes as short
text; a pass's deviation, guard, metric and timing lines; the summary facts; JSON-safe values and the scrubbing
that makes deterministic output deterministic. Functions that take a `report` take an `fxmem.report.Report`
(not imported here: the report imports this module)."""
from __future__ import annotations

import json
import math
import re

from .intent import intent_line
from .lossguard import KIND_WORDS
from .pass_api import GuardMetrics
from .units import format_bytes as _unit_bytes

STATUS_MARK = {"applied": "applied", "unchanged": "unchanged", "rolled_back": "ROLLED BACK", "failed": "FAILED"}


def format_bytes(num_bytes) -> str:
    """`fxmem.units.format_bytes`, with '-' for a missing value."""
    return "-" if num_bytes is None else _unit_bytes(int(num_bytes))


def nodes_text(nodes) -> str:
    """Node names, comma separated; past twelve, the first twelve and how many more."""
    nodes = [str(n) for n in nodes]
    if len(nodes) > 12:
        return ", ".join(nodes[:12]) + f", … (+{len(nodes) - 12})"
    return ", ".join(nodes) if nodes else "-"


def change_text(before, after) -> str:
    """The relative change from `before` to `after` ('+12.5%', '0', 'new', '-' when one is missing)."""
    if before is None or after is None:
        return "-"
    if before == after:
        return "0"
    if before == 0:
        return "new"
    return f"{(after - before) / before * 100:+.1f}%"


def flops_text(count) -> str:
    count = float(count or 0)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}FLOP"
    return f"{count:.0f} FLOP"


def number_text(value) -> str:
    """Floats to three significant digits (inf and nan as such), anything else as str."""
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return f"{value:.3g}"
    return str(value)


_TIMING_KEY = re.compile(r"(^|_)(seconds|secs|s|time_s|ms)$")


def is_timing_key(key) -> bool:
    """Pass metrics named like `solve_seconds`, `transform_s`, `seconds`, `step_ms` are wall-clock timings: they
    go to the timing section and are left out of the deterministic report."""
    return bool(_TIMING_KEY.search(str(key)))


def timing_metrics(metrics: dict) -> dict:
    """The wall-clock entries of a pass's metrics, sorted by key."""
    return {str(k): v for k, v in sorted((metrics or {}).items(), key=lambda kv: str(kv[0])) if is_timing_key(k)}


def timing_text(rec) -> str:
    """One line: how long a pass took, with its own timing metrics."""
    extra = timing_metrics(rec.metrics)
    return f"pass {rec.name}: {rec.seconds:.3f} s" + (
        " (" + ", ".join(f"{k} {number_text(v)}" for k, v in extra.items()) + ")" if extra else "")


def deviation_lines(rec) -> list[str]:
    """What verification measured for a pass: output deviation, gradients, the training-mode step."""
    out = []
    deviation = rec.deviation or {}
    for key, label in (("vs_original", "the original model"), ("vs_previous", "the previous pass")):
        measured = deviation.get(key)
        if measured:
            out.append(f"output deviation vs {label} (measured on the example inputs): max abs "
                       f"{number_text(measured.get('max_abs'))}, relative {number_text(measured.get('rel'))}")
    if deviation.get("precision"):
        out.append(f"compared in {deviation['precision']}")
    out.extend(_gradient_lines(rec.grad_deviation))
    out.extend(_train_check_lines(getattr(rec, "train_check", None)))
    if not deviation and rec.status == "applied":
        out.append("output deviation: not measured (verification disabled)")
    return out


def _gradient_lines(grad_deviation) -> list[str]:
    if not grad_deviation:
        return []
    if "ok" in grad_deviation:
        return [f"gradients (measured on the example inputs): {grad_deviation.get('checked', '?')} checked, "
                + ("equal within tolerance" if grad_deviation["ok"] else "**differ**")]
    return ["gradient deviation (measured): " + json.dumps(json_safe(grad_deviation), sort_keys=True)]


def _train_check_lines(train_check) -> list[str]:
    if not train_check:
        return []
    if train_check.get("compared"):
        return [f"training-mode step (seeded, dropout and checkpoint/offload regions at work, measured): "
                f"outputs, {train_check.get('checked', '?')} gradients and buffers "
                + ("equal to the previous pass's within tolerance" if train_check.get("ok") else
                   f"**differ**: {train_check.get('why', '')}")]
    return ["training-mode step: " + ("runs" if train_check.get("ok") else "**fails**") +
            (f" ({train_check['why']})" if train_check.get("why") else "")]


def guard_lines(rec) -> list[str]:
    """A lossy pass's intents (asked against achieved) and the guard's verdicts on what it kept and was asked."""
    out = [intent_line(rec.name, intent, rec.status, rec.reason) for intent in rec.intents]
    guard = rec.guard_metrics()
    asked = [v for v in guard.asked if not v.get("accepted")]  # what was asked and accepted is what was kept
    for label, verdicts in (("guard, on what was kept", guard.kept), ("guard, on what was asked", asked)):
        for verdict in verdicts:
            if verdict.get("summary"):
                word = "accepted" if verdict.get("accepted") else "refused"
                kind = KIND_WORDS.get(verdict.get("kind"), verdict.get("kind"))
                out.append(f"{label} ({kind}): {word}: {verdict['summary']}")
    return out


_BYTES_KEY = re.compile(r"(bytes|peak|budget|memory|saved|freed|size)", re.I)
_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(counts) -> str:
    """Counts as a row of block characters, the largest a full block."""
    values = [float(c) for c in counts]
    top = max(values) if values else 0
    if top <= 0:
        return _SPARK[0] * len(values)
    return "".join(_SPARK[min(len(_SPARK) - 1, int(v / top * (len(_SPARK) - 1) + 0.5))] for v in values)


def metric_lines(metrics: dict) -> list[str]:
    """Compact, deterministic lines for a pass's metrics; histograms become sparklines."""
    out = []
    for key in sorted(metrics or {}, key=str):
        if is_timing_key(key) or key in GuardMetrics.KEYS:
            continue  # wall clock: shown in the timing section; the guard's verdicts have their own lines
        value = metrics[key]
        if key == "histograms" and isinstance(value, dict):
            out.extend(_histogram_lines(value))
        elif isinstance(value, int) and not isinstance(value, bool) and _BYTES_KEY.search(str(key)):
            out.append(f"{key}: {format_bytes(value)} ({value} B)")
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out.append(f"{key}: {number_text(value)}")
        else:
            text = json.dumps(json_safe(value), sort_keys=True)
            out.append(f"{key}: `{text if len(text) <= 300 else text[:297] + '...'}`")
    return out


def _histogram_lines(histograms: dict) -> list[str]:
    edges = histograms.get("bin_edges")
    bins = (f" (bins {number_text(float(edges[0]))} … {number_text(float(edges[-1]))})"
            if isinstance(edges, (list, tuple)) and len(edges) >= 2 else "")
    out = [f"histograms{bins}:"]
    for layer in sorted((k for k in histograms if k != "bin_edges"), key=str):
        counts = histograms[layer]
        if isinstance(counts, (list, tuple)) and counts and all(isinstance(c, (int, float)) for c in counts):
            out.append(f"  `{layer}` {sparkline(counts)} (n={number_text(sum(counts))})")
    return out


def summary_facts(report) -> list[str]:
    """The lines under the summary table: peaks and where, cost model against measurement, FLOPs, budgets,
    the heaviest modules."""
    pairs = (("before", report.before, report.measured_before), ("after", report.after, report.measured_after))
    out = []
    for tag, estimate, _ in pairs:
        out.append(f"peak {tag} (estimated, {estimate.method}): {format_bytes(estimate.peak)} at "
                   f"`{estimate.peak_at}` ({estimate.peak_phase}"
                   + (f", module `{estimate.peak_module}`" if estimate.peak_module else "") + ")")
    for tag, _, measured in pairs:
        if measured is not None:
            out.append(f"peak {tag} (measured): {format_bytes(measured.peak)} at `{measured.peak_at}` "
                       f"({measured.peak_phase})")
            if getattr(measured, "allocator", None):
                out.append(f"{tag}: {measured.allocator_line()}")
    for tag, estimate, measured in pairs:
        if measured is not None and measured.peak:
            out.append(f"cost model vs measurement, peak {tag}: estimated {format_bytes(estimate.peak)} vs measured "
                       f"{format_bytes(measured.peak)} ({(estimate.peak - measured.peak) / measured.peak * 100:+.1f}%)")
    for tag, estimate, _ in pairs:
        out.append(f"FLOPs {tag} (estimated): forward {flops_text(estimate.flops_forward)}, "
                   f"backward {flops_text(estimate.flops_backward)}")
    out.extend(line for line in (report.budget_line(), report.activation_budget_line()) if line)
    for tag, estimate, _ in pairs:
        if estimate.by_module:
            top = ", ".join(f"`{m or '(root)'}` {format_bytes(b)}" for m, b in list(estimate.by_module)[:5])
            out.append(f"heaviest modules {tag} (estimated bytes saved for backward): {top}")
    return out


def step_flops(estimate) -> int:
    """Estimated FLOPs of one step: forward plus backward."""
    return estimate.flops_forward + estimate.flops_backward


_ADDRESS = re.compile(r"\b(at|object at) 0x[0-9a-fA-F]{6,}")


def scrub(value):
    """Deterministic output: object addresses in reprs (`<function f at 0x7f...>`) differ run to run."""
    if isinstance(value, str):
        return _ADDRESS.sub(r"\1 0x...", value)
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def json_safe(value):
    """JSON-ready, deterministic: str keys, non-finite floats as strings, tuples as lists, objects via to_dict."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "to_dict"):
        return json_safe(value.to_dict())
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return json_safe(value.item())
    if hasattr(value, "tolist"):
        return json_safe(value.tolist())
    return str(value)
