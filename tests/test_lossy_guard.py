"""The guard of lossy changes (fxmem/lossguard.py) and the intent line (fxmem/intent.py), on models trained here on
data shipped in packages: a digits MLP (scikit-learn's digits) and a byte-level GPT (Python standard-library source).

Each kind of lossy change is judged end to end in users' terms (top-1 agreement, relative output error, the loss,
or the user's evaluate()); what a setting asked and what was achieved is said in one line at the top of the CLI
summary and the report; strict makes a shortfall an error; `fxmem.transform(evaluate=, evaluate_mode=)` judges as a
model file's evaluate() does."""
from __future__ import annotations

import inspect
import json
import types

import pytest
import torch

import fxmem
from fxmem import registry
from fxmem.cli import main
from fxmem.errors import FxmemError
from fxmem.pass_api import PassRecord, register
from fxmem.report import Report

from .conftest import ROOT, example_module, scale_output_pass, trained_digits_state

dig = example_module("mlp_digits")
gpt = example_module("gpt")


# ============================================================================================ trained models

@pytest.fixture(scope="module")
def digits_state():
    """A digits MLP (hidden 128) trained six epochs on the training split (images 0..1499)."""
    return trained_digits_state(128)


def digits_model(state):
    model = dig.build_model(hidden=128)
    model.load_state_dict(state)
    return model.eval()


