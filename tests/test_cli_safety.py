"""What the command line reads and writes, and how it fails: `--out` is checked before any work, `--overwrite` replaces
only a result fxmem wrote, the swap with a previous result is never interrupted half-way, SIGTERM cleans up like
Ctrl-C, and user errors (a failing loss_fn, a size that overflows, an empty budget, an unusable output path, a damaged
result) exit 2 with one line naming what is wrong."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fxmem
from fxmem import api, output_dir, resultdir, staging, swap
from fxmem.cli import main

from .conftest import ROOT

MLP = str(ROOT / "examples" / "mlp_digits.py")
FAST = ["--policy", "low", "--quiet", "--set", "passes.checkpoint.enabled=false",
        "--set", "passes.attention.enabled=false"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def scratch_left(d: Path) -> list[str]:
    """fxmem's scratch names anywhere under `d`: temp dirs and backups of previous results."""
    return [str(p) for p in d.rglob("*") if "fxmem-tmp" in p.name or "fxmem-old" in p.name]


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the transform starts: refusals must come before any work."""
    def boom(*a, **k):
        raise AssertionError("the transform ran although the output was refused")
    monkeypatch.setattr(api, "transform", boom)


@pytest.fixture
def result_dir(tmp_path, capsys):
    """A directory written by `fxmem optimize` (what --overwrite may replace)."""
    out = tmp_path / "X"
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", out)
    assert code == 0, err
    return out


# ============================================================================================ B1: --overwrite

def test_overwrite_refuses_the_working_directory(tmp_path, monkeypatch, capsys, no_work):
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(MLP, proj / "mlp_digits.py")
    (proj / "user.txt").write_text("keep")
    monkeypatch.chdir(proj)
    for out in (str(proj), ".", str(tmp_path)):
        code, _, err = run(capsys, "optimize", "mlp_digits.py", *FAST, "--out", out, "--overwrite")
        line = one_line(err)
        assert code == 2 and "current working directory" in line and "nothing was written" in line, line
    assert sorted(os.listdir(proj)) == ["mlp_digits.py", "user.txt"]
    assert not scratch_left(tmp_path)


def test_overwrite_refuses_a_directory_holding_the_model_or_policy_file(tmp_path, capsys, no_work):
    ex = tmp_path / "examples_copy"
    ex.mkdir()
    shutil.copy(MLP, ex / "mlp_digits.py")
    code, _, err = run(capsys, "optimize", ex / "mlp_digits.py", *FAST, "--out", ex, "--overwrite")
    line = one_line(err)
    assert code == 2 and "contains the model file" in line and str(ex) in line
    pol_dir = tmp_path / "pol"
    pol_dir.mkdir()
    (pol_dir / "p.yaml").write_text("version: 1\nextends: low\n")
    code, _, err = run(capsys, "optimize", MLP, "--policy", pol_dir / "p.yaml", "--out", pol_dir, "--overwrite")
    assert code == 2 and "contains the policy file" in one_line(err)
    assert (ex / "mlp_digits.py").exists() and (pol_dir / "p.yaml").exists()
    assert not scratch_left(tmp_path)


@pytest.mark.parametrize("content", [
    {"notes.txt": "mine"},                                              # not a result at all
    {"manifest.json": "{}", "data.bin": "x"},                           # someone else's manifest
    {"manifest.json": json.dumps({"format": 1, "kind": "other-tool"})},
])
def test_overwrite_refuses_what_fxmem_did_not_write(tmp_path, capsys, no_work, content):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in content.items():
        (out / name).write_text(text)
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", out, "--overwrite")
    line = one_line(err)
    assert code == 2 and str(out) in line and "--overwrite replaces only a result written by fxmem" in line
    assert {p.name: p.read_text() for p in out.iterdir()} == content
    assert not scratch_left(tmp_path)


def test_overwrite_replaces_an_fxmem_result_but_not_files_added_to_it(result_dir, capsys):
    man = json.loads((result_dir / "manifest.json").read_text())
    assert man["kind"] == "fxmem-result" and "weights.safetensors" in man["files"]
    ino = result_dir.stat().st_ino
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir)  # no --overwrite
    assert code == 2 and "pass --overwrite" in one_line(err)
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir, "--overwrite")
    assert code == 0, err
    assert result_dir.stat().st_ino != ino and (result_dir / "manifest.json").exists()
    assert not scratch_left(result_dir.parent)
    (result_dir / "my_notes.txt").write_text("mine")
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir, "--overwrite")
    assert code == 2 and "my_notes.txt" in one_line(err)
    assert (result_dir / "my_notes.txt").read_text() == "mine"
    # a result written before manifests listed their files (and before module.json) is still recognised
    (result_dir / "my_notes.txt").unlink()
    (result_dir / "module.json").rename(result_dir / "module.pt")
    man = {"fxmem": man["fxmem"], "format": 1, "module_sha256": "0" * 64}
    (result_dir / "manifest.json").write_text(json.dumps(man))
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir, "--overwrite")
    assert code == 0, err


# ============================================================================================ B2: files and links

def test_out_file_or_symlink_is_refused_and_nothing_is_left(tmp_path, monkeypatch, capsys, no_work):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("user file")
    Path("t").mkdir()
    Path("t/k").write_text("k")
    os.symlink("t", "link")
    os.symlink("nowhere", "dangling")
    os.symlink("empty", "link_empty")
    Path("empty").mkdir()
    for out, why in (("afile", "is a file"), ("link", "symbolic link"), ("dangling", "symbolic link"),
                     ("link_empty", "symbolic link")):
        for extra in ([], ["--overwrite"]):
            code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", out, *extra)
            line = one_line(err)
            assert code == 2 and line.startswith(f"fxmem: error: {out}") and why in line, line
    assert sorted(os.listdir(tmp_path)) == ["afile", "dangling", "empty", "link", "link_empty", "t"]
    assert Path("afile").read_text() == "user file" and os.listdir("t") == ["k"] and not os.listdir("empty")


def test_scratch_removal_handles_files_and_links(tmp_path):
    """`staging.remove_path` removes what it is given, whatever it is (shutil.rmtree(ignore_errors=True) silently keeps a
    file), and never what a link points to."""
    f = tmp_path / "f"
    f.write_text("x")
    d = tmp_path / "d"
    d.mkdir()
    (d / "k").write_text("k")
    link = tmp_path / "l"
    os.symlink(d, link)
    for p in (f, link):
        staging.remove_path(p)
        assert not os.path.lexists(p)
    assert (d / "k").exists()
    staging.remove_path(d)
    assert not d.exists()


# ============================================================================================ B3/B5: signals

@pytest.mark.parametrize("sig,word", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated (SIGTERM)")])
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_signal_during_the_overwrite_swap_is_held_until_it_is_done(result_dir, capsys, monkeypatch, sig, word,
                                                                   exchange):
    """A signal arriving while the previous result is swapped out is handled once the swap is complete: the target
    is the new result (never neither), no scratch is left, and since the result is then complete on disk the run
    succeeds (exit 0), with a line saying the signal came after."""
    ino = result_dir.stat().st_ino
    real_exchange, real_replace = swap.exchange, os.replace
    calls = []

    def exchange_then_signal(a, b):
        calls.append("exchange")
        if not exchange:
            return False  # no atomic exchange here: two renames
        os.kill(os.getpid(), sig)
        return real_exchange(a, b)

    def replace_with_signal(a, b):
        if Path(b) == result_dir or Path(a) == result_dir:  # the swap's renames, not torch's own
            calls.append("replace")
            out = real_replace(a, b)
            if len(calls) == 2:  # right after the first rename: the previous result is moved aside, none in place
                os.kill(os.getpid(), sig)
            return out
        return real_replace(a, b)

    monkeypatch.setattr(output_dir, "exchange", exchange_then_signal)
    monkeypatch.setattr(os, "replace", replace_with_signal)
    rc, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir, "--overwrite")
    monkeypatch.undo()
    assert rc == 0, err
    assert (result_dir / "manifest.json").exists(), f"neither the previous nor the new result is in place: {err}"
    assert calls[0] == "exchange" and (exchange or calls[1:] == ["replace", "replace"]), calls
    assert f"{word} after the run had completed: the result is complete in {result_dir}; exit status 0" in err
    assert "Traceback" not in err
    assert result_dir.stat().st_ino != ino and (result_dir / "manifest.json").exists()
    assert resultdir.not_an_fxmem_result(result_dir, sorted(os.listdir(result_dir))) is None
    assert not scratch_left(result_dir.parent)


def test_failed_second_rename_puts_the_previous_result_back(result_dir, capsys, monkeypatch):
    ino = result_dir.stat().st_ino
    before = sorted(os.listdir(result_dir))
    real_replace = os.replace
    calls = []

    def second_fails(a, b):
        if Path(b) == result_dir:
            calls.append((a, b))
            if len(calls) == 1:  # moving the new result into place (the previous one was moved aside)
                raise OSError(28, "No space left on device")
        return real_replace(a, b)

    monkeypatch.setattr(output_dir, "exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", second_fails)
    rc, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir, "--overwrite")
    monkeypatch.undo()
    line = one_line(err)
    assert rc == 2 and "No space left on device" in line and "nothing was written" in line
    assert result_dir.stat().st_ino == ino and sorted(os.listdir(result_dir)) == before
    assert not scratch_left(result_dir.parent)


def test_interrupt_before_the_swap_leaves_the_previous_result(result_dir, capsys, monkeypatch):
    ino = result_dir.stat().st_ino

    def interrupted(result, d):
        (d / "weights.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(output_dir, "write_result_files", interrupted)
    rc, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir, "--overwrite")
    assert rc == 130
    assert f"interrupted; nothing was written ({result_dir} is unchanged)" in err
    assert result_dir.stat().st_ino == ino
    assert not scratch_left(result_dir.parent)


def test_internal_error_while_writing_leaves_the_previous_result(result_dir, capsys, monkeypatch):
    """(What tests/test_pipeline.py::test_cli_optimize_failure_leaves_nothing checks, on a directory --overwrite may
    replace.) A bug while writing: exit 1, the previous result untouched, no scratch left."""
    from fxmem import report as report_mod
    ino, before = result_dir.stat().st_ino, sorted(os.listdir(result_dir))

    def boom(self, directory, deterministic=False):
        raise RuntimeError("disk full")
    monkeypatch.setattr(report_mod.Report, "save", boom)
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir, "--overwrite")
    assert code == 1 and "internal error: RuntimeError: disk full" in err
    assert result_dir.stat().st_ino == ino and sorted(os.listdir(result_dir)) == before
    assert not scratch_left(result_dir.parent)


_DRIVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import fxmem.output_dir as output_dir, fxmem.cli as cli
    marker = Path(sys.argv[1])
    real = output_dir.write_result_files
    def write_then_wait(result, d):  # test hook: the save is under way, with files on disk; wait to be stopped
        real(result, d)
        marker.write_text(str(d))
        time.sleep(120)
    output_dir.write_result_files = write_then_wait
    sys.exit(cli.main(sys.argv[2:]))
""")


