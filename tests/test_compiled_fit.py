"""`passes.checkpoint.compiled_activation_budget`: the checkpoint pass planned so that its result, compiled, saves no
more than asked (a fraction b: what torch.compile alone saves at activation_memory_budget b), both counted by the
compiler's own partition; exact as every checkpoint result; out of reach an error naming the key, or, as a target,
the lowest plan saying so."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fxmem
from fxmem.costmodel import compiled_saves, estimate
from fxmem.errors import BudgetError, PolicyError
from fxmem.pipeline import PassContext, long_lived_frozen, pass_module
from fxmem.units import Budget
from tests.conftest import needs_shared_remat_region

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import examples.gpt as gpt  # noqa: E402
from tests.conftest import step_difference  # noqa: E402


@pytest.fixture(scope="module")
def small_gpt():
    torch.manual_seed(0)
    model = gpt.build_model(n_layer=1, d_model=32, n_head=2, block_size=32)
    x = gpt.example_inputs(batch=2, seq_len=32)
    program = fxmem.capture(model, x)
    program.refresh()
    return model, x, program, estimate(program, mode="train", loss_fn=gpt.loss_fn)


def _run(setup, strict: bool = True, **options):
    _, _, program, base = setup
    checkpoint = pass_module("checkpoint")
    ctx = PassContext(policy=None, options=checkpoint.CheckpointOptions(**options), mode="train", optimizer="adamw",
                      budget=None, baseline=base, enabled=("checkpoint",), loss_fn=gpt.loss_fn, budget_strict=strict)
    with long_lived_frozen():
        return checkpoint.CheckpointPass().run(program.snapshot(), ctx)


@needs_shared_remat_region
def test_the_compiled_result_saves_no_more_than_torch_compile_alone_at_b(small_gpt):
    model, x, program, _ = small_gpt
    result = _run(small_gpt, compiled_activation_budget=0.3)
    compiled = result.metrics["compiled"]
    assert compiled["target"] == compiled_saves(program.module, x, activation_memory_budget=0.3).total
    assert compiled["saves"] == compiled_saves(result.program.module, x).total <= compiled["target"]
    assert compiled["saves_before"] == compiled_saves(program.module, x).total > compiled["target"]
    # the largest eager budget tried whose compiled saves fit
    fitting = [budget for budget, saves in compiled["tried"] if saves <= compiled["target"]]
    assert compiled["activation_budget"] == max(fitting)
    assert result.notes[0].startswith("checkpoint: planned for torch.compile: the result's compiled step saves")
    assert step_difference(model, result.program.module, x, {}, gpt.loss_fn) is None


def test_a_compiled_budget_already_met_changes_nothing(small_gpt):
    result = _run(small_gpt, compiled_activation_budget=Budget(bytes=1 << 30))
    assert not result.modified
    assert "nothing recomputed" in result.notes[0]


def test_a_compiled_budget_out_of_reach(small_gpt):
    with pytest.raises(BudgetError, match="passes.checkpoint.compiled_activation_budget: the lowest plan's compiled "
                                          "step saves"):
        _run(small_gpt, compiled_activation_budget=Budget(bytes=1024))
    target = _run(small_gpt, strict=False, compiled_activation_budget=Budget(bytes=1024))
    assert target.metrics["best_effort"] == "compiled_activations"
    assert "the lowest of " in target.notes[0] and "plans tried, above 1.00 KiB" in target.notes[0]
    assert target.metrics["compiled"]["saves"] == min(saves for _, saves in target.metrics["compiled"]["tried"])


def test_both_activation_budgets_are_a_policy_error(small_gpt):
    with pytest.raises(PolicyError, match="compiled_activation_budget and passes.checkpoint.activation_budget"):
        _run(small_gpt, compiled_activation_budget=0.3, activation_budget=0.3)


def test_the_policy_key_reaches_the_pass_through_transform(small_gpt):
    model, x, _, _ = small_gpt
    result = fxmem.transform(model, x, policy="low", loss_fn=gpt.loss_fn, budget_strict=False,
                             overrides=["passes.checkpoint.enabled=true",
                                        "passes.checkpoint.compiled_activation_budget=30%"])
    record = next(r for r in result.records if r.name == "checkpoint")
    assert any(note.startswith("checkpoint: planned for torch.compile") for note in record.notes)
