"""The PassManager: verification and rollback (with deliberately wrong test-only passes), strict mode, clear
errors for unimplemented passes, determinism, transform/save/load round trips and atomic output."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import fxmem
from fxmem import pipeline
from fxmem.cli import main
from fxmem.pipeline import Change, PassResult
from fxmem.policy import unregister_options

from .conftest import ROOT, example, scale_output_pass


@dataclasses.dataclass
class _NoOptions:
    scale: float = 1.01


_ScaleOutputPass = scale_output_pass("test_scale", exact=True)  # claims to be exact: it is not


class _CrashPass:
    name = "test_crash"
    exact = True
    test_only = True
    Options = _NoOptions

    def run(self, program, ctx):
        raise RuntimeError("deliberate bug in a pass")


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("deliberate failure in training mode")


class _TrainingOnly(torch.nn.Module):
    """Identity in eval mode; in training mode scales by `scale` or, with `scale` None, fails in backward (as a
    broken checkpoint region would: graph checks run forward only)."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        if not self.training:
            return x
        if self.scale is None:
            return _FailingBackward.apply(x)
        return x * self.scale


def _wrap_first_output(program, module):
    g = program.graph
    program.module.add_submodule("fxmem_test_training_only", module)
    out = next(n for n in g.nodes if n.op == "output")
    first = out.args[0][0] if isinstance(out.args[0], (list, tuple)) else out.args[0]
    with g.inserting_before(out):
        new = g.call_module("fxmem_test_training_only", (first,))
    out.args = ((new,) + tuple(out.args[0][1:]),) if isinstance(out.args[0], (list, tuple)) else (new,)
    return [Change("training_only", "", [first.name], [new.name], "test")]


@dataclasses.dataclass
class _TrainOptions:
    scale: float | None = 1.01
    draws_differ: bool = False


class _TrainingOnlyPass:
    """Test-only: claims to be exact and is, in eval mode; in training mode it scales the first output (or, with
    `scale: null`, raises): what only a training-mode check sees (checkpoint regions recompute only in training)."""
    name = "test_training_only"
    exact = True
    test_only = True
    Options = _TrainOptions

    def run(self, program, ctx):
        changes = _wrap_first_output(program, _TrainingOnly(ctx.options.scale))
        return PassResult(program, True, changes, draws_differ=ctx.options.draws_differ)


@pytest.fixture
def test_passes():
    for cls in (_ScaleOutputPass, _CrashPass, _TrainingOnlyPass):
        pipeline.register(cls)
    yield
    for cls in (_ScaleOutputPass, _CrashPass, _TrainingOnlyPass):
        pipeline.REGISTRY.pop(cls.name, None)
        unregister_options(cls.name)


def _policy(**passes):
    return {"version": 1, "mode": "train", "optimizer": "adamw",
            "passes": {k: v for k, v in passes.items()}}


def test_wrong_exact_pass_is_rolled_back(test_passes):
    model, args, kwargs, loss_fn = example("mlp_digits")
    res = fxmem.transform(model, args, kwargs, policy=_policy(test_scale={"enabled": True}), loss_fn=loss_fn)
    rec = res.records[0]
    assert rec.name == "test_scale" and rec.status == "rolled_back"
    assert "exact pass changed the result" in rec.reason
    res.module.eval()
    model.eval()
    torch.testing.assert_close(res.module(*args), model(*args))
    md = res.report.to_markdown()
    assert "rolled" in md.lower() and "test_scale" in md


def test_exact_pass_wrong_only_in_training_mode_is_rolled_back(test_passes):
    model, args, kwargs, loss_fn = example("mlp_digits")
    res = fxmem.transform(model, args, kwargs, policy=_policy(test_training_only={"enabled": True}),
                          loss_fn=loss_fn)
    rec = res.records[0]
    assert rec.status == "rolled_back", rec.to_dict()
    assert "training-mode step" in rec.reason and "output" in rec.reason
    assert rec.train_check == {"compared": True, "ok": False, "checked": len(list(model.parameters())),
                               "why": rec.train_check["why"]}
    assert not hasattr(res.module, "fxmem_test_training_only")


