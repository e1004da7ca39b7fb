"""Budget semantics, one rule whatever passes are enabled: a required budget out of reach is a BudgetError naming
the lowest peak reached and what would go further (CLI: exit 2, one line, nothing written); a target budget gives
the result with the miss as the first line of the summary and of the report."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import fxmem
from fxmem.budgets import further_steps
from fxmem.cli import main
from fxmem.errors import BudgetError
from fxmem.policy_loader import load_policy

from .conftest import ROOT

MLP = str(ROOT / "examples" / "mlp_digits.py")
OFFLOAD = {"min_bytes": 0, "bandwidth": "1GB/s", "compute_rate": "10GFLOP/s"}  # pinned: no probe, same plan
COMBINATIONS = {
    "none": {},
    "precision": {"precision": {}},
    "offload": {"offload": OFFLOAD},
    "checkpoint+offload": {"checkpoint": {}, "offload": OFFLOAD},
    "precision+checkpoint+offload": {"precision": {}, "checkpoint": {}, "offload": OFFLOAD},
}


def _mlp():
    torch.manual_seed(0)
    layers = [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
              nn.Linear(64, 10)]
    return nn.Sequential(*layers), torch.randn(16, 32)


def _transform(passes, **kwargs):
    model, x = _mlp()
    return fxmem.transform(model, x, policy={"version": 1, "passes": passes}, **kwargs)


@pytest.mark.parametrize("name", COMBINATIONS)
def test_required_budget_out_of_reach_is_an_error_naming_the_lowest_peak_and_what_goes_further(name):
    passes = COMBINATIONS[name]
    with pytest.raises(BudgetError) as info:
        _transform(passes, budget="1%")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("budget 2.08 KiB is out of reach: ")
    reached = (f"the enabled passes ({', '.join(passes)}) go as low as an estimated peak of 208.1 KiB" if passes
               else "with no pass enabled the estimated peak is 208.1 KiB")
    assert reached in message
    further = message.split("would go further: ")[1]
    assert "optimizer: adamw8bit" in further
    for enabled in passes:  # what would go further is never an enabled pass as it is
        assert f"passes.{enabled} (" not in further
    for missing in {"checkpoint", "offload", "precision"} - set(passes):
        assert f"passes.{missing} (" in further


def test_required_budget_out_of_reach_of_checkpointing_alone_is_an_error_naming_offload():
    with pytest.raises(BudgetError, match=r"^checkpoint: budget 2.08 KiB is below the lowest peak checkpointing "
                                          r"reaches, about 208.1 KiB .* enable the offload pass"):
        _transform({"checkpoint": {}}, budget="1%")


def test_target_budget_gives_the_result_with_the_miss_first_in_the_report():
    res = _transform(COMBINATIONS["checkpoint+offload"], budget="1%", budget_strict=False)
    miss = res.report.budget_miss()
    assert miss.startswith("budget 2.08 KiB missed (a target, budget_strict: false): the enabled passes "
                           "(checkpoint, offload) go as low as an estimated peak of 208.1 KiB")
    assert "would go further: optimizer: adamw8bit" in miss
    markdown = res.report.to_markdown()
    assert markdown.split("## ⚠ Warnings\n\n")[1].startswith(f"- **{miss}**")
    assert res.report.to_dict()["warnings"]["budget"] == miss
    again = type(res.report).from_dict(res.report.to_dict())
    assert again.budget_miss() == miss


def test_a_budget_that_fits_is_no_miss_and_one_within_the_stated_slack_says_so():
    res = _transform(COMBINATIONS["checkpoint+offload"], budget="1MiB")
    assert res.report.budget_miss() is None and "fits" in res.report.budget_line()
    # required, 1% over: within the checkpoint pass's stated slack (5%), the result, with the miss said first
    res = _transform(COMBINATIONS["checkpoint+offload"], budget="99%")
    assert res.report.budget_miss().startswith("budget 206.0 KiB missed (within the stated tolerance of 5%): ")


@pytest.mark.parametrize("how", ["keyword", "set"])
def test_budget_strict_false_in_the_same_call_makes_the_budget_a_target(how):
    given = {"budget_strict": False} if how == "keyword" else {"overrides": ["budget_strict=false"]}
    res = _transform(COMBINATIONS["offload"], budget="1%", **given)
    assert not res.policy.budget_strict and res.report.budget_miss() is not None


def test_a_preset_budget_is_a_target_and_budget_makes_it_required():
    model, x = _mlp()
    res = fxmem.transform(model, x, policy="low")  # budget 70%: out of reach here, a target
    assert not res.policy.budget_strict and res.report.budget_miss().startswith("budget 145.6 KiB missed (a target")
    with pytest.raises(BudgetError):
        fxmem.transform(model, x, policy="low", budget="70%")


def _estimate(**fields):
    base = dict(activations=1 << 20, optimizer_state=2 << 20, params=1 << 20, grads=1 << 20)
    return types.SimpleNamespace(**{**base, **fields})


def test_further_steps_name_settings_of_enabled_passes_and_nothing_when_all_are_in_use():
    model = nn.Linear(256, 256)
    everything = load_policy({"version": 1, "optimizer": "adamw8bit", "passes": {
        "precision": {}, "checkpoint": {}, "offload": {}}})
    assert further_steps(everything, _estimate(), model) == []
    fp32 = load_policy({"version": 1, "optimizer": "adamw8bit", "passes": {
        "precision": {"compute": "fp32"}, "checkpoint": {}, "offload": {"activations": False}}})
    assert further_steps(fp32, _estimate(), model) == [
        "passes.offload.activations: true (1.00 MiB kept after forward)", "passes.precision.compute: bf16 (lossy)"]
    # inference: every weight is frozen (streamed by offload), and int8 weights lower it
    inference = load_policy({"version": 1, "mode": "inference", "optimizer": "none", "passes": {"precision": {}}})
    assert further_steps(inference, _estimate(optimizer_state=0), model) == [
        "passes.offload with weights: true (streams 257.0 KiB of frozen weights)",
        "passes.precision.weights: int8 (lossy)"]


# ============================================================================================ command line

def _policy_file(tmp_path, passes: str):
    path = tmp_path / "policy.yaml"
    path.write_text(f"version: 1\npasses: {passes}\n")
    return str(path)


@pytest.mark.parametrize("passes, said", [
    ("{checkpoint: {}}", "checkpoint: budget 18.5 KiB is below the lowest peak checkpointing reaches, about 1.81 MiB"),
    ("{checkpoint: {}, offload: {min_bytes: 0}}", "budget 18.5 KiB is out of reach: the enabled passes (checkpoint, "
                                                  "offload) go as low as an estimated peak of 1.81 MiB")])
def test_cli_required_budget_out_of_reach_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, passes, said):
    policy = _policy_file(tmp_path, passes)
    out = tmp_path / "out"
    code = main(["optimize", MLP, "--policy", policy, "--budget", "1%", "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    line = captured.err.strip()
    assert "\n" not in line and line.startswith(f"fxmem: error: {said}")
    assert ("enable the offload pass" if "offload" not in passes else "would go further: optimizer: adamw8bit") \
        in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.yaml"]


def test_cli_target_budget_writes_the_result_and_says_the_miss_first(tmp_path, capsys):
    policy = _policy_file(tmp_path, "{checkpoint: {}, offload: {min_bytes: 0}}")
    out = tmp_path / "out"
    code = main(["optimize", MLP, "--policy", policy, "--budget", "1%", "--set", "budget_strict=false",
                 "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = [line for line in captured.out.splitlines() if line.strip()]
    assert summary[1].startswith("OVER BUDGET: budget 18.5 KiB missed (a target, budget_strict: false)")
    assert "would go further: optimizer: adamw8bit" in summary[1]
    assert (out / "report.md").exists()
    strict = tmp_path / "strict"
    code = main(["optimize", MLP, "--policy", policy, "--budget", "1%", "--set", "budget_strict=false",
                 "--out", str(strict), "--quiet", "--strict"])
    assert code == 3 and "strict: the result is over its budget" in capsys.readouterr().err
    assert not strict.exists()


def test_a_target_activation_budget_missed_is_said_first_as_the_peak_budget_is(tmp_path, capsys):
    """An activation budget below what checkpointing reaches, as a target: the result, with the miss at the top of
    the report's warnings, in its JSON and as an OVER BUDGET line of the CLI summary."""
    res = _transform({"checkpoint": {}}, activation_budget=1000, budget_strict=False)
    miss = res.report.activation_budget_miss()
    assert miss is not None and "OVER the activation budget by" in miss
    assert res.report.to_dict()["warnings"]["activation_budget"] == miss
    markdown = res.report.to_markdown()
    assert markdown.split("## ⚠ Warnings\n\n", 1)[1].startswith(f"- **{miss}**")
    policy = _policy_file(tmp_path, "{checkpoint: {activation_budget: 1000}}")
    code = main(["optimize", MLP, "--policy", policy, "--set", "budget_strict=false", "--out", str(tmp_path / "out"),
                 "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = [line for line in captured.out.splitlines() if line.strip()]
    assert summary[1].startswith("OVER BUDGET: activation budget 1000 B: ")
