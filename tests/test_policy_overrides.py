"""Typed overrides (`Policy.with_overrides`, `fxmem.transform`'s keyword arguments): the same merge and validation
as `--set` strings, values kept as given, errors naming where and the key."""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem.errors import PolicyError
from fxmem.pipeline import load_passes
from fxmem.policy_loader import load_policy

load_passes()


def test_typed_overrides_give_the_policy_set_strings_give():
    typed = load_policy("high").with_overrides({
        "budget": "40%", "passes.checkpoint.solver": "greedy", "passes.gating": True, "verify.atol": 1e-3,
        "passes.attention.skip": ["h.0*"], "passes.precision": {"compute": "fp16"}})
    text = load_policy("high", overrides=[
        "budget=40%", "passes.checkpoint.solver=greedy", "passes.gating=true", "verify.atol=1e-3",
        'passes.attention.skip=["h.0*"]', "passes.precision={compute: fp16}"])
    assert typed.to_dict() == text.to_dict()
    assert {n: s.raw for n, s in typed.passes.items()} == {n: s.raw for n, s in text.passes.items()}
    assert typed.source == text.source and typed.passes["checkpoint"].where == text.passes["checkpoint"].where


def test_an_override_on_a_section_the_policy_did_not_write_enables_it():
    policy = load_policy({"version": 1}).with_overrides({"passes.checkpoint.solver": "greedy"})
    assert policy.passes["checkpoint"].enabled and policy.passes["checkpoint"].options.solver == "greedy"
    assert not load_policy("low").with_overrides({"passes.pruning.fraction": 0.3}).passes["pruning"].enabled


def test_values_stay_the_type_they_were_given():
    policy = load_policy("high").with_overrides({"passes.offload.scratch_dir": "123"})
    assert policy.passes["offload"].options.scratch_dir == "123"  # (as --set text it would be the integer 123)
    with pytest.raises(PolicyError, match="passes.offload.scratch_dir: expected a string, got 123"):
        load_policy("high", overrides=["passes.offload.scratch_dir=123"])


@pytest.mark.parametrize("key, value, message", [
    ("passes.checkpoint.solver", "gredy", "W passes.checkpoint.solver: expected one of 'auto', 'dp', 'milp', "
                                          "'greedy', got 'gredy' (did you mean 'greedy'?)"),
    ("budgte", "40%", "W budgte: unknown key (did you mean 'budget'?)"),
    ("budget.x", 1, "W budget: is '30%', not a mapping, so 'x' cannot be set inside it"),
    ("passes.chekpoint.solver", "greedy", "W passes.chekpoint: unknown pass (did you mean 'checkpoint'?)"),
    ("extends", "low", "W extends: cannot be overridden; choose the policy file instead"),
    ("passes..x", 1, "W: 'passes..x' is not a key path like passes.checkpoint.solver"),
    ("verify.atol", -1.0, "W verify.atol: expected a number >= 0, got -1.0"),
    ("passes.gating.enabled", "yes", "W passes.gating.enabled: expected a bool, got 'yes'"),
])
def test_a_bad_override_names_where_and_the_key(key, value, message):
    with pytest.raises(PolicyError) as info:
        load_policy("high").with_overrides({key: value}, where="W")
    assert str(info.value).startswith(message), str(info.value)


def test_transform_keyword_arguments_are_typed_overrides_named_by_the_keyword():
    with pytest.raises(PolicyError, match=r"^transform\(passes__checkpoint__solver=\.\.\.\) passes\.checkpoint\."
                                          r"solver: expected one of"):
        fxmem.transform(torch.nn.Linear(2, 2), (torch.randn(3, 2),), passes__checkpoint__solver="gredy")
    with pytest.raises(PolicyError, match=r"^transform\(budget=\.\.\.\) budget: expected a size"):
        fxmem.transform(torch.nn.Linear(2, 2), (torch.randn(3, 2),), budget="lots")


def test_transform_takes_a_fraction_budget_and_keyword_values_as_given():
    model, x = torch.nn.Linear(2, 2), torch.randn(3, 2)
    # (a target: offload cannot take a linear layer to 40%, and a required budget out of reach is an error)
    res = fxmem.transform(model, (x,), policy={"version": 1, "passes": {}}, budget=0.4,
                          passes__offload__scratch_dir="123", budget_strict=False)
    assert str(res.policy.budget) == "40%" and not res.policy.budget_strict
    assert res.policy.passes["offload"].options.scratch_dir == "123" and res.policy.passes["offload"].enabled