def test_pass_whose_training_step_raises_is_rolled_back(test_passes):
    model, args, kwargs, loss_fn = example("mlp_digits")
    res = fxmem.transform(model, args, kwargs, policy=_policy(test_training_only={"enabled": True, "scale": None}),
                          loss_fn=loss_fn)
    rec = res.records[0]
    assert rec.status == "rolled_back"
    assert "training-mode step fails" in rec.reason and "deliberate failure in training mode" in rec.reason
    with pytest.raises(fxmem.errors.PassError, match="training-mode step fails"):
        fxmem.transform(model, args, kwargs, policy=_policy(test_training_only={"enabled": True, "scale": None}),
                        loss_fn=loss_fn, strict=True)


def test_pass_drawing_differently_is_run_in_training_mode_not_compared(test_passes):
    model, args, kwargs, loss_fn = example("mlp_digits")
    res = fxmem.transform(model, args, kwargs,
                          policy=_policy(test_training_only={"enabled": True, "draws_differ": True}), loss_fn=loss_fn)
    rec = res.records[0]
    assert rec.status == "applied"
    assert rec.train_check["compared"] is False and rec.train_check["ok"] is True
    assert "training-mode step: runs" in res.report.to_markdown()


def test_exact_pass_training_step_compared_and_reported():
    model, args, kwargs, loss_fn = example("unet")
    res = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, policy={
        "version": 1, "mode": "train", "budget": "60%", "budget_strict": False,
        "passes": {"checkpoint": {"enabled": True}}})
    rec = next(r for r in res.records if r.name == "checkpoint")
    assert rec.status == "applied"
    assert rec.train_check["compared"] and rec.train_check["ok"], rec.train_check
    assert "training-mode step (seeded" in res.report.to_markdown()


def test_wrong_pass_passes_when_tolerance_allows(test_passes):
    model, args, kwargs, loss_fn = example("mlp_digits")
    pol = _policy(test_scale={"enabled": True, "scale": 1.0})
    res = fxmem.transform(model, args, kwargs, policy=pol, loss_fn=loss_fn)
    assert res.records[0].status == "applied"


def test_strict_makes_rollback_an_error(test_passes):
    model, args, kwargs, loss_fn = example("mlp_digits")
    with pytest.raises(fxmem.PassError, match="test_scale"):
        fxmem.transform(model, args, kwargs, policy=_policy(test_scale={"enabled": True}), strict=True)


def test_crashing_pass_is_recorded_and_model_kept(test_passes):
    model, args, kwargs, loss_fn = example("mlp_digits")
    res = fxmem.transform(model, args, kwargs, policy=_policy(test_crash={"enabled": True}), loss_fn=loss_fn)
    rec = res.records[0]
    assert rec.status == "failed" and "deliberate bug" in rec.reason
    out = res.module(*args)
    assert out.shape[0] == args[0].shape[0]


def test_unimplemented_pass_is_a_clear_error(monkeypatch):
    # pretend 'gating' has no implementation in this build
    pipeline.load_passes()
    monkeypatch.delitem(pipeline.REGISTRY, "gating", raising=False)
    pm = pipeline.PassManager(fxmem.load_policy({"version": 1, "passes": {"gating": {"enabled": True}}}))
    with pytest.raises(fxmem.PolicyError, match="passes.gating: this pass is not implemented"):
        pm.enabled_passes()


def test_determinism_same_graph_and_report(test_passes):
    outs = []
    for _ in range(2):
        model, args, kwargs, loss_fn = example("gpt")
        res = fxmem.transform(model, args, kwargs, policy=_policy(test_scale={"enabled": True, "scale": 1.0}),
                              loss_fn=loss_fn)
        outs.append((res.module.code, res.report.to_json(deterministic=True),
                     res.report.to_markdown(deterministic=True)))
    assert outs[0] == outs[1]


def test_transform_save_load_roundtrip(tmp_path):
    model, args, kwargs, loss_fn = example("hf_gpt2")
    res = fxmem.transform(model, args, kwargs, policy={"version": 1, "passes": {}}, loss_fn=loss_fn)
    path = res.save(tmp_path / "r")
    for f in ("module.json", "weights.safetensors", "transformed.py", "original.py", "manifest.json",
              "report.md", "report.html", "report.json"):
        assert (path / f).exists(), f
    loaded = fxmem.load(path)
    loaded.eval()
    model.eval()
    torch.testing.assert_close(loaded(*args, **kwargs).logits, model(*args, **kwargs).logits)
    loaded.train()
    loaded(*args, **kwargs).logits.float().mean().backward()
    assert all(p.grad is not None for p in loaded.parameters() if p.requires_grad)