def test_sigterm_during_the_save_cleans_up(tmp_path):
    """SIGTERM in a real process while the result is being written: exit 143, the temp dir is gone, nothing is
    written, and the message says so."""
    work = tmp_path / "w"
    work.mkdir()
    marker = tmp_path / "saving"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", _DRIVER, str(marker), "optimize", MLP, *FAST, "--out", "X"],
                         cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), p.communicate(timeout=30)
        assert Path(marker.read_text()).exists()  # the partial result is on disk now
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "fxmem: terminated; nothing was written" in err and "Traceback" not in err
    assert os.listdir(work) == []


# ============================================================================================ B6: loss_fn

LOSS_FILES = {
    "raises": ("def loss_fn(output, inputs):\n    raise ValueError('boom in loss_fn')\n",
               ["loss_fn(output, inputs) failed", "ValueError: boom in loss_fn", "m.py:7"]),
    "raises_rt": ("def loss_fn(output, inputs):\n    raise RuntimeError('rt boom')\n",
                  ["loss_fn(output, inputs) failed", "RuntimeError: rt boom"]),
    "bad_sig": ("def loss_fn(output):\n    return output.sum()\n",
                ["loss_fn(output) cannot be called as loss_fn(output, inputs)"]),
    "nonscalar": ("def loss_fn(output, inputs):\n    return output\n",
                  ["loss_fn(output, inputs) must return a scalar tensor", "(2, 4)"]),
    "not_tensor": ("def loss_fn(output, inputs):\n    return 1.0\n",
                   ["loss_fn(output, inputs) must return a scalar tensor, got float"]),
}
MODEL_HEAD = ("import torch\n"
              "def build_model():\n"
              "    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))\n"
              "def example_inputs():\n"
              "    return (torch.randn(2, 4),)\n")


