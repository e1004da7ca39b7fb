"""The long fuzz run's seeds file (`benchmarks/fuzz_budget.py --seeds-file`): results kept as models finish, taken
back when the run starts again at the same commit, refused from another commit or an uncommitted checkout, and a
line cut by a killed process mended (that model runs again)."""
from __future__ import annotations

import pytest

from benchmarks.fuzz_budget import SeedsFile
from tests.fuzz_harness import FuzzModelResult, FuzzRun

VERSION = "0123abcd"


def _result(seed: int) -> FuzzModelResult:
    run = FuzzRun(seed, "lowest", 1, estimated=100, measured=99, fits=False)
    return FuzzModelResult(seed, f"seed {seed}: SeqLinear", estimated=120, measured=120, runs=[run])


def test_results_come_back_as_they_were_written(tmp_path):
    path = tmp_path / "seeds.jsonl"
    first = SeedsFile(path, VERSION)
    assert first.done() == {}
    first.add(_result(3), 1.5)
    first.add(_result(4), 2.0)
    done = SeedsFile(path, VERSION).done()
    assert sorted(done) == [3, 4]
    assert done[3] == (_result(3), 1.5) and isinstance(done[4][0].runs[0], FuzzRun)


def test_another_commit_or_uncommitted_changes_are_refused(tmp_path):
    path = tmp_path / "seeds.jsonl"
    SeedsFile(path, VERSION).add(_result(0), 1.0)
    with pytest.raises(SystemExit, match="results of version 0123abcd"):
        SeedsFile(path, "fedc9876").done()
    with pytest.raises(SystemExit, match="uncommitted changes"):
        SeedsFile(tmp_path / "other.jsonl", VERSION + "+changes").done()


def test_a_line_cut_by_a_kill_is_dropped_and_the_file_stays_appendable(tmp_path):
    path = tmp_path / "seeds.jsonl"
    seeds = SeedsFile(path, VERSION)
    seeds.add(_result(0), 1.0)
    with path.open("a") as f:
        f.write('{"seed": 1, "descr')  # a process killed mid-write
    assert sorted(SeedsFile(path, VERSION).done()) == [0]
    seeds.add(_result(1), 1.0)
    assert sorted(SeedsFile(path, VERSION).done()) == [0, 1]
