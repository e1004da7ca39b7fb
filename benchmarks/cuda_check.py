"""The CUDA check (issue 34): the `cuda`-marked tests, then short measurements, in one command on one GPU.

    python benchmarks/cuda_check.py              # everything, under --time-limit (default 540 s)
    python benchmarks/cuda_check.py --quick      # a subset of the tests, the smallest measurements
    python benchmarks/cuda_check.py --max-n 32768 --time-limit 580

Without a CUDA device it prints "no CUDA device" and exits 2, writing nothing. Otherwise it runs
`pytest -m cuda` in a subprocess (given the time left after the measurements' share; what has not run when that
ends is listed as such), then `cuda_measure`'s tables while time is left, and writes
benchmarks/results/cuda_check.md: the device, torch / CUDA / cuDNN / bitsandbytes versions, every test's outcome
and time (failures with the end of their message), and the tables. The whole pytest output goes to
benchmarks/results/cuda_check.log. Exit status: 0 when every selected test passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# --quick leaves out these (the same checks run on the examples kept, and in bf16)
QUICK_DESELECT = [f"tests/test_cuda_low.py::test_low_is_exact_on_cuda[{name}]"
                  for name in ("gat", "gcn", "gnn_stan", "hf_bert", "hf_llama", "mlp_digits", "vit")] + \
                 [f"tests/test_cuda_attention.py::{test}[{case}-fp16]" for test, cases in (
                     ("test_sdpa_sites_report_and_run_a_fused_kernel", ("gpt", "gpt-dropout", "hf_gpt2")),
                     ("test_sdpa_rewrite_matches_manual_attention_in_half_precision", ("gpt", "hf_gpt2")))
                  for case in cases]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tests and measurements")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--max-n", type=int, default=16384, help="longest attention sequence (from 4096, doubling)")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per measurement (median)")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    started = time.monotonic()
    measure_share = 90.0 if a.quick else 150.0
    tests = run_tests(a.quick, a.time_limit - measure_share)
    from cuda_measure import Deadline
    tables = measurements(a, Deadline(a.time_limit - (time.monotonic() - started)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = report(a, tests, tables, time.monotonic() - started)
    (RESULTS / "cuda_check.md").write_text(text)
    print(f"wrote {RESULTS / 'cuda_check.md'}")
    bad = [t for t in tests["outcomes"] if t["outcome"] not in ("passed", "skipped")]
    return 0 if tests["complete"] and not bad else 1


def run_tests(quick: bool, seconds: float) -> dict:
    """`pytest -m cuda` in a subprocess for at most `seconds`: each test's outcome as it happened
    (`cuda_check_events`, so a run stopped at the limit keeps its failures' messages and lists the tests it did
    not reach), the summary line, whether it completed."""
    import tempfile

    from cuda_check_events import EVENTS_VAR, read_outcomes
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / "cuda_check.log"
    with tempfile.TemporaryDirectory() as scratch:
        events = Path(scratch) / "events.jsonl"
        env = {**os.environ, EVENTS_VAR: str(events),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-n", "0", "-p", "no:randomly", "-p", "cuda_check_events",
               "-v", "-rfE", "--continue-on-collection-errors", *per_test_limit(), *cuda_test_files()]
        if quick:
            cmd += [f"--deselect={node}" for node in QUICK_DESELECT]
        t0 = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=env)
            try:
                code = proc.wait(timeout=max(30.0, seconds))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # pytest and anything it started
                proc.wait()
                code = None
        outcomes = read_outcomes(events)
    text = log.read_text(errors="replace")
    summary = next((line.strip("= ") for line in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed)",
                                                                                        line)), "")
    return {"outcomes": outcomes, "complete": code is not None, "exit": code, "summary": summary,
            "seconds": time.monotonic() - t0, "command": " ".join(cmd[1:])}


# test files run in this order (pytest keeps the order given): the quick ones first, so a run cut by its time
# limit loses the long `low` examples rather than whole areas; the process group last (a collective that hangs
# there leaves every other outcome in); files not named here before it
FILE_ORDER = ("capture", "attention", "offload", "lowbit", "qlora_gradients", "user_state", "measure", "low", "", "distributed")


def cuda_test_files() -> list[str]:
    """The test files holding `cuda`-marked tests, in FILE_ORDER (collecting only those: a file that fails to import
    elsewhere, say for a package this host lacks, cannot stop the run)."""
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if "mark.cuda" in p.read_text())

    def rank(name: str) -> int:
        stem = name.removesuffix(".py").removeprefix("test_").removeprefix("cuda_")
        return FILE_ORDER.index(stem) if stem in FILE_ORDER else FILE_ORDER.index("")
    return [f"tests/{name}" for name in sorted(files, key=rank)]


def per_test_limit() -> list[str]:
    """pytest-timeout's per-test limit where the plugin is installed (a hung test fails alone)."""
    import importlib.util
    return ["--timeout=240"] if importlib.util.find_spec("pytest_timeout") else []


