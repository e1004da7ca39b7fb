"""The model zoo (`tests/zoo.py`, issue 30) through the presets a user would pick: each result is called with the
user's own args/kwargs; `low` stays exact (outputs, gradients, buffers); every hand-written attention site is
rewritten to SDPA (low, medium, inference); medium keeps SDPA and runs bf16 with its precision intent complete; the
static estimate is within 2% of fxmem.measure on the same captured program, in train and in inference mode.

Each (model, policy) is transformed once per module; the transform's `before` is the static estimate of the
captured program (train: low's, adamw; inference: the inference preset's), which is measured here.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fxmem

from .exactness import difference
from .zoo import BUILDERS

warnings.filterwarnings("ignore")

# hand-written attention sites per model (the matcher must rewrite each); the other models have none: T5 and
# nn.MultiheadAttention already call SDPA, PyG's graph attention is a scatter softmax over edges
ATTENTION_SITES = {"mixtral": 1, "vit": 1, "qwen2_left_padded": 1, "whisper": 3}
ESTIMATE_TOLERANCE = 0.02
ESTIMATE_CASES = [(name, mode) for name in BUILDERS for mode in ("train", "inference")]


class _Zoo(dict):
    """(name, policy) -> (model, args, kwargs, loss_fn, TransformResult), transformed on first use; medium starts
    from a copy of low's captured program (both train mode; a snapshot would share its submodules), the others
    capture the model."""

    def __missing__(self, key):
        name, policy = key
        if policy == "medium":
            model, args, kwargs, loss_fn, low = self[name, "low"]
            start = copy.deepcopy(low.original)
        else:
            model, args, kwargs, loss_fn = BUILDERS[name]()
            start = copy.deepcopy(model)
        self[key] = (model, args, kwargs, loss_fn, fxmem.transform(start, args, kwargs, policy=policy,
                                                                    loss_fn=loss_fn))
        return self[key]


@pytest.fixture(scope="module")
def zoo():
    return _Zoo()


def _record(result, name):
    (record,) = [r for r in result.report.passes if r.name == name]
    return record


def _attention_rewritten(result, name):
    """The attention pass rewrote every hand-written site of model `name`, and says why for any it did not."""
    metrics = _record(result, "attention").metrics
    undone = [(site["module"], site.get("reason")) for site in metrics["sites_detail"] if not site["rewritten"]]
    assert all(reason for _, reason in undone), undone
    assert (metrics["sites"], metrics["rewritten"]) == (ATTENTION_SITES.get(name, 0),) * 2, undone


@pytest.mark.parametrize("name", BUILDERS)
def test_low_result_takes_the_users_arguments_and_stays_exact(zoo, name):
    model, args, kwargs, loss_fn, result = zoo[name, "low"]
    assert difference(model, result.module, args, kwargs, loss_fn) is None
    assert sorted(result.module.state_dict()) == sorted(model.state_dict())
    _attention_rewritten(result, name)


@pytest.mark.parametrize("name", BUILDERS)  # (medium starts from a copy of low's captured program)
def test_medium_keeps_sdpa_and_runs_bf16_with_its_intent_complete(zoo, name):
    model, args, kwargs, loss_fn, result = zoo[name, "medium"]
    _attention_rewritten(result, name)
    precision = _record(result, "precision")
    assert precision.status == "applied", precision.reason
    assert [intent["complete"] for intent in precision.intents] == [True], precision.intents
    assert precision.metrics["compute"] == "bf16"
    result.module.eval()
    with torch.no_grad():
        out = result.module(*args, **kwargs)
    assert all(torch.isfinite(t).all() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("name", BUILDERS)
def test_inference_result_takes_the_users_arguments_and_names_what_it_leaves(zoo, name):
    model, args, kwargs, _, result = zoo[name, "inference"]
    _attention_rewritten(result, name)
    for intent in _record(result, "precision").intents:
        assert intent["complete"] or intent["stopped_by"], intent
    with torch.no_grad():
        out = result.module(*args, **kwargs)
    assert type(out) is type(model.eval()(*args, **kwargs))


@pytest.mark.parametrize("name,mode", ESTIMATE_CASES)
def test_static_estimate_is_within_two_percent_of_measured(zoo, name, mode):
    _, args, kwargs, loss_fn, result = zoo[name, "low" if mode == "train" else "inference"]
    static = result.before
    assert static.unknown_ops == [], static.unknown_ops
    measured = fxmem.measure(copy.deepcopy(result.original.module), args, kwargs, mode=mode,
                             optimizer=result.policy.optimizer, loss_fn=loss_fn)
    assert abs(static.peak / measured.peak - 1) <= ESTIMATE_TOLERANCE, (static.peak, measured.peak)