def test_load_refuses_tampered_module(tmp_path):
    model, args, kwargs, _ = example("mlp_digits")
    res = fxmem.transform(model, args, kwargs, policy={"version": 1, "passes": {}})
    path = res.save(tmp_path / "r")
    with open(path / "module.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(fxmem.FxmemError, match="module.json: does not match the manifest's sha256"):
        fxmem.load(path)


def test_save_never_overwrites_without_asking(tmp_path):
    model, args, kwargs, _ = example("mlp_digits")
    res = fxmem.transform(model, args, kwargs, policy={"version": 1, "passes": {}})
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "mine.txt").write_text("user data")
    with pytest.raises(fxmem.FxmemError, match="already exists"):
        res.save(dest)
    assert (dest / "mine.txt").read_text() == "user data"
    # --overwrite replaces only a result fxmem wrote: the user's directory is refused, untouched
    with pytest.raises(fxmem.FxmemError, match="not a result written by fxmem"):
        res.save(dest, overwrite=True)
    assert sorted(p.name for p in dest.iterdir()) == ["mine.txt"]
    ours = tmp_path / "ours"
    res.save(ours)
    res.save(ours, overwrite=True)
    assert (ours / "manifest.json").exists()
    assert not [p for p in tmp_path.iterdir() if "fxmem-tmp" in p.name or "fxmem-old" in p.name]


def test_cli_optimize_failure_leaves_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "result"
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\npasses:\n  checkpoint:\n    budget: lots\n")
    code = main(["optimize", str(ROOT / "examples" / "mlp_digits.py"), "--policy", str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "bad.yaml:4" in err and "passes.checkpoint.budget" in err
    assert not out.exists()
    # an internal failure while writing: nothing partial, the existing result untouched
    code = main(["optimize", str(ROOT / "examples" / "mlp_digits.py"), "--policy", "low", "--out", str(out),
                 "--quiet", "--set", "passes.checkpoint.enabled=false", "--set", "passes.attention.enabled=false"])
    assert code == 0
    before = sorted(p.name for p in out.iterdir())
    from fxmem import report as report_mod

    def boom(self, directory, deterministic=False):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report_mod.Report, "save", boom)
    code = main(["optimize", str(ROOT / "examples" / "mlp_digits.py"), "--policy", "low", "--out", str(out),
                 "--overwrite", "--quiet", "--set", "passes.checkpoint.enabled=false",
                 "--set", "passes.attention.enabled=false"])
    assert code == 1
    assert sorted(p.name for p in out.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if "fxmem-tmp" in p.name]


def test_cli_optimize_writes_everything(tmp_path, capsys):
    out = tmp_path / "res"
    code = main(["optimize", str(ROOT / "examples" / "mlp_digits.py"), "--policy", "low", "--out", str(out),
                 "--quiet", "--set", "passes.checkpoint.enabled=false", "--set", "passes.attention.enabled=false"])
    assert code == 0, capsys.readouterr().err
    names = set(os.listdir(out))
    assert {"report.md", "report.html", "report.json", "transformed.py", "module.json", "manifest.json"} <= names
    assert json.loads((out / "report.json").read_text())["schema_version"] == 1
    code = main(["diff", str(out)])
    assert code == 0


def test_passes_run_with_long_lived_objects_frozen(monkeypatch):
    """Objects from before the passes are out of the cyclic GC's view while they run (full collections would walk
    the whole heap); cyclic garbage made meanwhile is still collected; a freeze made by someone else is kept (the
    context never unfreezes it: the frozen count alone can drop when a frozen object is freed meanwhile)."""
    import gc
    import weakref

    class Cycle:
        pass

    assert gc.get_freeze_count() == 0
    with pipeline.long_lived_frozen():
        assert gc.get_freeze_count() > 0
        c = Cycle()
        c.self = c
        ref = weakref.ref(c)
        del c
        gc.collect()
        assert ref() is None  # garbage made while frozen is collected
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with pipeline.long_lived_frozen():
            raise RuntimeError("a pass failed")
    assert gc.get_freeze_count() == 0  # unfrozen on the way out of a failure too
    gc.freeze()
    try:
        unfreezes = []
        with monkeypatch.context() as m:
            m.setattr(gc, "unfreeze", lambda: unfreezes.append(1))
            with pipeline.long_lived_frozen():
                pass
        assert not unfreezes and gc.get_freeze_count() > 0  # the caller's freeze is not undone
    finally:
        gc.unfreeze()
