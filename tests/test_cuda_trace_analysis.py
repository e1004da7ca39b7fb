"""cuda_measure's analysis of a profiler trace (issue 34: where the offloaded step's time goes), on a hand-written
Chrome trace with known answers: GPU idle time, host-side CUDA calls, copy overlap, and cuda_check's report of them."""
from __future__ import annotations

import json

import pytest

from benchmarks import cuda_measure

from .conftest import ROOT


def _event(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


# one traced step from 1000 to 2000 us: kernels on stream 7, copies on stream 20, host calls; events outside the
# window (a kernel, an API call) are not the step's
TRACE = [
    _event("user_annotation", cuda_measure.STEP_MARK, 1000, 1000),
    _event("cpu_op", "aten::mm", 1100, 900),
    _event("kernel", "gemm", 1100, 200, stream=7), _event("kernel", "gemm", 1250, 150, stream=7),
    _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1350, 150, stream=20),
    _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1700, 100, stream=20),
    _event("kernel", "softmax", 1750, 150, stream=7), _event("gpu_memset", "Memset (Device)", 1950, 10, stream=7),
    _event("kernel", "late", 2500, 100, stream=7),
    *[_event("cuda_runtime", "cudaLaunchKernel", ts, dur) for ts, dur in ((1010, 5), (1020, 5), (1030, 6))],
    _event("cuda_runtime", "cudaMemcpyAsync", 1040, 10), _event("cuda_runtime", "cudaMemcpyAsync", 1600, 20),
    _event("cuda_runtime", "cudaHostAlloc", 1050, 100), _event("cuda_driver", "cuLaunchKernel", 1060, 7),
    _event("cuda_runtime", "cudaStreamSynchronize", 1500, 300),
    _event("cuda_runtime", "cudaEventSynchronize", 2500, 400),
]


@pytest.fixture()
def trace_events(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": TRACE}))
    return cuda_measure.load_trace(path)


def test_gpu_idle_time_is_the_window_less_the_union_of_device_work(trace_events):
    out = cuda_measure.time_breakdown(trace_events)
    assert out["traced_ms"] == pytest.approx(1.0)
    assert out["gpu_busy_ms"] == pytest.approx(0.61)  # 1100-1500, 1700-1900, the memset's 10 us
    assert out["gpu_idle_ms"] == pytest.approx(0.39)


def test_host_cuda_calls_are_ranked_by_total_time_in_the_window(trace_events):
    calls = cuda_measure.time_breakdown(trace_events)["api_calls"]
    assert [(name, n) for name, _, n in calls] == [("cudaStreamSynchronize", 1), ("cudaHostAlloc", 1),
                                                   ("cudaMemcpyAsync", 2), ("cudaLaunchKernel", 3),
                                                   ("cuLaunchKernel", 1)]
    assert [ms for _, ms, _ in calls] == pytest.approx([0.3, 0.1, 0.03, 0.016, 0.007])
    assert len(cuda_measure.time_breakdown(trace_events, top=2)["api_calls"]) == 2


def test_copy_overlap_counts_kernels_on_other_streams(trace_events):
    out = cuda_measure.copy_overlap(trace_events)
    assert out["DtoH_ms"] == pytest.approx(0.15) and out["DtoH_overlap"] == pytest.approx(1 / 3)
    assert out["HtoD_ms"] == pytest.approx(0.1) and out["HtoD_overlap"] == pytest.approx(0.5)
    assert out["DtoH_streams"] == out["HtoD_streams"] == ["20"]


def test_a_trace_without_the_step_mark_is_refused(trace_events):
    with pytest.raises(ValueError, match=cuda_measure.STEP_MARK):
        cuda_measure.time_breakdown([e for e in trace_events if e["cat"] != "user_annotation"])


def test_cuda_check_report_says_where_the_offloaded_step_time_goes(trace_events, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # cuda_check imports cuda_measure as the script does
    from benchmarks import cuda_check
    breakdown = cuda_measure.time_breakdown(trace_events)
    rows = [{"model": "captured", "ms": 1.0, **breakdown},
            {"model": "offload@50%", "tier": "cpu", "ms": 2.0, **cuda_measure.copy_overlap(trace_events),
             **breakdown}]
    text = "\n".join(cuda_check.offload_section(rows))
    assert "| offload@50% | 1.00 | 0.61 | 0.39 | 39% | cudaStreamSynchronize 0.30 (1), cudaHostAlloc 0.10 (1), " \
           "cudaMemcpyAsync 0.03 (2), cudaLaunchKernel 0.02 (3), cuLaunchKernel 0.01 (1) |" in text
    assert "| offload@50% | cpu |" in text and "| 33% |" in text