@pytest.mark.parametrize("cmd", [["estimate"], ["estimate", "--measure"], ["optimize"]])
@pytest.mark.parametrize("kind", sorted(LOSS_FILES))
def test_loss_fn_errors_are_user_errors(tmp_path, capsys, kind, cmd):
    path = tmp_path / "m.py"
    text, expect = LOSS_FILES[kind]
    path.write_text(MODEL_HEAD + text)
    extra = ["--policy", "low", "--quiet", "--out", tmp_path / "o"] if cmd == ["optimize"] else []
    code, _, err = run(capsys, cmd[0], path, *cmd[1:], *extra)
    line = one_line(err)
    assert code == 2, err
    assert str(path) in line and "loss_fn" in line
    for e in expect:
        assert e in line, line
    assert not (tmp_path / "o").exists() and not scratch_left(tmp_path)


class _WrongPass:
    """Test-only: scales the graph's output and claims to be exact (verification rolls it back), or, with
    `crash`, raises (the pass manager records a failure)."""
    name = "test_wrong_output"
    exact = True
    test_only = True

    @dataclasses.dataclass
    class Options:
        crash: bool = False

    def run(self, program, ctx):
        from fxmem.pipeline import PassResult
        if ctx.options.crash:
            raise RuntimeError("deliberate bug in a pass")
        graph = program.graph
        out = next(n for n in graph.nodes if n.op == "output")
        first = out.args[0][0]
        with graph.inserting_before(out):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (first, 1.5))
        out.args = ((scaled, *out.args[0][1:]),)
        return PassResult(program, True)


@pytest.fixture
def wrong_pass():
    from fxmem import pipeline
    from fxmem.policy import unregister_options
    pipeline.register(_WrongPass)
    yield
    pipeline.REGISTRY.pop(_WrongPass.name, None)
    unregister_options(_WrongPass.name)


@pytest.mark.parametrize("crash", [False, True], ids=["rolled_back", "failed"])
def test_strict_refusing_a_pass_exits_3_not_internal_error_and_writes_nothing(tmp_path, capsys, wrong_pass, crash):
    """Without --strict the pass is rolled back (or its failure recorded) and the run succeeds; --strict refuses the
    result with its own exit code (3, documented), one line naming the pass, nothing written."""
    model = tmp_path / "m.py"
    model.write_text(MODEL_HEAD)
    policy = tmp_path / "p.yaml"
    policy.write_text(f"version: 1\npasses:\n  test_wrong_output:\n    enabled: true\n    crash: {str(crash).lower()}\n")
    code, _, err = run(capsys, "optimize", model, "--policy", policy, "--quiet", "--out", tmp_path / "lenient")
    assert code == 0, err
    code, _, err = run(capsys, "optimize", model, "--policy", policy, "--quiet", "--strict", "--out", tmp_path / "o")
    line = one_line(err)
    assert code == 3, err
    assert "test_wrong_output" in line and ("failed" if crash else "rolled back") in line
    assert not (tmp_path / "o").exists() and not scratch_left(tmp_path)


def test_exit_codes_are_documented_in_the_cli_help_and_readme(capsys):
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "3 refused by --strict" in help_text and "1 internal error" in help_text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "3 refused by `--strict`" in readme


