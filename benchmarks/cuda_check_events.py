"""A pytest plugin for `benchmarks/cuda_check.py`: each test's outcome written the moment it is known.

cuda_check kills pytest at its time limit; pytest prints failures' messages and its junit file only at the end,
so a killed run used to lose why a test failed and which tests it had not reached. This plugin appends JSON lines
to the file named by FXMEM_CUDA_CHECK_EVENTS: once `{"selected": [node ids]}` after collection, then one record per
test phase that is not a passing setup or teardown: `{"test", "when", "outcome", "seconds", "message"}`.
`read_outcomes` folds them into one outcome per test, "not run" for those selected but never reported.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

EVENTS_VAR = "FXMEM_CUDA_CHECK_EVENTS"
MESSAGE_LINES = 12


def _write(record: dict) -> None:
    with open(os.environ[EVENTS_VAR], "a") as out:
        out.write(json.dumps(record) + "\n")


def pytest_collection_finish(session) -> None:
    if EVENTS_VAR in os.environ:
        _write({"selected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report) -> None:
    if EVENTS_VAR not in os.environ or (report.when != "call" and report.passed):
        return
    message = "\n".join(report.longreprtext.strip().splitlines()[-MESSAGE_LINES:]) if report.failed else ""
    _write({"test": report.nodeid, "when": report.when, "outcome": report.outcome, "seconds": report.duration,
            "message": message})


def read_outcomes(path: Path) -> list[dict]:
    """One dict per selected test, in the order run: test, outcome (passed, failed, error: a setup or teardown
    failed, skipped, not run), seconds (the call's) and the end of a failure's message."""
    selected, found = [], {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if "selected" in record:
            selected = record["selected"]
            continue
        entry = found.setdefault(record["test"], {"test": record["test"], "outcome": "passed", "seconds": None,
                                                  "message": ""})
        if record["outcome"] == "failed":
            entry["outcome"] = "failed" if record["when"] == "call" else "error"
            entry["message"] = entry["message"] or record["message"]
        elif record["outcome"] == "skipped" and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
        if record["when"] == "call":
            entry["seconds"] = record["seconds"]
    unreached = [{"test": node, "outcome": "not run", "seconds": None, "message": ""}
                 for node in selected if node not in found]
    return list(found.values()) + unreached
