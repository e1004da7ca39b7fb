"""`passes.checkpoint.compiler_budgets`: the compiled fit run at several torch.compile partitioner budgets, the
fastest compiled step of the plans that fit kept (measured; here the timer is replaced where the choice is tested,
and run for real where the timing is), the budget chosen carried by the module (its meta, a saved result) and
applied by `fxmem.compile`."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

import fxmem
from fxmem.compiled_budget import compile_options, planned_budget, set_planned_budget
from fxmem.compiled_timing import Candidate, compiled_step_times
from fxmem.costmodel import compiled_saves
from fxmem.errors import PolicyError
from fxmem.measure import saved_bytes
from fxmem.pipeline import pass_module
from fxmem.structure import StructureError, build, describe
from tests.conftest import needs_shared_remat_region

from tests.test_compiled_fit import _run, gpt, small_gpt  # noqa: F401  (the fixture)
from tests.conftest import step_difference


def _fake_timer(monkeypatch, seconds: dict) -> list:
    """Replace the pass's timer: each candidate's time from `seconds` (by partitioner budget); the candidates it
    was given are appended to the returned list."""
    given = []

    def timer(candidates, args, kwargs, loss_fn=None):
        given.append(candidates)
        return {budget: seconds[budget] for budget in candidates}
    module = sys.modules[pass_module("checkpoint").fit_compiled.__module__]
    monkeypatch.setattr(module, "compiled_step_times", timer)
    return given


@needs_shared_remat_region
def test_the_fastest_plan_that_fits_is_kept(small_gpt, monkeypatch):
    model, x, _, _ = small_gpt
    given = _fake_timer(monkeypatch, {1.0: 0.010, 0.3: 0.020})
    result = _run(small_gpt, compiled_activation_budget=0.3, compiler_budgets=[0.3, 1.0])
    compiled = result.metrics["compiled"]
    assert [fit["compiler_budget"] for fit in compiled["fits"]] == [1.0, 0.3]  # largest first
    assert all(fit["fits"] for fit in compiled["fits"]) and len(given) == 1 and set(given[0]) == {1.0, 0.3}
    assert result.metrics["compiler_budget"] == compiled["compiler_budget"] == 1.0 and result.modified
    assert compiled["saves"] == compiled_saves(result.program.module, x, activation_memory_budget=1.0).total \
        <= compiled["target"]
    # the program as given, at the compiler's budget 0.3, was the other candidate: compile@0.3 itself
    assert given[0][1.0].module is result.program.module and given[0][0.3].compiler_budget == 0.3
    assert result.notes[1].startswith("checkpoint: chose activation_memory_budget 1, the fastest compiled")
    assert "0.3: 20.0 ms (the program as given)" in result.notes[1]
    assert step_difference(model, result.program.module, x, {}, gpt.loss_fn) is None


def test_the_program_as_given_is_kept_where_compile_alone_is_fastest(small_gpt, monkeypatch):
    _fake_timer(monkeypatch, {1.0: 0.020, 0.3: 0.010})
    result = _run(small_gpt, compiled_activation_budget=0.3, compiler_budgets=[1.0, 0.3])
    assert not result.modified and result.metrics["compiler_budget"] == 0.3
    assert result.notes[0].startswith("checkpoint: compiled at activation_memory_budget 0.3, the program saves")
    assert "nothing recomputed" in result.notes[0]
    assert any("fxmem.compile(module)" in note for note in result.notes)


def test_a_tie_goes_to_the_plan_saving_less(small_gpt, monkeypatch):
    _fake_timer(monkeypatch, {1.0: 0.01005, 0.3: 0.010})  # 0.5% apart: within the tie
    result = _run(small_gpt, compiled_activation_budget=0.3, compiler_budgets=[1.0, 0.3])
    fits = {fit["compiler_budget"]: fit["saves"] for fit in result.metrics["compiled"]["fits"]}
    assert result.metrics["compiler_budget"] == min(fits, key=fits.get)


def test_one_fitting_budget_is_not_timed(small_gpt, monkeypatch):
    given = _fake_timer(monkeypatch, {})
    result = _run(small_gpt, compiled_activation_budget=0.3, compiler_budgets=[0.3])
    assert given == [] and result.metrics["compiler_budget"] == 0.3 and not result.modified


@pytest.mark.parametrize("value, message", [
    ([1.5], "1.5 is not a fraction in (0, 1]"), ("fast", "expected \"auto\" or a list of fractions"),
    ([], "expected \"auto\" or a list of fractions")])
def test_bad_compiler_budgets_name_the_key(small_gpt, value, message):
    with pytest.raises(PolicyError, match=r"passes\.checkpoint\.compiler_budgets: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("]", r"\]").replace("[", r"\[")):
        _run(small_gpt, compiled_activation_budget=0.3, compiler_budgets=value)


def test_compiler_budgets_need_a_compiled_budget(small_gpt):
    with pytest.raises(PolicyError, match="compiler_budgets: needs passes.checkpoint.compiled_activation_budget"):
        _run(small_gpt, activation_budget=0.3, compiler_budgets="auto")


def test_auto_is_b_halfway_and_one():
    from fxmem.units import Budget
    goal = pass_module("checkpoint").CompiledGoal
    assert goal(Budget(fraction=0.3), "auto").settings() == (1.0, 0.65, 0.3)
    assert goal(Budget(bytes=1 << 20), "auto").settings() == (1.0, 0.75, 0.5)
    assert goal(Budget(fraction=0.3), None).settings() == (None,)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.norm(self.a(x))))


def test_compiled_step_times_time_copies_and_leave_the_modules():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(8, 16)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    times = compiled_step_times({"plain": Candidate(net, None), "at 0.2": Candidate(net, 0.2)}, (x,), {})
    assert set(times) == {"plain", "at 0.2"} and all(0 < t < 10 for t in times.values())
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())  # running stats unmoved
    assert all(p.grad is None for p in net.parameters()) and torch.equal(torch.get_rng_state(), rng)


def test_fxmem_compile_runs_at_the_planned_budget(small_gpt):
    _, x, program, _ = small_gpt
    module = program.snapshot().module
    assert planned_budget(module) is None and compile_options(module, {"max_autotune": False}) == \
        {"max_autotune": False}
    set_planned_budget(module, 0.3)
    options = compile_options(module, {"max_autotune": False})
    assert options["max_autotune"] is False and "0.3" in repr(options["custom_partitioner_fn"])
    at_b = compiled_saves(module, x, activation_memory_budget=0.3).total
    assert at_b < compiled_saves(module, x).total
    assert saved_bytes(fxmem.compile(module), x) == at_b
    set_planned_budget(module, None)
    assert planned_budget(module) is None


def test_transform_puts_the_budget_on_the_module_and_the_saved_result(small_gpt, monkeypatch, tmp_path):
    model, x, _, _ = small_gpt
    _fake_timer(monkeypatch, {1.0: 0.020, 0.3: 0.010})
    result = fxmem.transform(model, x, policy="low", loss_fn=gpt.loss_fn, budget_strict=False,
                             overrides=["passes.checkpoint.enabled=true",
                                        "passes.checkpoint.compiled_activation_budget=30%"],
                             passes__checkpoint__compiler_budgets=[1.0, 0.3])
    assert planned_budget(result) == planned_budget(result.module) == 0.3
    path = result.save(tmp_path / "result")
    assert json.loads((path / "module.json").read_text())["compile"] == {"activation_memory_budget": 0.3}
    assert planned_budget(fxmem.load(path)) == 0.3


def test_a_saved_compile_setting_is_checked(small_gpt):
    _, _, program, _ = small_gpt
    doc, tensors = describe(program.module, mode="train", quantized={})
    assert "compile" not in doc  # unplanned: the document as before
    doc["compile"] = {"activation_memory_budget": 1.5}
    with pytest.raises(StructureError, match="compile must be"):
        build(doc, tensors)