def test_loss_fn_error_inside_a_pass_is_not_taken_for_a_pass_bug(tmp_path):
    """The model file's loss_fn failing while a pass computes a loss is the user's error, raised as such, not a
    pass failure rolled back (nor a PassError under strict)."""
    import dataclasses

    from fxmem import pipeline
    from fxmem.modelfile import LossFnError, load_model_file
    from fxmem.pipeline import PassResult
    from fxmem.policy import unregister_options
    from fxmem.step import compute_loss

    path = tmp_path / "m.py"
    path.write_text(MODEL_HEAD + "FAIL = []\ndef loss_fn(output, inputs):\n"
                    "    if FAIL:\n        raise ValueError('only inside the pass')\n    return output.sum()\n")
    mf = load_model_file(path)

    @dataclasses.dataclass
    class _Opts:
        x: int = 0

    class _LossPass:
        name = "test_loss_in_pass"
        exact = True
        test_only = True
        Options = _Opts

        def run(self, program, ctx):
            mf.module.FAIL.append(1)
            out = program.module(*program.example_args)
            compute_loss(ctx.loss_fn, out, program.example_args, {})
            return PassResult(program, False)

    pipeline.register(_LossPass)
    try:
        for strict in (False, True):
            mf.module.FAIL.clear()
            with pytest.raises(LossFnError, match="only inside the pass") as ei:
                fxmem.transform(mf.model, mf.args, mf.kwargs, loss_fn=mf.loss_fn, strict=strict,
                                policy={"version": 1, "passes": {"test_loss_in_pass": {"enabled": True}}})
            assert str(path) in str(ei.value) and "loss_fn" in str(ei.value)
    finally:
        pipeline.REGISTRY.pop(_LossPass.name, None)
        unregister_options(_LossPass.name)


def test_estimate_does_not_turn_internal_value_errors_into_model_file_errors(capsys, monkeypatch):
    import fxmem.costmodel as cm

    def bug(*a, **k):
        raise ValueError("an fxmem bug")
    monkeypatch.setattr(cm, "estimate", bug)
    code, _, err = run(capsys, "estimate", MLP)
    assert code == 1 and "internal error: ValueError: an fxmem bug" in err
    monkeypatch.undo()
    code, _, err = run(capsys, "estimate", MLP, "--optimizer", "adamx")
    assert code == 2 and "--optimizer" in one_line(err)
    code, _, err = run(capsys, "estimate", MLP, "--world-size", "0")
    assert code == 2 and "--world-size" in one_line(err)


def test_default_loss_needs_a_floating_point_output(tmp_path, capsys):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent("""
        import torch
        class Classify(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 3)
            def forward(self, x):
                return self.lin(x).argmax(-1)
        def build_model():
            return Classify()
        def example_inputs():
            return (torch.randn(2, 4),)
    """))
    code, _, err = run(capsys, "estimate", path)
    line = one_line(err)
    assert code == 2 and str(path) in line and "define loss_fn(output, inputs)" in line
    code, _, err = run(capsys, "estimate", path, "--mode", "inference")
    assert code == 0, err


def _module_file(forward: str, init: str = "self.lin = torch.nn.Linear(4, 3)", extra: str = "") -> str:
    return textwrap.dedent(f"""
        import torch
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                {init}
            def forward(self, x):
                {forward}
        def build_model():
            return M()
        def example_inputs():
            return (torch.randn(2, 4),)
    """) + extra


UNTRAINABLE = {  # a model file a training step cannot run backward from: (text, words of the one-line error)
    "constant_loss": (MODEL_HEAD + "def loss_fn(output, inputs):\n    return torch.tensor(1.0)\n",
                      "loss_fn(output, inputs) returned a loss that does not depend on the model's parameters"),
    "detached_loss": (MODEL_HEAD + "def loss_fn(output, inputs):\n    return output.pow(2).mean().detach()\n",
                      "loss_fn(output, inputs) returned a loss that does not depend on the model's parameters"),
    "integer_loss": (MODEL_HEAD + "def loss_fn(output, inputs):\n    return output.argmax()\n",
                     "loss_fn(output, inputs) returned a loss of dtype int64"),
    "no_parameters": (_module_file("return x.relu()", init="pass"), "the model has no trainable parameters, so"),
    "frozen_parameters": (_module_file("return self.lin(x)",
                                       init="self.lin = torch.nn.Linear(4, 3).requires_grad_(False)"),
                          "the model has no trainable parameters (all 2 are frozen: requires_grad=False)"),
    "integer_output": (_module_file("return self.lin(x).argmax(-1)"),
                       "the model's output has no floating-point tensor to build the default loss from"),
    "output_under_no_grad": (_module_file("return self.lin(x).detach()"),
                             "the model's output does not depend on its trainable parameters"),
}


@pytest.mark.parametrize("cmd", ["estimate", "optimize"])
@pytest.mark.parametrize("kind", sorted(UNTRAINABLE))
def test_a_loss_backward_cannot_run_from_is_a_user_error(tmp_path, capsys, kind, cmd):
    """Constant, detached or integer losses, models with no trainable parameter, outputs with nothing to
    differentiate: exit 2 with one line naming the model file, before any work, nothing written; in inference
    mode (no backward) the same model file is fine."""
    path = tmp_path / "m.py"
    text, expect = UNTRAINABLE[kind]
    path.write_text(text)
    out = tmp_path / "o"
    extra = ["--policy", "low", "--quiet", "--out", out] if cmd == "optimize" else []
    code, _, err = run(capsys, cmd, path, *extra)
    line = one_line(err)
    assert code == 2 and line.startswith(f"fxmem: error: {path}: "), line
    assert expect in line, line
    assert os.listdir(tmp_path) == ["m.py"], os.listdir(tmp_path)
    if cmd == "estimate":
        code, _, err = run(capsys, "estimate", path, "--mode", "inference")
    else:
        code, _, err = run(capsys, "optimize", path, "--policy", "inference", "--quiet", "--out", out)
    assert code == 0, err


