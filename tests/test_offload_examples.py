"""Activation offload on every example model: the pass offloads something and the result's outputs and gradients
equal the original model's exactly (fp32, eval mode so dropout does not differ; train-mode exactness with dropout
is in test_offload.py). Scratch files are gone after the step."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.compare import compare_outputs

from .conftest import EXAMPLE_NAMES, example
from .conftest import grads as _grads


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_activation_offload_exact_on_every_example(name, tmp_path):
    model, args, kwargs, loss_fn = example(name)
    ref_model = copy.deepcopy(model)
    res = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, policy={
        "version": 1, "mode": "train", "budget": "60%", "budget_strict": False,
        "passes": {"offload": {"enabled": True, "activations": True, "tier": "disk", "min_bytes": 0,
                               "scratch_dir": str(tmp_path)}}})
    rec = next(r for r in res.records if r.name == "offload")
    assert rec.status == "applied", (rec.status, rec.reason, rec.notes)
    assert any(c.kind.startswith("offload") for c in rec.changes)
    ref_model.eval()
    res.module.eval()
    ref_out, ref_g = _grads(ref_model, args, kwargs, loss_fn)
    out, g = _grads(res.module, args, kwargs, loss_fn)
    assert compare_outputs(ref_out, out, atol=0, rtol=0) is None
    assert ref_g.keys() == g.keys()
    for n in ref_g:
        assert torch.equal(ref_g[n], g[n]), n
    assert not list(tmp_path.iterdir()), "scratch files left behind"
