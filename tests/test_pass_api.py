"""The pass contract: one registration feeds the manager and the policy; the manager hands each pass its options,
validated, and what passes share, derived once from the policy."""
from __future__ import annotations

import dataclasses

import pytest

import fxmem
from fxmem import registry
from fxmem.pass_api import DeviceInfo, Pass, PassContext, PassResult, register
from fxmem.policy import options_class, registered_options

from .conftest import example


@dataclasses.dataclass
class _SeenOptions:
    label: str = "default"


class _RecordContext(Pass):
    """Test-only: changes nothing, records what it was handed."""
    name = "test_record_context"
    Options = _SeenOptions
    extra = True
    seen: list = []

    def run(self, program, ctx):
        type(self).seen.append(ctx)
        return PassResult(program, False)


@pytest.fixture
def record_pass():
    _RecordContext.seen.clear()
    register(_RecordContext)
    yield _RecordContext.seen
    registry.REGISTRY.pop(_RecordContext.name, None)


def test_one_registration_feeds_the_manager_and_the_policy(record_pass):
    assert registry.pass_class("test_record_context") is _RecordContext
    assert options_class("test_record_context") is _SeenOptions
    assert registry.known_passes()[-1] == "test_record_context"
    policy = fxmem.load_policy({"version": 1, "passes": {"test_record_context": {"label": "x"}}})
    assert policy.passes["test_record_context"].options == _SeenOptions("x")


def test_register_refuses_what_it_cannot_run():
    class NotCanonical(Pass):
        name = "not_a_canonical_pass"
    with pytest.raises(ValueError, match="not one of .* sets extra = True"):
        register(NotCanonical)

    class ExactIsNotABool(Pass):
        name, extra, exact = "test_bad_exact", True, "yes"
    with pytest.raises(TypeError, match="exact must be True or False"):
        register(ExactIsNotABool)
    assert "not_a_canonical_pass" not in registry.REGISTRY and "test_bad_exact" not in registry.REGISTRY


def test_the_context_carries_what_passes_share_derived_from_the_policy(record_pass):
    model, args, kwargs, loss_fn = example("mlp_digits")
    policy = {"version": 1, "budget": 10**9, "budget_strict": False, "verify": {"lossy_tolerance": 0.2, "seed": 3},
              "passes": {"test_record_context": {"label": "seen"}, "offload": {"enabled": False,
                                                                                "distributed": "fsdp"}}}
    fxmem.transform(model, args, kwargs, policy=policy, loss_fn=loss_fn)
    (ctx,) = record_pass
    assert ctx.options == _SeenOptions("seen") and ctx.budget == 10**9 and not ctx.budget_strict
    assert (ctx.guard.lossy_tolerance, ctx.distribution, ctx.seed, ctx.rest_taken) == (0.2, "fsdp", 3, False)
    assert ctx.device == DeviceInfo("cpu") and ctx.baseline is not None and ctx.loss_fn is loss_fn
    assert ctx.policy is None and ctx.enabled == ()  # (a pass is handed no policy to read)


def test_a_hand_built_context_derives_the_same_facts():
    policy = fxmem.load_policy({"version": 1, "verify": {"lossy_tolerance": 0.3},
                                "passes": {"offload": {"enabled": False, "distributed": "ddp"}}})
    ctx = PassContext(policy=policy, enabled=("checkpoint", "offload"))
    assert (ctx.guard.lossy_tolerance, ctx.distribution, ctx.rest_taken) == (0.3, "ddp", True)
    assert registry.budget_rest_taken(("checkpoint", "offload"), after="checkpoint")
    assert not registry.budget_rest_taken(("checkpoint", "offload"), after="offload")
    assert not PassContext(enabled=("checkpoint",)).rest_taken


def test_a_policy_read_before_its_pass_registered_still_hands_the_pass_its_options():
    with registered_options(clear=True):  # as fxmem.load_policy before any pass module is imported
        policy = fxmem.load_policy({"version": 1, "passes": {"gating": {"targets": ["nothing.*"]}}})
        stale = fxmem.load_policy({"version": 1, "passes": {"gating": {"targts": ["h.*"]}}})
    assert policy.passes["gating"].options is None
    model, args, kwargs, loss_fn = example("gpt", n_layer=1, d_model=32, n_head=2)
    res = fxmem.transform(model, args, kwargs, policy=policy, loss_fn=loss_fn)
    rec = res.records[0]
    assert rec.name == "gating" and rec.status == "unchanged", (rec.status, rec.notes)
    assert "no residual branch matches targets ['nothing.*']" in rec.notes[0]
    with pytest.raises(fxmem.PolicyError, match=r"^<dict> passes\.gating\.targts: unknown option"):
        fxmem.transform(model, args, kwargs, policy=stale, loss_fn=loss_fn)
