"""cuda_check's pytest plugin: outcomes written as they happen, so a run killed at its time limit keeps its
failures' messages and names the tests it did not reach."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.cuda_check_events import EVENTS_VAR, read_outcomes

from .conftest import ROOT

TESTS = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_ok():
    pass

def test_bad():
    assert 1 == 2, "one is not two"

def test_setup(broken):
    pass

def test_skip():
    pytest.skip("no device")
'''


def test_a_pytest_run_reports_every_outcome_with_its_message(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    events = tmp_path / "events.jsonl"
    env = {**os.environ, EVENTS_VAR: str(events), "PYTHONPATH": str(ROOT / "benchmarks")}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-p",
                    "cuda_check_events", "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    outcomes = {o["test"].split("::")[1]: o for o in read_outcomes(events)}
    assert {name: o["outcome"] for name, o in outcomes.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_setup": "error", "test_skip": "skipped"}
    assert "one is not two" in outcomes["test_bad"]["message"]
    assert "setup broke" in outcomes["test_setup"]["message"]
    assert outcomes["test_ok"]["seconds"] is not None and outcomes["test_setup"]["seconds"] is None


def test_tests_selected_but_never_reported_are_not_run(tmp_path):
    """What a run killed at its limit leaves: the selection, then the outcomes reached."""
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join(json.dumps(r) for r in (
        {"selected": ["t.py::a", "t.py::b", "t.py::c"]},
        {"test": "t.py::a", "when": "call", "outcome": "passed", "seconds": 0.5, "message": ""},
        {"test": "t.py::b", "when": "call", "outcome": "failed", "seconds": 1.0, "message": "E boom"})) + "\n")
    assert [(o["test"], o["outcome"], o["message"]) for o in read_outcomes(events)] == [
        ("t.py::a", "passed", ""), ("t.py::b", "failed", "E boom"), ("t.py::c", "not run", "")]
    assert read_outcomes(tmp_path / "absent.jsonl") == []