@pytest.fixture(scope="module")
def text_model():
    """A one-layer byte-level GPT trained 150 steps on windows of standard-library source (json, textwrap, ...)."""
    import collections
    import functools
    import textwrap
    chunks = [open(inspect.getsourcefile(m), "rb").read() for m in (json, textwrap, functools, collections)]
    data = torch.tensor(list(b"\n".join(chunks)), dtype=torch.long)
    model = gpt.build_model(n_layer=1, n_head=2, d_model=64, block_size=64, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(150):
        starts = torch.randint(0, data.numel() - 33, (8,), generator=g)
        x = torch.stack([data[i:i + 32] for i in starts])
        opt.zero_grad()
        gpt.loss_fn(model(x), (x,)).backward()
        opt.step()
    return model.eval()


DIGITS_CAL = dig.calibration_data(n_batches=16)
TEXT_CAL = gpt.calibration_data(n_batches=8, batch=4, seq_len=32)
TEXT_EXAMPLE = gpt.example_inputs(batch=4, seq_len=32)


def text_loss(module):
    """Mean next-byte cross-entropy on held-out standard-library text (lower is better)."""
    return gpt.evaluate(module, n_batches=2, batch=4, seq_len=32)


def inference(**passes):
    return {"version": 1, "mode": "inference", "optimizer": "none", "passes": passes}


def record(res, name):
    return next(r for r in res.records if r.name == name)


# ============================================================================================ weights

@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("model_name", ["digits", "text"])
def test_int8_and_nf4_apply_by_default_with_a_stated_error(kind, model_name, digits_state, text_model):
    """With the defaults of their kind, int8 and nf4 weights go on every linear that qualifies, and the report states
    the end-to-end error they cost (top-1 agreement and relative output error on the calibration items)."""
    model, args, cal = ((digits_model(digits_state), dig.example_inputs(), DIGITS_CAL) if model_name == "digits"
                        else (text_model, TEXT_EXAMPLE, TEXT_CAL))
    res = fxmem.transform(model, args, policy=inference(precision={"compute": "fp32", "weights": kind}),
                          calibration=cal)
    rec = record(res, "precision")
    assert rec.status == "applied", rec.reason
    (intent,) = rec.intents
    # linears and the weights stored quantized elsewhere (the text model's embedding tables)
    done = rec.metrics["linears_quantized"] + rec.metrics.get("weights_stored_quantized", 0)
    assert intent["complete"] and intent["achieved"] == f"quantized {done} of {done}"
    (verdict,) = rec.metrics["guard"]
    assert verdict["kind"] == ("4bit" if kind == "nf4" else "int8") and verdict["accepted"]
    assert set(verdict["limits"]) == {"rel_error", "top1_agreement"}  # class scores: predictions are judged
    assert 0 < verdict["measures"]["rel_error"] and verdict["measures"]["top1_agreement"] >= 0.95
    words = "4-bit weights" if kind == "nf4" else "int8 weights"
    assert f"guard, on what was kept ({words}): accepted: {verdict['summary']}" in res.report.to_markdown()
    assert "on 8 calibration item(s)" in verdict["summary"] and not res.report.shortfalls()


def test_a_guard_stricter_than_nf4_backs_off_and_says_which_setting_to_change(text_model):
    """nf4 asked where the policy demands 99.9% of predictions unchanged: the linears with the largest own error keep
    their weights until the guard accepts, and the line names what was asked, done, and the setting to lower."""
    pol = inference(precision={"compute": "fp32", "weights": "nf4"})
    pol["verify"] = {"top1_agreement": 0.999}
    res = fxmem.transform(text_model, TEXT_EXAMPLE, policy=pol, calibration=TEXT_CAL)
    (line,) = res.report.shortfalls()
    assert line.startswith("precision: asked nf4 weights on 4 linear(s) and 2 other weight(s), quantized ")
    assert ": the guard (top-1 agreement " in line and "% < 99.9% on 8 calibration item(s)) stopped it" in line
    assert "lower verify.top1_agreement (now 99.9%)" in line and line.endswith("or give evaluate (the task "
                                                                                  "metric then decides)")


def test_fp16_that_overflows_is_backed_off_where_it_overflows(digits_state):
    """A deliberately damaging setting: fp16 compute on a model whose first layer's activations exceed fp16's range
    (the same function in fp32: ReLU commutes with the scaling). The guard refuses the whole plan (infinite error),
    the overflowing sites go back to fp32 first, and the result is finite and close to the original."""
    model = digits_model(digits_state)
    with torch.no_grad():
        model.net[0].weight.mul_(1e5)
        model.net[0].bias.mul_(1e5)
        model.net[2].weight.mul_(1e-5)
    x = DIGITS_CAL[0][0]
    assert torch.isinf(model.net[1](model.net[0](x)).half()).any()
    res = fxmem.transform(model, dig.example_inputs(), policy=inference(precision={"compute": "fp16"}),
                          calibration=DIGITS_CAL)
    rec = record(res, "precision")
    (asked,) = rec.metrics["guard_asked"]
    assert not asked["accepted"] and asked["failed"][0].startswith("relative output error inf > 0.05")
    (line,) = res.report.shortfalls()
    assert line.startswith("precision: asked fp16 compute at ") and "the guard (relative output error inf" in line
    assert rec.status == "applied" and rec.metrics["guard"][0]["accepted"]
    with torch.no_grad():
        out = res.module.eval()(x)
    assert torch.isfinite(out).all() and (out.argmax(-1) == model(x).argmax(-1)).float().mean() >= 0.95


# ============================================================================================ pruning

@pytest.mark.parametrize("with_evaluate", [False, True])
def test_pruning_a_quarter_removes_a_fifth_of_the_parameters_within_a_point(with_evaluate, digits_state):
    """fraction 0.25 through the Python API: at least 20% of the parameters go, the held-out accuracy moves by at
    most one point, judged by top-1 agreement on held-out calibration items, or by evaluate() when given."""
    model = digits_model(digits_state)
    kw = dict(evaluate=dig.evaluate, evaluate_mode="max") if with_evaluate else {}
    res = fxmem.transform(model, dig.example_inputs(), policy=inference(pruning={"fraction": 0.25}),
                          calibration=DIGITS_CAL, **kw)
    rec = record(res, "pruning")
    assert rec.status == "applied", rec.reason
    assert rec.metrics["params_removed_share"] >= 0.20
    assert dig.evaluate(model) - dig.evaluate(res.module) <= 0.01
    (intent,) = rec.intents
    assert intent["complete"] and intent["asked"] == "25% of 256 hidden units"
    (verdict,) = rec.metrics["guard"]
    assert list(verdict["limits"]) == (["metric_drop"] if with_evaluate else ["rel_error", "top1_agreement"])


def test_pruning_nine_tenths_is_refused_with_the_reason_in_the_summary_line(digits_state):
    """fraction 0.9 is refused (top-1 agreement collapses); the guard backs off group by group and the line says
    what was asked, what was removed, what stopped it and which setting to change."""
    res = fxmem.transform(digits_model(digits_state), dig.example_inputs(),
                          policy=inference(pruning={"fraction": 0.9}), calibration=DIGITS_CAL)
    rec = record(res, "pruning")
    (line,) = res.report.shortfalls()
    assert line.startswith("pruning: asked 90% of 256 hidden units, removed ")
    assert "stopped it; raise passes.pruning.tolerance (now 0.3) or lower verify.top1_agreement (now 97.0%)" in line
    assert rec.metrics["guard"][0]["measures"]["top1_agreement"] >= 0.97
    assert rec.metrics["guard_asked"][0]["measures"]["top1_agreement"] < 0.5
    assert res.report.to_markdown().split("## Summary")[0].count(f"short of the policy: {line}") == 1
    with pytest.raises(fxmem.ShortfallError,
                       match="strict: a lossy pass did less than the policy asked .pruning: asked 90%"):
        fxmem.transform(digits_model(digits_state), dig.example_inputs(),
                        policy=inference(pruning={"fraction": 0.9}), calibration=DIGITS_CAL, strict=True)


def test_evaluate_mode_says_which_way_is_better(text_model):
    """The direction of evaluate() is the caller's argument: a loss with evaluate_mode="min" refuses pruning that
    raises it by more than verify.metric_tolerance; the same loss read as "max" (higher is better) takes it whole."""
    pol = inference(pruning={"fraction": 0.9, "min_keep": 1})
    res = fxmem.transform(text_model, TEXT_EXAMPLE, policy=pol, calibration=TEXT_CAL, evaluate=text_loss,
                          evaluate_mode="min")
    rec = record(res, "pruning")
    asked, kept = rec.metrics["guard_asked"][0], rec.metrics["guard"][0]
    assert asked["measures"]["metric_after"] - asked["measures"]["metric_before"] > 0.01 and not asked["accepted"]
    assert kept["measures"]["metric_drop"] <= 0.01
    assert text_loss(res.module) - text_loss(text_model) <= 0.01 + 1e-6
    wrong_way = fxmem.transform(text_model, TEXT_EXAMPLE, policy=pol, calibration=TEXT_CAL, evaluate=text_loss,
                                evaluate_mode="max")
    assert record(wrong_way, "pruning").intents[0]["complete"]
    with pytest.raises(FxmemError, match="evaluate_mode: expected 'max' .higher is better. or 'min'"):
        fxmem.transform(text_model, TEXT_EXAMPLE, policy=pol, evaluate=text_loss, evaluate_mode="lower")


def test_transform_evaluate_judges_as_the_model_files_evaluate(digits_state):
    """`transform(evaluate=fn, evaluate_mode=m)` and a model file with `evaluate` and `evaluate_mode = m` give the
    same guard and the same result."""
    pol = inference(pruning={"fraction": 0.6})
    a = fxmem.transform(digits_model(digits_state), dig.example_inputs(), policy=pol, calibration=DIGITS_CAL,
                        evaluate=dig.evaluate, evaluate_mode="max")
    model_file = types.SimpleNamespace(evaluate=dig.evaluate, evaluate_mode="max")
    b = fxmem.transform(digits_model(digits_state), dig.example_inputs(), policy=pol, calibration=DIGITS_CAL,
                        model_file=model_file)
    ra, rb = record(a, "pruning"), record(b, "pruning")
    assert ra.metrics["guard"] == rb.metrics["guard"] and ra.intents == rb.intents
    assert [c.details["units_after"] for c in ra.changes] == [c.details["units_after"] for c in rb.changes]
    assert list(ra.metrics["guard"][0]["limits"]) == ["metric_drop"]


# ============================================================================================ attention

def test_hab_that_keeps_one_key_per_query_is_refused_and_attention_stays_exact(text_model):
    """`rewrite: hab` keeping 1 key of 32 per query: the guard refuses it on the whole model, the site is exact SDPA
    (the pass still applies, exactly), and the line says so."""
    pol = inference(attention={"rewrite": "hab", "sparsity_ratio": 0.97})
    res = fxmem.transform(text_model, TEXT_EXAMPLE, policy=pol, calibration=TEXT_CAL)
    rec = record(res, "attention")
    assert rec.status == "applied" and [c.kind for c in rec.changes] == ["attention.sdpa"]
    (line,) = res.report.shortfalls()
    assert line.startswith("attention: asked hab at 1 attention site(s), hab at 0 of 1 (the rest exact SDPA): the "
                           "guard (")
    assert "top-1 agreement" in line and "on 8 calibration item(s)) stopped it" in line


# ============================================================================================ the manager, CLI, report

# lossy, with no verdict of its own: the manager judges it
_ScaleLossy = scale_output_pass("test_scale_lossy", exact=False)


@pytest.fixture
def scale_lossy():
    register(_ScaleLossy)
    yield
    registry.REGISTRY.pop(_ScaleLossy.name, None)


def test_manager_judges_a_lossy_pass_without_a_verdict(scale_lossy, digits_state):
    """A lossy pass that gives no verdict is judged by the manager (kind "lossy"): outputs scaled by 1.5 keep every
    prediction but move the outputs by 50%, over the kind's 5%: rolled back, naming the setting."""
    model = digits_model(digits_state)
    res = fxmem.transform(model, dig.example_inputs(), policy=inference(test_scale_lossy={"scale": 1.5}))
    rec = record(res, "test_scale_lossy")
    assert rec.status == "rolled_back"
    assert rec.reason == ("the guard refused a lossy pass: relative output error 0.5 > 0.05 on the example inputs; "
                          "raise verify.lossy_tolerance (now 0.05) or give evaluate (the task metric then decides)")
    assert rec.metrics["guard"][0]["measures"]["top1_agreement"] == 1.0
    ok = fxmem.transform(model, dig.example_inputs(), policy=inference(test_scale_lossy={"scale": 1.01}))
    assert record(ok, "test_scale_lossy").status == "applied"


def test_cli_summary_says_the_shortfall_first_and_strict_refuses_it(tmp_path, capsys, digits_state):
    """A model file with evaluate() and evaluate_mode: the CLI's summary starts with the shortfall line (the task
    metric stopped it); --strict makes it an error: exit 3, as every refusal of strict, nothing written."""
    state = tmp_path / "digits.pt"
    torch.save(digits_state, state)
    model_file = tmp_path / "digits_model.py"
    model_file.write_text(
        f"import sys\nimport torch\nsys.path.insert(0, {str(ROOT)!r})\nfrom examples import mlp_digits as base\n\n"
        f"def build_model():\n    m = base.build_model(hidden=128)\n    m.load_state_dict(torch.load({str(state)!r}))\n"
        "    return m\n\nexample_inputs = base.example_inputs\nloss_fn = base.loss_fn\nevaluate = base.evaluate\n"
        "evaluate_mode = 'max'\n\ndef calibration_data():\n    return base.calibration_data(n_batches=16)\n")
    policy = tmp_path / "prune.yaml"
    policy.write_text("version: 1\nmode: inference\noptimizer: none\npasses:\n  pruning:\n    fraction: 0.9\n")
    code = main(["optimize", str(model_file), "--policy", str(policy), "--out", str(tmp_path / "out"), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith("fxmem optimize: digits_model.py")
    assert lines[1].startswith("SHORT OF THE POLICY: pruning: asked 90% of 256 hidden units, removed ")
    assert "the guard (evaluate() drop " in lines[1] and lines[1].endswith("raise verify.metric_tolerance (now 0.01)")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["warnings"]["shortfalls"] == [lines[1].removeprefix("SHORT OF THE POLICY: ")]
    code = main(["optimize", str(model_file), "--policy", str(policy), "--out", str(tmp_path / "strict"),
                 "--strict", "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and "strict: a lossy pass did less than the policy asked (pruning: asked 90%" in err
    assert not (tmp_path / "strict").exists()


def test_a_model_file_states_its_evaluate_mode_or_is_refused(tmp_path):
    """A model file's evaluate_mode is "max" or "min"; anything else is the user's error naming the file."""
    from fxmem.errors import ModelFileError
    from fxmem.modelfile import load_model_file
    path = tmp_path / "m.py"
    path.write_text("import torch\n\ndef build_model():\n    return torch.nn.Linear(4, 2)\n\n"
                    "def example_inputs():\n    return (torch.randn(3, 4),)\n\n"
                    "def evaluate(module):\n    return 1.0\n\nevaluate_mode = 'lower'\n")
    with pytest.raises(ModelFileError, match=f"{path}: evaluate_mode must be 'max' .higher is better. or 'min'"):
        load_model_file(path)
    path.write_text(path.read_text().replace("'lower'", "'min'"))
    assert load_model_file(path).evaluator().mode == "min"


def test_report_puts_shortfalls_first_and_round_trips_them():
    """The report's first warnings are the shortfall lines; a rolled-back pass is said once (its own warning); the
    intents survive report.json."""
    from fxmem.costmodel import MemoryEstimate
    est = MemoryEstimate(params=1, buffers=0, grads=0, optimizer_state=0, inputs=0, activations=0, peak=1,
                         peak_at="x", peak_phase="forward")
    short = {"setting": "passes.pruning.fraction", "asked": "25% of 512 hidden units", "achieved": "removed 2.7% (14 "
             "units)", "complete": False, "stopped_by": "the guard (top-1 agreement 96.5% < 97.0% on 2 held-out "
             "calibration item(s))", "change": "lower verify.top1_agreement (now 97.0%) or give evaluate"}
    done = dict(short, setting="passes.precision.weights", asked="nf4 weights on 4 linear(s)",
                achieved="quantized 4 of 4", complete=True, stopped_by="", change="")
    passes = [PassRecord("pruning", "applied", False, intents=[short]),
              PassRecord("precision", "rolled_back", False, reason="the training step raised", intents=[done])]
    report = Report("m", {"name": "t"}, "inference", "none", est, est, passes=passes)
    line = ("pruning: asked 25% of 512 hidden units, removed 2.7% (14 units): the guard (top-1 agreement 96.5% < "
            "97.0% on 2 held-out calibration item(s)) stopped it; lower verify.top1_agreement (now 97.0%) or give "
            "evaluate")
    assert report.shortfalls() == [line]
    md = report.to_markdown(deterministic=True)
    warnings = md.split("## ⚠ Warnings", 1)[1].split("## Summary", 1)[0].strip().splitlines()
    assert warnings[0] == f"- **short of the policy: {line}**"
    assert warnings[1].startswith("- **pass `precision` was ROLLED BACK")
    again = Report.from_dict(json.loads(report.to_json()))
    assert again.shortfalls() == [line] and again.passes[1].intents == [done]
    from fxmem.intent import shortfall_lines
    assert shortfall_lines(passes)[1] == ("precision: asked nf4 weights on 4 linear(s), achieved nothing: the pass "
                                          "rolled back (the training step raised)")


def test_nothing_to_prune_is_a_shortfall_only_when_something_was_asked():
    """min_keep holding every unit is a shortfall naming the setting; a fraction of no unit is done as asked; a
    model with no prunable group says why."""
    from fxmem.pipeline import PassContext, load_passes
    load_passes()
    from fxmem.passes.pruning import PruningOptions, PruningPass
    model = dig.build_model(hidden=16)
    program = fxmem.capture(model, dig.example_inputs(), mode="inference")
    program.refresh()

    def intent(**opts):
        ctx = PassContext(policy=None, options=PruningOptions(**opts), mode="inference", optimizer="none",
                          budget=None, baseline=None, enabled=("pruning",), calibration=DIGITS_CAL[:4])
        (it,) = PruningPass().run(program.snapshot(), ctx).intents
        return it
    held = intent(fraction=0.5, min_keep=16)
    assert not held.complete and held.asked == "50% of 32 hidden units (0 after min_keep)"
    assert held.stopped_by == "min_keep (16 units per group)" and held.change == "lower passes.pruning.min_keep"
    assert intent(fraction=0.0).complete
    flat = fxmem.capture(torch.nn.Linear(64, 10), dig.example_inputs(), mode="inference")
    flat.refresh()
    ctx = PassContext(policy=None, options=PruningOptions(), mode="inference", optimizer="none", budget=None,
                      baseline=None, enabled=("pruning",), calibration=DIGITS_CAL[:4])
    (it,) = PruningPass().run(flat, ctx).intents
    assert not it.complete and it.stopped_by.startswith("no prunable group")