def measurements(a, deadline) -> dict:
    """cuda_measure's tables while time is left; one that raises is reported with its error."""
    import cuda_measure as cm
    lengths, n = [], 4096
    while n <= (8192 if a.quick else a.max_n):
        lengths.append(n)
        n *= 2
    plans = [("allocator", lambda: cm.allocator_rows(["gpt"] if a.quick else ["gpt", "unet", "hf_gpt2"], deadline)),
             ("offload", lambda: cm.offload_rows(a.rounds, deadline)),
             ("attention", lambda: cm.attention_rows(lengths, a.rounds, deadline))]
    tables = {}
    for name, run in plans:
        try:
            tables[name] = run()
        except Exception as e:  # noqa: BLE001 - the report says what broke; the other tables still run
            tables[name] = [{"note": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}]
    return tables


def report(a, tests: dict, tables: dict, seconds: float) -> str:
    """The Markdown file: environment, test outcomes, the three tables."""
    from cuda_measure import mib
    lines = ["# CUDA check", "", f"`python benchmarks/cuda_check.py{' --quick' if a.quick else ''}` "
             f"(time limit {a.time_limit:.0f} s, took {seconds:.0f} s).", ""] + environment() + [""]
    lines += _test_section(tests)
    lines += ["", "## fxmem.measure beside the CUDA allocator (one AdamW step, bundled examples)", "",
              "fxmem counts live tensor storages on the device; the allocator's `requested` is what tensors asked "
              "for (kernel workspaces included), `allocated` adds block rounding; step = above the step's start.", "",
              "| model | estimate (static) | fxmem peak | fxmem step | requested step | allocated step | allocated "
              "peak | reserved peak | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in tables.get("allocator", []):
        lines.append(f"| {r.get('model', '')} | " + " | ".join(mib(r.get(k)) for k in (
            "estimate", "fxmem", "fxmem_step", "requested_step", "allocated_step", "allocated_peak",
            "reserved_peak")) + f" | {r.get('note', '')} |")
    lines += ["", "## Attention in bf16: eager manual vs the SDPA rewrite (batch 1, 8 heads x 64, fwd+bwd)", "",
              "| N | method | ms (median) | allocator peak above start | kernel | note |", "|---|---|---|---|---|---|"]
    for r in tables.get("attention", []):
        ms = f"{r['ms']:.2f}" if "ms" in r else ""
        lines.append(f"| {r.get('N', '')} | {r.get('method', '')} | {ms} | {mib(r.get('peak'))} | "
                     f"{r.get('kernel', '')} | {r.get('note', '')} |")
    lines += offload_section(tables.get("offload", []))
    return "\n".join(lines) + "\n"


def environment() -> list[str]:
    import torch
    props = torch.cuda.get_device_properties(0)
    try:
        import bitsandbytes as bnb
        from bitsandbytes.cextension import lib
        bnb_line = f"{bnb.__version__} ({type(lib).__name__}, CUDA library: {lib.compiled_with_cuda})"
    except Exception as e:  # noqa: BLE001
        bnb_line = f"not usable ({type(e).__name__}: {e})"
    commit = subprocess.run(["git", "describe", "--always", "--dirty= (+ local changes)", "--abbrev=7"], cwd=ROOT,
                            capture_output=True, text=True)
    return [f"- device: {torch.cuda.get_device_name(0)} (compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2 ** 30:.1f} GiB)",
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
            f"Python {platform.python_version()}",
            f"- bitsandbytes {bnb_line}",
            "- " + ", ".join(f"{name} {_version(name)}" for name in ("highspy", "transformers", "torch_geometric",
                                                                     "pytest", "pytest_timeout")),
            f"- fxmem commit {commit.stdout.strip() or 'unknown'}"]


def _version(module: str) -> str:
    """The installed version of a package the suite imports, or "MISSING" (its tests fail or skip)."""
    import importlib.metadata
    try:
        return importlib.metadata.version(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "MISSING"


def _test_section(tests: dict) -> list[str]:
    counts: dict[str, int] = {}
    for t in tests["outcomes"]:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    state = "finished" if tests["complete"] else f"stopped at its time limit ({tests['seconds']:.0f} s)"
    lines = ["## Tests (`pytest -m cuda`)", "", f"`{tests['command']}`: {state}, exit {tests['exit']}; "
             f"{', '.join(f'{v} {k}' for k, v in sorted(counts.items())) or 'no outcome'}"
             + (f" (pytest: {tests['summary']})" if tests["summary"] else "") + ".", "",
             "| test | outcome | s |", "|---|---|---|"]
    for t in tests["outcomes"]:
        secs = f"{t['seconds']:.1f}" if t["seconds"] is not None else ""
        lines.append(f"| `{t['test'].removeprefix('tests/')}` | {t['outcome']} | {secs} |")
    failed = [t for t in tests["outcomes"] if t["outcome"] in ("failed", "error") and t["message"]]
    for t in failed:
        lines += ["", f"### {t['outcome']}: `{t['test']}`", "", "```", t["message"], "```"]
    return lines


def offload_section(rows: list[dict]) -> list[str]:
    from cuda_measure import OFFLOAD_INPUTS, OFFLOAD_MODEL, mib
    shape = (f"decoder, {OFFLOAD_MODEL['n_layer']} blocks d={OFFLOAD_MODEL['d_model']}, batch "
             f"{OFFLOAD_INPUTS['batch']}, T={OFFLOAD_INPUTS['seq_len']}, budget 50%")
    lines = ["", f"## Activation offload to pinned host memory ({shape})", "",
             "Overlap: share of the copy time during which a kernel runs on another stream (profiler trace).", "",
             "| model | tier | activations (device) | peak | ms (median) | DtoH ms | DtoH overlap | HtoD ms | "
             "HtoD overlap | copy streams | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r.get("model", ""), r.get("tier", ""), mib(r.get("activations")), mib(r.get("peak")),
                 f"{r['ms']:.2f}" if "ms" in r else ""]
        for d in ("DtoH", "HtoD"):
            share = r.get(f"{d}_overlap")
            cells += [f"{r[d + '_ms']:.2f}" if d + "_ms" in r else "", "" if share is None else f"{share:.0%}"]
        cells += [", ".join(r.get("DtoH_streams", []) + r.get("HtoD_streams", [])), r.get("note", "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines + _step_time_section(rows)


def _step_time_section(rows: list[dict]) -> list[str]:
    """Where each offload row's traced step spends its time: GPU idle, and the host-side CUDA calls."""
    traced = [r for r in rows if "traced_ms" in r]
    if not traced:
        return []
    lines = ["", "Where the step's time goes (one profiled step, from its start until the GPU finished it; the "
             "profiler slows the host side, so its window is longer than the median above): GPU busy = the union "
             "of kernels, copies and memsets on all streams, idle = the rest; host-side CUDA API calls by their "
             "total time in the window (cudaDeviceSynchronize there is the wait for the GPU at the window's end).",
             "",
             "| model | traced ms | GPU busy ms | GPU idle ms | idle share | top host-side CUDA calls: total ms "
             "(calls) |", "|---|---|---|---|---|---|"]
    for r in traced:
        calls = ", ".join(f"{name} {ms:.2f} ({n})" for name, ms, n in r["api_calls"])
        idle = r["gpu_idle_ms"] / r["traced_ms"] if r["traced_ms"] else 0.0
        lines.append(f"| {r['model']} | {r['traced_ms']:.2f} | {r['gpu_busy_ms']:.2f} | {r['gpu_idle_ms']:.2f} | "
                     f"{idle:.0%} | {calls} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
