"""checkpoint_pareto's `--device cuda` mode where it runs without a GPU (issue 34): sizes from the estimate, the time
limit, the table with rows left out, the exit without a device; on CPU at tiny sizes."""
from __future__ import annotations

import pytest
import torch

import fxmem
from benchmarks import checkpoint_pareto as pareto
from benchmarks import checkpoint_pareto_cuda as cuda_side
from examples import gpt

TINY = {"gpt": (dict(n_layer=1, n_head=2, d_model=32, block_size=16), dict(seq_len=16))}
TARGET = 2 << 20


def test_batch_is_the_largest_whose_estimated_peak_fits_the_target():
    model_kwargs, input_kwargs = TINY["gpt"]
    batch, peak = cuda_side.batch_for_peak(gpt, gpt.build_model(**model_kwargs), input_kwargs, TARGET, "cpu")
    assert batch > 1
    # captured anew at the batch picked (not at batch 2 and scaled, as the search does)
    program = fxmem.capture(gpt.build_model(**model_kwargs), gpt.example_inputs(batch=batch, **input_kwargs))
    assert fxmem.estimate(program, loss_fn=gpt.loss_fn).peak == peak <= TARGET
    one_more = gpt.example_inputs(batch=batch + 1, **input_kwargs)
    assert fxmem.estimate(program, one_more, loss_fn=gpt.loss_fn).peak > TARGET


def test_a_target_below_batch_one_is_refused_naming_the_model():
    model_kwargs, input_kwargs = TINY["gpt"]
    with pytest.raises(ValueError, match="examples.gpt: batch 1 already"):
        cuda_side.batch_for_peak(gpt, gpt.build_model(**model_kwargs), input_kwargs, 1024, "cpu")


def test_build_order_under_a_time_limit_keeps_every_method_and_each_base_first():
    budgets = [0.1, 0.5]
    assert pareto.jobs(budgets, True) == [
        ("fxmem", 0.1), ("fxmem", 0.5), ("compile", 0.1), ("compile", 0.5), ("compile", 1.0),
        ("stack", 0.1), ("stack", 0.5), ("stack_at_b", 0.1), ("stack_at_b", 0.5), ("bytes", 0.1), ("bytes", 0.5),
        ("bytes_stack", 0.1), ("bytes_stack", 0.5), ("fit_stack", 0.1), ("fit_stack", 0.5),
        ("fit_stack_flops", 0.1), ("fit_stack_flops", 0.5), ("fit_timed", 0.1), ("fit_timed", 0.5)]
    limited = pareto.jobs(budgets, True, by_budget=True)
    assert sorted(limited) == sorted(pareto.jobs(budgets, True))
    assert limited[:3] == [("fxmem", 0.1), ("fxmem", 0.5), ("compile", 1.0)]
    for kind, b in limited:  # a method comes after the row it is built from
        base = pareto.NEEDS.get(kind)
        assert base is None or limited.index((base, b)) < limited.index((kind, b))
    assert pareto.jobs([0.5, 1.0], True, by_budget=True).count(("compile", 1.0)) == 1
    assert pareto.jobs(budgets, False, by_budget=True) == [("fxmem", 0.1), ("fxmem", 0.5)]


def test_kinds_keep_only_those_methods_and_compile_at_one_for_the_goal_lines():
    assert pareto.jobs([0.1, 0.5], True, kinds={"compile", "fit_stack"}) == [
        ("compile", 0.1), ("compile", 0.5), ("compile", 1.0), ("fit_stack", 0.1), ("fit_stack", 0.5)]
    assert pareto.jobs([0.1], True, kinds={"fit_stack"}) == [("fit_stack", 0.1)]


def test_time_limit_allows_what_fits_with_the_rows_still_to_measure():
    run = cuda_side.DeviceRun("cpu", 100 + cuda_side.WRITE_S, target=TARGET, rounds=1, shapes=TINY)
    assert run.start_model(1)
    run.row_s = 5.0
    assert run.allows("fxmem", 4)  # first guess 10 s + 4 rows x 5 s
    assert not run.allows("compile", 12)  # first guess 45 s + 60 s
    assert run.timed("compile", "compile@0.1", lambda: None) == {}
    assert run.allows("compile", 12)  # a compile took well under a second
    failed = run.timed("fxmem", "fxmem@0.1", lambda: int("x"))
    assert failed == {"fxmem@0.1": "failed: ValueError: invalid literal for int() with base 10: 'x'"}


