"""The command line: `fxmem estimate`, `fxmem optimize`, `fxmem diff`, `fxmem policies`; errors and exit codes."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from fxmem.cli import main

from .conftest import ROOT

GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp_digits.py")


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_with_measure_prints_both_columns(capsys):
    code, out, err = run(capsys, "estimate", GPT, "--measure")
    assert code == 0, err
    assert "estimated (static)" in out and "measured" in out
    peak_line = next(line for line in out.splitlines() if line.startswith("peak "))
    ratio = float(peak_line.split()[-1])
    assert 0.9 <= ratio <= 1.1
    assert "unknown ops: none" in out
    assert "heaviest modules" in out


def test_estimate_json_and_budget(capsys):
    code, out, err = run(capsys, "estimate", MLP, "--json", "--budget", "64MiB", "--method", "traced")
    assert code == 0, err
    d = json.loads(out)
    assert d["estimate"]["method"] == "traced"
    assert d["plan_batch"]["batch"] >= 32
    assert d["plan_batch"]["peak"] <= 64 * 2 ** 20


def test_estimate_inference_mode(capsys):
    code, out, _ = run(capsys, "estimate", MLP, "--mode", "inference")
    assert code == 0
    assert "optimizer=none" in out


@pytest.mark.parametrize("setup,expect", [
    (None, "no such file"),
    ("x = 1\n", "must define build_model()"),
    ("import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
     "def example_inputs():\n    return (torch.randn(3, 5),)\n", "rejects example_inputs()"),
    ("def build_model():\n    raise RuntimeError('boom')\ndef example_inputs():\n    return ()\n",
     "build_model() failed: RuntimeError: boom"),
    ("import torch\ndef build_model():\n    return 3\ndef example_inputs():\n    return ()\n",
     "must return a torch.nn.Module"),
])
def test_bad_model_files_exit_2_with_one_line(tmp_path, capsys, setup, expect):
    path = tmp_path / "model.py"
    if setup is not None:
        path.write_text(setup)
    code, out, err = run(capsys, "estimate", str(path))
    assert code == 2
    assert expect in err
    assert "model.py" in err
    assert len(err.strip().splitlines()) == 1, err


def test_bad_budget_string(capsys):
    code, _, err = run(capsys, "estimate", MLP, "--budget", "lots")
    assert code == 2
    assert "--budget" in err and "lots" in err


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "fxmem.cli", "estimate", "no/such/file.py"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "no such file" in r.stderr


def test_policies_list_and_show(capsys):
    code, out, _ = run(capsys, "policies")
    assert code == 0
    for name in ("low", "medium", "high", "inference"):
        assert name in out
    code, out, _ = run(capsys, "policies", "show", "low")
    assert code == 0 and "version: 1" in out


def test_model_file_runs_as_user_code_without_side_effects_on_import(tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(f"""
        import torch, pathlib
        pathlib.Path({str(marker)!r}).write_text("yes")
        def build_model():
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        def example_inputs():
            return (torch.randn(8, 4),)
    """))
    code, out, err = run(capsys, "estimate", str(path))
    assert code == 0, err
    assert marker.read_text() == "yes"  # a model file is user code and runs as such


def test_optimize_activation_budget_flag(tmp_path, capsys):
    """`--activation-budget` bounds the activations kept at the end of forward (the checkpoint pass's
    activation_budget); a bad value exits 2 naming the key and writes nothing."""
    unet = str(ROOT / "examples" / "unet.py")
    out = tmp_path / "o"
    code, _, err = run(capsys, "optimize", unet, "--policy", "low", "--activation-budget", "40%", "--out", str(out),
                       "--quiet", "--json")
    assert code == 0, err
    d = json.loads((out / "report.json").read_text())
    ck = next(p for p in d["passes"] if p["name"] == "checkpoint")
    assert ck["status"] == "applied"
    limit = ck["metrics"]["activation_budget"]
    assert d["estimated"]["after"]["activations"] <= limit < d["estimated"]["before"]["activations"]
    bad = tmp_path / "bad"
    code, _, err = run(capsys, "optimize", unet, "--activation-budget", "lots", "--out", str(bad))
    assert code == 2 and "passes.checkpoint.activation_budget" in err and not bad.exists()


def test_optimize_prints_only_its_own_output(tmp_path):
    """A fresh process, as a user runs it: no solver banner (HiGHS writes one to the process's stdout unless told
    not to before anything else) and no warning from inside torch about copying graphs (copying a graph's pytree
    specs trips a deprecation in torch 2.13's pytree), only fxmem's progress lines and summary."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "fxmem.cli", "optimize", GPT, "--policy", "low", "--budget", "40%",
                        "--set", "budget_strict=false", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "milp" in r.stderr + r.stdout  # the MILP solver ran (the banner's source)
    assert "HiGHS" not in r.stdout + r.stderr
    assert "Warning" not in r.stderr, r.stderr
    assert (out / "report.md").exists()


def test_optimize_over_a_target_budget_is_said_and_strict_makes_it_an_error(tmp_path, capsys):
    """The U-Net at 30% of its peak is out of reach of `low` (checkpointing's lowest is above it). As a target (budget_strict=false) the run succeeds and its summary says OVER the
    budget, first; with --strict the miss is an error (exit 3, --strict's own code; the budget named) and nothing is
    written. (Required, it is a BudgetError: tests/test_budgets.py.)"""
    unet = str(ROOT / "examples" / "unet.py")
    out = tmp_path / "out"
    target = ("--budget", "30%", "--set", "budget_strict=false")
    code, stdout, err = run(capsys, "optimize", unet, "--policy", "low", *target, "--out", str(out))
    assert code == 0, err
    assert [ln for ln in stdout.splitlines() if ln.strip()][1].startswith("OVER BUDGET: budget ")
    line = next(ln for ln in stdout.splitlines() if ln.startswith("budget "))
    assert "OVER the budget by" in line
    assert (out / "report.md").exists()
    strict = tmp_path / "strict"
    code, stdout, err = run(capsys, "optimize", unet, "--policy", "low", *target, "--out", str(strict),
                            "--strict")
    assert code == 3
    assert "strict: the result is over its budget" in err and "OVER the budget by" in err
    assert not strict.exists()
    # a budget that is met passes --strict
    ok = tmp_path / "ok"
    code, stdout, err = run(capsys, "optimize", unet, "--policy", "low", "--budget", "90%", "--out", str(ok),
                            "--strict")
    assert code == 0, err
    assert "fits" in next(ln for ln in stdout.splitlines() if ln.startswith("budget "))
    assert (ok / "report.md").exists()
