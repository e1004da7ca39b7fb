"""A transformed module's saved-tensor hooks (`fxmem.nn.recast.RecastScope`) are on only while a registered
storage (a remat recipe's output, a parameter cast) lives: the other saves cost no Python call, reach the user's own
saved-tensor hooks, and values stay bit-identical."""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem.costmodel import trace_forward
from fxmem.nn import recast
from fxmem.pipeline import pass_module

from .conftest import example, grads


def _top_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@pytest.fixture(scope="module")
def gpt_remat():
    """The gpt example captured, and a copy with every remat site the checkpoint pass finds applied."""
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = example("gpt")
    checkpoint = pass_module("checkpoint")
    program = fxmem.capture(model, args, kwargs)
    program.refresh()
    traced = trace_forward(program, program.example_args, program.example_kwargs, "train", loss_fn)
    sites = checkpoint.remat_sites(program, traced, checkpoint.default_balance(program))
    remat = program.snapshot()
    checkpoint.apply_remat(remat, sites)
    assert recast.installed(remat.module) and len(sites) >= 10
    return program.module, remat.module, args, kwargs, loss_fn


def _saves_seen(module, args, kwargs, loss_fn, monkeypatch):
    """(saves the scope's hooks packed, saves a user's outer hooks packed, output, grads) of one step."""
    ours, outer = [], []
    real_pack = recast.RecastScope._pack
    monkeypatch.setattr(recast.RecastScope, "_pack", lambda self, t: ours.append(1) or real_pack(self, t))
    torch.manual_seed(0)  # (dropout)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: outer.append(1) or t, lambda t: t):
        out, grad = grads(module, args, kwargs, loss_fn)
    monkeypatch.undo()
    return len(ours), len(outer), out, grad


def test_only_saves_while_a_recipe_lives_go_through_the_scope(gpt_remat, monkeypatch):
    plain, remat, args, kwargs, loss_fn = gpt_remat
    _, all_saves, ref_out, ref_grads = _saves_seen(plain, args, kwargs, loss_fn, monkeypatch)
    ours, outer, out, got = _saves_seen(remat, args, kwargs, loss_fn, monkeypatch)
    assert 0 < ours < all_saves / 2, (ours, all_saves)  # the consumers of recipes' outputs, not every save
    assert ours + outer == all_saves  # the others reach the user's hooks, as in the plain module
    assert torch.equal(ref_out, out)
    assert ref_grads.keys() == got.keys() and all(torch.equal(ref_grads[n], got[n]) for n in ref_grads)


def test_the_hook_stack_is_left_as_found(gpt_remat):
    _, remat, args, kwargs, loss_fn = gpt_remat
    assert _top_hooks() is None
    grads(remat, args, kwargs, loss_fn)
    assert _top_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        mine = _top_hooks()
        remat(*args, **kwargs)
        assert _top_hooks() == mine


def test_a_nested_scope_keeps_its_hooks_for_its_whole_forward():
    outer, inner = recast.RecastScope(), recast.RecastScope()
    with outer:
        assert _top_hooks() is None  # nothing registered yet
        recast._calls().append(outer)  # (as the forward pre-hook of an fxmem module does)
        try:
            with inner:
                assert _top_hooks() is not None and _top_hooks()[0] == inner._pack
        finally:
            recast._calls().pop()
        assert _top_hooks() is None


def test_a_registered_storage_turns_the_hooks_on_until_it_dies():
    weight = torch.randn(8, 8, requires_grad=True)
    with recast.RecastScope() as scope:
        assert _top_hooks() is None
        cast = recast.cast_param(weight, torch.float16)
        assert _top_hooks()[0] == scope._pack
        del cast
        assert _top_hooks() is None