def test_each_model_gets_an_even_share_of_the_time_left():
    run = cuda_side.DeviceRun("cpu", 62 + cuda_side.WRITE_S, target=TARGET, rounds=1, shapes=TINY)
    assert run.start_model(2)  # 31 s: enough for a setup
    assert 30 < run.deadline.left() <= 31
    assert not cuda_side.DeviceRun("cpu", 50 + cuda_side.WRITE_S, target=TARGET, rounds=1).start_model(2)


@pytest.fixture(scope="module")
def limited_result():
    """run_model through the device path on CPU: the tiny decoder at the batch its estimate picks, 200 s for the
    model, fxmem methods first guessed to take no time and torch.compile ones 1000 s, so the fxmem row fits and no
    compiled row does, however loaded the machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_side, "FIRST_GUESS_S", {"fxmem": 0.0, "bytes": 0.0, "compile": 1e3, "stack": 1e3,
                                                     "stack_at_b": 1e3, "bytes_stack": 1e3, "fit_stack": 1e3,
                                                     "fit_stack_flops": 1e3, "fit_timed": 1e3})
        run = cuda_side.DeviceRun("cpu", 200 + cuda_side.WRITE_S, target=TARGET, rounds=1, shapes=TINY)
        assert run.start_model(1)
        return pareto.run_model("gpt", False, [0.5], 1, True, run)


def test_rows_past_the_time_limit_are_left_out_with_why(limited_result):
    res = limited_result
    assert list(res["rows"]) == ["eager", "captured", "uniform", "fxmem@0.5"]
    assert res["left_out"] == {"compile@1.0": "not run (time limit)", "compile@0.5": "not run (time limit)",
                               "fxmem=c@0.5": "not run (compile@0.5 was not)",
                               "fxmem@0.5+compile": "not run (time limit)",
                               "fxmem@0.5+compile@0.5": "not run (time limit)",
                               "fxmem=c@0.5+compile": "not run (fxmem=c@0.5 was not)",
                               "fxmem<=c@0.5+compile": "not run (time limit)",
                               "fxmem<=c@0.5+compile (flops)": "not run (time limit)",
                               "fxmem<=c@0.5+compile (timed)": "not run (time limit)"}
    assert res["rows"]["fxmem@0.5"]["acts"] < res["rows"]["eager"]["acts"]
    assert res["base"].peak <= TARGET  # captured at the batch the estimate picked


def _cells(line: str) -> int:
    return line.count("|") - 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_table_lists_rows_left_out_in_every_column_layout(limited_result, device):
    res = dict(limited_result, device=device)
    if device == "cuda":  # the allocator's counts, as allocator_columns adds them to a row
        res["rows"] = {k: dict(r, alloc_peak=(i + 1) << 20, alloc_acts=i << 20) for i, (k, r) in
                       enumerate(limited_result["rows"].items())}
    lines = pareto.table(res).splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    assert all(_cells(line) == _cells(rows[0]) for line in rows)
    assert _cells(rows[0]) == (10 if device == "cuda" else 7)
    assert "batch=" in lines[0]
    for key, why in limited_result["left_out"].items():
        assert f"| {key} {why} |" in "\n".join(rows)
    if device == "cuda":
        assert rows[0].split(" | ")[2] == "allocator peak above step start"
        assert next(r for r in rows if r.startswith("| uniform")).split(" | ")[2] == "3.00 MiB"


def test_cuda_mode_without_a_device_says_so_and_writes_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pareto.main(["--device", "cuda", "--out", str(tmp_path / "pareto")]) == 2
    assert capsys.readouterr().err.strip() == "no CUDA device"
    assert list(tmp_path.iterdir()) == []


def test_cuda_only_options_are_refused_on_cpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pareto.main(["--time-limit", "60"])
    assert exit_info.value.code == 2
    assert "--time-limit and --target apply to --device cuda" in capsys.readouterr().err


def test_a_model_past_the_limit_or_failing_is_reported_and_the_run_goes_on(capsys):
    late = cuda_side.DeviceRun("cpu", 20 + cuda_side.WRITE_S, target=TARGET, rounds=1, shapes=TINY)
    assert pareto.model_on_device(late, "gpt", 1, [0.5], 1) == {"name": "gpt", "not_run": "not run (time limit)"}
    run = cuda_side.DeviceRun("cpu", 100 + cuda_side.WRITE_S, target=TARGET, rounds=1, shapes={"nope": ({}, {})})
    failed = pareto.model_on_device(run, "nope", 1, [0.5], 1)
    assert failed == {"name": "nope", "not_run": "failed: ModuleNotFoundError: No module named 'examples.nope'"}
    assert "Traceback" in capsys.readouterr().err