def test_transform_names_the_model_whose_loss_backward_cannot_run_from():
    class Parameterless(torch.nn.Module):
        def forward(self, x):
            return x * 2

    x = torch.randn(2, 4)
    with pytest.raises(fxmem.FxmemError, match=r"^the model \(Parameterless\): the model has no trainable parameters"):
        fxmem.transform(Parameterless(), (x,), policy={"version": 1, "passes": {}})
    lin = torch.nn.Linear(4, 3)
    with pytest.raises(fxmem.FxmemError, match="returned a loss of dtype int64"):
        fxmem.transform(lin, (x,), policy={"version": 1, "passes": {}}, loss_fn=lambda out, inp: out.argmax())
    with pytest.raises(fxmem.FxmemError, match=r"must return a scalar tensor, got shape \(2, 3\)"):
        fxmem.transform(lin, (x,), policy={"version": 1, "passes": {}}, loss_fn=lambda out, inp: out)
    res = fxmem.transform(Parameterless(), (x,), policy={"version": 1, "mode": "inference", "passes": {}})
    torch.testing.assert_close(res(x), x * 2)


EXITS = {  # model code that calls sys.exit(): (text, what the line says, the line of the call)
    "import": ("import sys\nsys.exit(3)\n", "importing the model file raised SystemExit(3)", 2),
    "build_model": ("import torch\ndef build_model():\n    exit()\ndef example_inputs():\n    return ()\n",
                    "build_model() raised SystemExit(None)", 3),
    "example_inputs": ("import torch\ndef build_model():\n    return torch.nn.Linear(4, 3)\n"
                       "def example_inputs():\n    raise SystemExit('bye')\n",
                       "example_inputs() raised SystemExit('bye')", 5),
    "loss_fn": (MODEL_HEAD + "import sys\ndef loss_fn(output, inputs):\n    sys.exit(0)\n",
                "loss_fn(output, inputs) raised SystemExit(0)", 8),
    "forward": (_module_file("sys.exit(4)", extra="import sys\n"), "the model's code raised SystemExit(4)", 8),
}


@pytest.mark.parametrize("kind", sorted(EXITS))
def test_model_code_calling_sys_exit_is_a_user_error_naming_the_line(tmp_path, capsys, kind):
    """sys.exit(), exit() or raise SystemExit in a model file (at import, in its functions, in the model's forward)
    would end fxmem with the model's exit status and nothing on stderr: exit 2 with one line naming file:line."""
    path = tmp_path / "m.py"
    text, expect, line_no = EXITS[kind]
    path.write_text(text)
    assert path.read_text().splitlines()[line_no - 1].strip().startswith(("sys.exit", "exit(", "raise SystemExit"))
    for argv in (["estimate", path], ["optimize", path, "--policy", "low", "--quiet", "--out", tmp_path / "o"]):
        code, _, err = run(capsys, *argv)
        line = one_line(err)
        assert code == 2 and line.startswith(f"fxmem: error: {path}:{line_no}: ") and expect in line, line
        assert os.listdir(tmp_path) == ["m.py"] or sorted(os.listdir(tmp_path)) == ["__pycache__", "m.py"]


# ============================================================================================ B7/B8: sizes, budgets

def test_sizes_that_overflow_are_user_errors(tmp_path, capsys, no_work):
    from fxmem.units import parse_budget, parse_size
    for s in ("1e400", "1e400B", "1e400GiB", "1e300GiB"):
        with pytest.raises(ValueError, match="too large"):
            parse_size(s)
    with pytest.raises(ValueError):
        parse_budget("1e400")
    cases = [["estimate", MLP, "--budget", "1e400"], ["estimate", MLP, "--budget", "1e400B"],
             ["optimize", MLP, "--budget", "1e400B", "--out", tmp_path / "a"],
             ["optimize", MLP, "--activation-budget", "1e400GiB", "--out", tmp_path / "b"]]
    for argv in cases:
        code, _, err = run(capsys, *argv)
        line = one_line(err)
        assert code == 2 and "1e400" in line and argv[2] in line, line
    pol = tmp_path / "p.yaml"
    pol.write_text("version: 1\nextends: low\nbudget: 1e400GiB\n")
    code, _, err = run(capsys, "policies", "show", pol)
    assert code == 2 and f"{pol}:3 budget" in one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["p.yaml"]


@pytest.mark.parametrize("value", ["", "null", "none", "0", "0%", "-1GiB"])
def test_budget_flag_must_be_a_budget(tmp_path, capsys, no_work, value):
    """An empty `--budget=` or `--budget null` would silently drop the policy's budget; 0 is no budget either (in
    estimate as in optimize). The error names the flag the user typed."""
    code, _, err = run(capsys, "optimize", MLP, "--policy", "medium", f"--budget={value}", "--out", tmp_path / "o")
    line = one_line(err)
    assert code == 2 and line.startswith("fxmem: error: --budget:") and "--set" not in line, line
    code, _, err = run(capsys, "optimize", MLP, f"--activation-budget={value}", "--out", tmp_path / "o")
    assert code == 2 and "--activation-budget" in one_line(err)
    code, _, err = run(capsys, "estimate", MLP, f"--budget={value}")
    assert code == 2 and one_line(err).startswith("fxmem: error: --budget:")
    assert not os.listdir(tmp_path)


# ============================================================================================ B9: output paths

def test_unusable_out_paths_fail_before_the_work(tmp_path, monkeypatch, capsys, no_work):
    monkeypatch.chdir(tmp_path)
    Path("plainfile").write_text("u")
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", "plainfile/sub")
    assert code == 2 and "plainfile is not a directory" in one_line(err)
    long = "n" * 300
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", long)
    assert code == 2 and "name is too long" in one_line(err)
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out=")
    assert code == 2 and "--out" in one_line(err)

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    from fxmem import staging
    monkeypatch.setattr(staging.tempfile, "mkdtemp", read_only)
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", "deep/er/out")
    line = one_line(err)
    assert code == 2 and line.startswith("fxmem: error: deep/er/out") and "Read-only file system" in line
    assert sorted(os.listdir(tmp_path)) == ["plainfile"]  # the parents made for it are gone again


