"""`fxmem.fit_batch` and `fxmem optimize --fit batch`: the largest batch whose transformed step fits a memory cap
by the cost model; the step at that batch trains within the cap (measured), the next batch up does not fit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxmem
from fxmem.cli import main

SEQ, WIDTH, EXAMPLE_BATCH = 16, 64, 4


class DeepTokenMLP(nn.Module):
    """Activations dominate: eight GELU blocks over SEQ tokens per sample."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(8)))

    def forward(self, x):
        return self.blocks(x)


def loss_fn(output, inputs=None):
    return output.pow(2).mean()


def example():
    torch.manual_seed(0)
    return DeepTokenMLP(), (torch.randn(EXAMPLE_BATCH, SEQ, WIDTH),)


@pytest.fixture(scope="module")
def fitted():
    model, args = example()
    cap = int(fxmem.estimate(model, args, loss_fn=loss_fn).peak * 1.5)  # what eager needs at about batch 6
    fit = fxmem.fit_batch(model, args, budget=cap, policy="low", loss_fn=loss_fn, measure=True, max_batch=256)
    return model, args, cap, fit


def test_the_fitted_batch_fits_the_cap_and_the_next_one_does_not(fitted):
    _, _, cap, fit = fitted
    assert fit.result.after.peak <= cap
    assert fit.probes[fit.batch] <= cap and fit.probes[fit.batch + 1] > cap
    assert fit.args[0].shape[0] == fit.batch


def test_the_fitted_step_trains_within_the_cap_measured(fitted):
    _, _, cap, fit = fitted
    measured = fit.result.measured_after.peak
    assert measured <= cap * 1.05, f"measured {measured} B at batch {fit.batch}, cap {cap} B (+5% slack)"
    loss = loss_fn(fit.result.module(*fit.args))
    loss.backward()
    assert all(p.grad is not None for p in fit.result.module.parameters())


def test_checkpointing_fits_a_larger_batch_than_the_plain_model(fitted):
    model, args, cap, fit = fitted
    plain = fxmem.plan_batch(model, args, budget=cap, loss_fn=loss_fn)["batch"]
    assert fit.batch > plain
    assert f"fit: batch {fit.batch} is the largest" in fit.summary()


def test_strict_applies_to_the_result_not_to_the_probes_over_the_cap():
    model, args = example()
    cap = int(fxmem.estimate(model, args, loss_fn=loss_fn).peak * 1.2)
    fit = fxmem.fit_batch(model, args, budget=cap, policy="low", loss_fn=loss_fn, strict=True, max_batch=64)
    assert any(peak > cap for peak in fit.probes.values()) and fit.result.after.peak <= cap


def test_a_fraction_or_an_unreachable_cap_is_refused():
    model, args = example()
    with pytest.raises(fxmem.PolicyError, match="a batch search needs a cap in bytes"):
        fxmem.fit_batch(model, args, budget="40%", policy="low", loss_fn=loss_fn)
    with pytest.raises(fxmem.BudgetError, match="not even batch 1 fits"):
        fxmem.fit_batch(model, args, budget=1000, policy="low", loss_fn=loss_fn)


def test_cli_fit_batch_needs_a_budget_and_writes_the_fitted_result(tmp_path, capsys):
    model_file = tmp_path / "deep_mlp.py"
    model_file.write_text(
        f"import sys\nsys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent.parent)!r})\n"
        "from tests.test_fit_batch import example, loss_fn\n\n"
        "def build_model():\n    return example()[0]\n\ndef example_inputs():\n    return example()[1]\n")
    assert main(["optimize", str(model_file), "--fit", "batch", "--policy", "low", "--quiet",
                 "--out", str(tmp_path / "none")]) == 2
    assert "--fit batch: give the memory cap with --budget" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    cap = str(int(fxmem.estimate(*example(), loss_fn=loss_fn).peak * 1.5))
    assert main(["optimize", str(model_file), "--fit", "batch", "--budget", cap, "--policy", "low", "--quiet",
                 "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("fit: batch ") and "is the largest whose transformed step fits" in lines[1]
    assert "fit: batch " in (tmp_path / "out" / "report.md").read_text()
