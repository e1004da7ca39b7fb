"""`low` on a CUDA device: every bundled example through the exact-only preset on the GPU (capture, the pipeline's
own verification there, the attention and checkpoint passes), then the result against the model on the same
device: outputs and gradients in eval mode, and a seeded training step (checkpoint regions recompute, dropout
replays through the CUDA generator). The CPU side of this is test_end_to_end.py and test_checkpoint_examples.py."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem

from .conftest import EXAMPLE_NAMES, example_on, grads

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda")
SMALL = {"gpt": dict(n_layer=2)}
TOL = dict(rtol=1e-4, atol=1e-5)  # the low preset's own verify tolerances


def _step(module, args, kwargs, loss_fn, train: bool):
    """Outputs and gradients of one step in train (seeded: the same dropout draws) or eval mode."""
    module.train(train)
    torch.manual_seed(5)
    out, got = grads(module, args, kwargs, loss_fn)
    return [t.detach() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)], got


def _assert_step_equal(ref, new, args, kwargs, loss_fn, train: bool, name: str):
    ref_out, ref_grads = _step(ref, args, kwargs, loss_fn, train)
    out, got = _step(new, args, kwargs, loss_fn, train)
    for a, b in zip(ref_out, out, strict=True):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"{name} output (train={train}): {m}")
    assert got.keys() == ref_grads.keys()
    for key, g in ref_grads.items():
        torch.testing.assert_close(got[key], g, **TOL, msg=lambda m: f"{name} {key} (train={train}): {m}")


def _draws_attention_dropout(result) -> bool:
    """Whether a rewritten attention site drops probabilities in train mode (SDPA draws its own numbers there)."""
    rec = next((r for r in result.records if r.name == "attention"), None)
    return rec is not None and any(c.details.get("dropout_p", 0) for c in rec.changes)


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_low_is_exact_on_cuda(name):
    model, args, kwargs, loss_fn = example_on(name, DEVICE, **SMALL.get(name, {}))
    ref = copy.deepcopy(model)
    result = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, policy="low")
    statuses = {r.name: (r.status, r.reason) for r in result.records}
    assert all(status in ("applied", "unchanged") for status, _ in statuses.values()), statuses
    assert {p.device.type for p in result.module.parameters()} == {DEVICE.type}
    _assert_step_equal(ref, result.module, args, kwargs, loss_fn, train=False, name=name)
    if not _draws_attention_dropout(result):
        _assert_step_equal(ref, result.module, args, kwargs, loss_fn, train=True, name=name)


def test_checkpoint_regions_replay_dropout_on_cuda():
    """The decoder with dropout everywhere, attention left as written: the checkpoint pass's regions recompute in
    backward with the forward's dropout masks (the CUDA generator's state is kept), so a seeded training step
    equals the model's."""
    model, args, kwargs, loss_fn = example_on("gpt", DEVICE, n_layer=2, dropout=0.1)
    ref = copy.deepcopy(model)
    result = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, policy="low", passes__attention__enabled=False)
    rec = next(r for r in result.records if r.name == "checkpoint")
    assert rec.status == "applied", (rec.status, rec.reason)
    assert any(getattr(m, "fxmem_region", None) is not None for m in result.module.modules())
    _assert_step_equal(ref, result.module, args, kwargs, loss_fn, train=True, name="gpt")