def test_out_paths_that_resolve_are_written_where_they_point(tmp_path, monkeypatch, capsys):
    """A long but valid name (its temp dir's name stays short) and `newp/sub/..` (written to newp, no newp/sub)."""
    monkeypatch.chdir(tmp_path)
    long = "n" * 250
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", long)
    assert code == 0, err
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", "newp/sub/..")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted([long, "newp"])
    assert (tmp_path / "newp" / "manifest.json").exists() and not (tmp_path / "newp" / "sub").exists()


def test_os_error_while_writing_is_a_user_error_naming_the_path(tmp_path, capsys, monkeypatch):
    def disk_full(result, d):
        (d / "weights.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device", str(d / "weights.safetensors"))
    monkeypatch.setattr(output_dir, "write_result_files", disk_full)
    out = tmp_path / "a" / "b"
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", out)
    line = one_line(err)
    assert code == 2 and str(out) in line and "No space left on device" in line and "nothing was written" in line
    assert os.listdir(tmp_path) == []


def test_two_runs_to_the_same_new_out(tmp_path, capsys):
    """Both runs check `--out` at their start; the one finishing second finds it taken: exit 2 with one line, its
    temp dir removed, the first run's result intact."""
    import fxmem.modelfile as mfmod
    mf = mfmod.load_model_file(MLP)
    res = fxmem.transform(mf.model, mf.args, mf.kwargs, policy={"version": 1, "passes": {}})
    out = tmp_path / "X"
    a = output_dir.OutputDir(out)
    b = output_dir.OutputDir(out)
    a.write(res)
    with pytest.raises(fxmem.FxmemError, match="created by another process") as ei:
        b.write(res)
    b.discard()
    assert "\n" not in str(ei.value)
    assert resultdir.not_an_fxmem_result(out, sorted(os.listdir(out))) is None
    assert os.listdir(tmp_path) == ["X"]
    # with --overwrite the later run replaces the earlier one's result
    c, d = output_dir.OutputDir(out, overwrite=True), output_dir.OutputDir(out, overwrite=True)
    c.write(res)
    d.write(res)
    assert os.listdir(tmp_path) == ["X"] and (out / "manifest.json").exists()


def test_python_api_save_follows_the_same_rules(tmp_path, monkeypatch):
    import fxmem.modelfile as mfmod
    mf = mfmod.load_model_file(MLP)
    res = fxmem.transform(mf.model, mf.args, mf.kwargs, policy={"version": 1, "passes": {}})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fxmem.FxmemError, match="current working directory"):
        res.save(tmp_path, overwrite=True)
    (tmp_path / "f").write_text("x")
    with pytest.raises(fxmem.FxmemError, match="is a file"):
        res.save("f", overwrite=True)
    p = res.save("r")
    assert res.save("r", overwrite=True) == p
    loaded = fxmem.load(p).eval()
    torch.testing.assert_close(loaded(*mf.args), res.module.eval()(*mf.args))
    assert sorted(os.listdir(tmp_path)) == ["f", "r"]


# ============================================================================================ B10: diff

def test_diff_of_a_damaged_result_names_the_missing_file(result_dir, capsys):
    d = result_dir
    (d / "original.py").unlink()
    code, _, err = run(capsys, "diff", d)
    assert code == 2 and f"{d / 'original.py'}: missing" in one_line(err)
    (d / "module.json").unlink()  # the code diff shows is generated from module.json (what fxmem.load loads)
    code, _, err = run(capsys, "diff", d, d)
    assert code == 2 and f"{d / 'module.json'}: missing" in one_line(err)
    (d / "manifest.json").write_text("{}")
    code, _, err = run(capsys, "diff", d)
    assert code == 2 and f"{d / 'manifest.json'}: format None" in one_line(err)


# ============================================================================================ B11: full disks

@pytest.fixture(scope="module")
def small_result():
    """A result of a small model (no passes), to write again and again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return fxmem.transform(model, (torch.randn(2, 4),), policy={"version": 1, "passes": {}})


def _fill_disk_at(monkeypatch, name: str) -> None:
    """The disk fills up while the result's file `name` is written: the real writer fails the way a full disk makes
    it fail, after writing part of the file (safetensors: SafetensorError with the OS error in its text; Python's
    writes: OSError ENOSPC without a file name, as a write to an open file raises it)."""
    if name == "weights.safetensors":
        import safetensors.torch
        from safetensors import SafetensorError

        def save_file(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"\0" * 64)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        return

    def failing(real):
        def write(self, data, *args, **kwargs):
            if self.name != name:
                return real(self, data, *args, **kwargs)
            with open(self, "wb") as f:
                f.write(b"partial")
            raise OSError(28, "No space left on device")
        return write
    monkeypatch.setattr(Path, "write_text", failing(Path.write_text))
    monkeypatch.setattr(Path, "write_bytes", failing(Path.write_bytes))


def _snapshot(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in d.iterdir()}


@pytest.mark.parametrize("name", ["weights.safetensors", "module.json", "transformed.py", "report.html",
                                  "memory_timeline.png", "manifest.json"])
def test_a_full_disk_while_writing_any_file_is_a_user_error_naming_it(tmp_path, monkeypatch, small_result, name):
    """Whichever file the disk fills up on: one-line FxmemError naming the file and the system's reason, the
    previous result byte for byte as it was, no scratch left."""
    out = tmp_path / "X"
    output_dir.OutputDir(out).write(small_result)
    before, ino = _snapshot(out), out.stat().st_ino
    _fill_disk_at(monkeypatch, name)
    with pytest.raises(fxmem.FxmemError) as ei:
        with output_dir.OutputDir(out, overwrite=True) as o:
            o.write(small_result)
    monkeypatch.undo()
    assert str(ei.value) == (f"{out}: writing the result failed at {name}: No space left on device; nothing was "
                             "written"), str(ei.value)
    assert _snapshot(out) == before and out.stat().st_ino == ino
    assert os.listdir(tmp_path) == ["X"]


def test_a_full_disk_in_the_cli_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    model = tmp_path / "m.py"
    model.write_text(MODEL_HEAD)
    out = tmp_path / "o" / "X"
    _fill_disk_at(monkeypatch, "weights.safetensors")
    code, _, err = run(capsys, "optimize", model, *FAST, "--out", out)
    assert code == 2 and one_line(err) == (f"fxmem: error: {out}: writing the result failed at weights.safetensors: "
                                           "No space left on device; nothing was written")
    assert os.listdir(tmp_path) == ["m.py"]


def test_real_failing_writes_in_a_real_process_exit_2(tmp_path):
    """No fake: the process may write no file larger than 256 KiB (RLIMIT_FSIZE), so writing 1 MiB of weights
    really fails (EFBIG, the way a quota or a full disk does): exit 2, one line naming the file, nothing left."""
    resource = pytest.importorskip("resource")
    model = tmp_path / "m.py"
    model.write_text(MODEL_HEAD.replace("Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)",
                                        "Linear(4, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)"))
    limit = 256 * 1024

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    r = subprocess.run([sys.executable, "-m", "fxmem.cli", "optimize", str(model), *FAST, "--out", "X"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert r.returncode == 2, r.stderr
    assert one_line(r.stderr) == ("fxmem: error: X: writing the result failed at weights.safetensors: File too "
                                  "large; nothing was written"), r.stderr
    assert sorted(os.listdir(tmp_path)) in (["m.py"], ["__pycache__", "m.py"])


# ========================================================================================== B12: signals at the edges

def _env() -> dict:
    """The environment of a child fxmem process: this source tree first on the path, one thread."""
    path = os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


_AT_MOMENT = textwrap.dedent("""
    import atexit, sys, time
    from pathlib import Path
    import fxmem.cli as cli
    marker, moment = Path(sys.argv[1]), sys.argv[2]
    def arrived(*args):  # test hook: the moment is reached; the test sends its signal now
        marker.write_text(moment)
        time.sleep(1)
    if moment == "summary":  # the result is in place; the summary is being printed
        real = cli._print_summary
        cli._print_summary = lambda *a: (arrived(), real(*a))
    elif moment == "exit":  # main has returned: the interpreter is ending
        atexit.register(arrived)
    sys.argv = ["fxmem"] + sys.argv[3:]
    sys.exit(cli.main())
""")


def _signal_at(tmp_path: Path, moment: str, sig, argv: list) -> subprocess.CompletedProcess:
    """Run fxmem in a child process, send `sig` when it reaches `moment` (a marker file appears), wait for it."""
    marker = tmp_path / "moment"
    env = dict(_env(), FXMEM_TEST_MARKER=str(marker))
    p = subprocess.Popen([sys.executable, "-c", _AT_MOMENT, str(marker), moment, *map(str, argv)], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), p.communicate(timeout=30)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    marker.unlink()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.parametrize("moment,sig,word", [("summary", signal.SIGTERM, "terminated (SIGTERM)"),
                                             ("exit", signal.SIGINT, "interrupted")])
def test_a_signal_once_the_result_is_written_keeps_the_success(tmp_path, moment, sig, word):
    """SIGINT/SIGTERM right after the result is in place (while the summary prints, or while the process ends): the
    result is complete on disk, so the run succeeds (exit 0), with no traceback."""
    model = tmp_path / "m.py"
    model.write_text(MODEL_HEAD)
    r = _signal_at(tmp_path, moment, sig, ["optimize", model, *FAST, "--out", "X"])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr
    if moment == "summary":
        assert f"{word} after the run had completed: the result is complete in X; exit status 0" in r.stderr
    assert resultdir.not_an_fxmem_result(tmp_path / "X", sorted(os.listdir(tmp_path / "X"))) is None
    assert not scratch_left(tmp_path)


@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_in_model_code_is_an_interruption_not_a_model_error(tmp_path, sig, code, word):
    """Interrupting build_model() (model code, where SystemExit is a user error) stays an interruption: 130/143,
    nothing written."""
    model = tmp_path / "m.py"
    model.write_text(MODEL_HEAD.replace("def build_model():\n", "def build_model():\n    import os, time\n"
                                        "    open(os.environ['FXMEM_TEST_MARKER'], 'w').close()\n"
                                        "    time.sleep(60)\n"))
    r = _signal_at(tmp_path, "build", sig, ["optimize", model, *FAST, "--out", "X"])
    assert r.returncode == code, r.stderr
    assert one_line(r.stderr) == f"fxmem: {word}; nothing was written"
    assert sorted(os.listdir(tmp_path)) in (["m.py"], ["__pycache__", "m.py"])


@pytest.mark.parametrize("into", ["RuntimeError", "FxmemError", "nothing"])
def test_an_interrupt_turned_into_something_else_is_still_an_interruption(tmp_path, capsys, monkeypatch, into):
    """Code between the signal and fxmem (a model, a library) may catch the KeyboardInterrupt and raise another
    error, or carry on: the run was interrupted all the same and says so (130), never success nor a model error;
    nothing is written."""
    model = tmp_path / "m.py"
    model.write_text(MODEL_HEAD)

    def swallowing_transform(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            if into == "RuntimeError":
                raise RuntimeError("interrupted while compiling") from None
            if into == "FxmemError":
                raise fxmem.FxmemError("a step failed") from None
        raise AssertionError("carried on without a result")  # (what a transform that swallowed it could do next)
    monkeypatch.setattr(api, "transform", swallowing_transform)
    code, _, err = run(capsys, "optimize", model, *FAST, "--out", tmp_path / "X")
    assert code == 130 and one_line(err) == "fxmem: interrupted; nothing was written"
    assert os.listdir(tmp_path) == ["m.py"]


# ======================================================================================== B13: leftovers of killed runs

_HOLD_SCRATCH = textwrap.dedent("""
    import sys, time
    from fxmem.output_dir import OutputDir
    out = OutputDir(sys.argv[1])  # a run to sys.argv[1] with its scratch directory, half written
    (out.staging / "result").mkdir()
    (out.staging / "result" / "weights.safetensors").write_bytes(b"partial")
    print(out.staging, flush=True)
    time.sleep(120)
""")


def _alike(parent: Path, name: str, marker: str | None) -> Path:
    """A directory named like fxmem's scratch for `name`, holding `marker` as its marker file's text."""
    d = parent / f".{name}.fxmem-tmp-{abs(hash(marker)) % 10 ** 6}"
    d.mkdir()
    (d / "data").write_text("someone's data")
    if marker is not None:
        (d / ".fxmem-staging").write_text(marker)
    return d


def test_scratch_left_by_a_killed_run_is_removed_by_the_next_run_and_only_that(tmp_path, capsys):
    """SIGKILL leaves the scratch directory of a run beside --out. The next run to that output removes it, and only
    what fxmem made (its name AND its marker naming that output) for a run that is over: never a live run's, in
    another process or this one, nor a directory merely named alike, nor one whose marker names another output."""
    out = tmp_path / "X"
    p = subprocess.Popen([sys.executable, "-c", _HOLD_SCRATCH, str(out)], env=_env(), stdout=subprocess.PIPE,
                         text=True)
    try:
        killed = Path(p.stdout.readline().strip())
        assert killed.name.startswith(".X.fxmem-tmp-") and (killed / "result").is_dir()
        named_alike = _alike(tmp_path, "X", None)
        other_output = _alike(tmp_path, "X", json.dumps({"kind": "fxmem-staging", "output": "Y", "pid": 1}))
        not_json = _alike(tmp_path, "X", "junk")
        with output_dir.OutputDir(out) as live:  # a second run while the first is alive: the first's scratch stays
            assert killed.is_dir() and live.staging.is_dir()
            p.kill()
            p.wait(timeout=30)
            assert killed.is_dir()  # nobody removes anything by itself
            model = tmp_path / "m.py"
            model.write_text(MODEL_HEAD)
            code, _, err = run(capsys, "optimize", model, *FAST, "--out", out)
            assert code == 0, err
            assert not killed.exists(), "the killed run's scratch directory is still there"
            assert live.staging.is_dir(), "a live run's scratch directory was removed"
        for d in (named_alike, other_output, not_json):
            assert (d / "data").read_text() == "someone's data"
        assert sorted(os.listdir(tmp_path)) == sorted(["X", "m.py", named_alike.name, other_output.name,
                                                       not_json.name] + (["__pycache__"] if (tmp_path / "__pycache__")
                                                                         .exists() else []))
    finally:
        if p.poll() is None:
            p.kill()


def test_a_previous_result_in_a_leftover_scratch_directory_is_never_removed(tmp_path, result_dir, capsys,
                                                                            monkeypatch):
    """A scratch directory can hold the only copy of the previous result: when neither rename of a replacement can
    be undone (the error says where it is), or when a run was killed between the two renames (systems without an
    atomic exchange). Later runs never remove it; the second case is said."""
    from fxmem.staging import claim_scratch, release_scratch
    real_replace = os.replace
    calls = []

    def second_and_back_fail(a, b):
        calls.append((a, b))
        if len(calls) >= 2 and Path(b) == result_dir:  # the new result into place, then the previous one back
            raise OSError(28, "No space left on device")
        return real_replace(a, b)
    monkeypatch.setattr(output_dir, "exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", second_and_back_fail)
    code, _, err = run(capsys, "optimize", MLP, *FAST, "--out", result_dir, "--overwrite")
    monkeypatch.undo()
    assert code == 2 and "the previous result is in" in one_line(err), err
    kept = Path(one_line(err).split("the previous result is in ")[1].split(";")[0])
    assert (kept / "manifest.json").exists() and not result_dir.exists()
    output_dir.OutputDir(result_dir).discard()
    assert (kept / "manifest.json").exists()
    # killed between the renames: fxmem's marker, nobody holding its lock, the previous result inside, no target
    shutil.rmtree(kept.parent)
    other = tmp_path / "Y"
    scratch, claim = claim_scratch(tmp_path, "Y")
    release_scratch(claim)  # (what the system does when the process dies)
    (scratch / "previous").mkdir()
    (scratch / "previous" / "manifest.json").write_text("{}")
    with pytest.warns(RuntimeWarning, match="holds the previous result of"):
        output_dir.OutputDir(other).discard()
    assert (scratch / "previous" / "manifest.json").exists()
    shutil.rmtree(scratch / "previous")  # once the output exists again, or without a previous result: removed
    output_dir.OutputDir(other).discard()
    assert not scratch.exists()
