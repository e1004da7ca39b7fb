"""The planner's estimate of remat sites applied together (`as_planned`, no trace of the rewrite) is what the rewrite
does: a site whose recipe holds another site's output, directly, through a view (Hugging Face's Conv1D flattens
its input) or through a cast (Llama's RMS norm), holds it nested, so neither output is kept; a dropout on a tensor
that needs no gradient counts the mask its recipe keeps. Planned, traced and measured activations agree to the
byte, and the step is bit-identical to the original."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem
from fxmem.costmodel import estimate_from_trace
from fxmem.nn.dropout import bool_mask_dropout, bool_mask_dropout_remat
from fxmem.pipeline import pass_module

from .conftest import example, step_difference
from .remat_variant import prepared

ck = pass_module("checkpoint")


class NormThenScale(nn.Module):
    """A layer norm, its output (or a flattened view of it) scaled by a weight, then a linear: the norm's output
    is saved by the scaling, the scaled one by the linear, and each is a remat site held anyway."""

    def __init__(self, flatten: bool):
        super().__init__()
        self.flatten = flatten
        self.norm, self.weight, self.fc = nn.LayerNorm(64), nn.Parameter(torch.randn(64)), nn.Linear(64, 64)

    def forward(self, x):
        normed = self.norm(x)
        return self.fc((normed.view(-1, 64) if self.flatten else normed) * self.weight)


class ReluThenDropout(nn.Module):
    """A linear, a layer norm (which saves the linear's output), a ReLU (which saves its own), a dropout over it, a
    linear (which saves the dropout's output)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.drop, self.fc2 = nn.Linear(64, 64), nn.LayerNorm(64), nn.Dropout(0.25), \
            nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


class ConvGroupNormGelu(nn.Module):
    """Wav2Vec2's first feature layer: a convolution, a group norm (whose composite detaches its statistics after
    making its output), a GELU (which saves the norm's output), a 1x1 convolution."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.act = nn.Conv1d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.GELU()
        self.head = nn.Conv1d(16, 8, 1)

    def forward(self, x):
        return self.head(self.act(self.norm(self.conv(x))))


class InputDropout(nn.Module):
    """A dropout on the input (no gradient: no op saves its mask), then a linear."""

    def __init__(self):
        super().__init__()
        self.drop, self.fc = nn.Dropout(0.25), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc(self.drop(x))


def _every_site_applied(model, args, kwargs, loss_fn, products: bool, scores: bool):
    """`model` captured and rewritten with every remat site applied, as the pass applies them: (the program, the sites,
    the estimates before, planned and traced after)."""
    program, ctx, traced = prepared(fxmem.capture(copy.deepcopy(model), args, kwargs), loss_fn, scores)
    sites = ck.remat_sites(program, traced, ck.default_balance(program), products=products, scores=scores)
    before, planned = (estimate_from_trace(program, t, mode="train", optimizer="adamw", loss_fn=loss_fn)
                       for t in (traced, ck.as_planned(traced, sites)))
    ck.apply_remat(program, sites)
    program.graph.lint()
    after = estimate_from_trace(program, ck.CheckpointPass._trace(program, ctx), mode="train", optimizer="adamw",
                                loss_fn=loss_fn)
    return program, sites, before, planned, after


def _planned_traced_measured(model, args, kwargs=None, loss_fn=None, products=False, scores=False):
    """Every site applied: planned == traced == measured activations, the peak planned as traced, bit-exact.
    Returns (the program, its sites, activation bytes they free as traced)."""
    kwargs = kwargs or {}
    program, sites, before, planned, traced = _every_site_applied(model, args, kwargs, loss_fn, products, scores)
    measured = fxmem.measure(copy.deepcopy(program.module), args, kwargs, loss_fn=loss_fn)
    assert (planned.activations, planned.peak) == (traced.activations, traced.peak)
    assert traced.activations == measured.activations
    assert step_difference(model, program.module, args, kwargs, loss_fn) is None
    return program, sites, before.activations - traced.activations


@pytest.mark.parametrize("flatten", [False, True])
def test_a_site_over_another_sites_output_or_its_view_holds_it_nested(flatten):
    """The scaling's recipe holds the norm's (nested), through the flattening view too: the step keeps neither
    output, only the norm's input, as planned."""
    torch.manual_seed(0)
    model, x = NormThenScale(flatten), torch.randn(8, 32, 64)
    program, sites, freed = _planned_traced_measured(model, (x,))
    by_name = {s.node.name: s for s in sites}
    assert set(by_name) == {"layer_norm", "mul"}, set(by_name)
    assert by_name["mul"].holds == ("layer_norm",) and by_name["mul"].call_with == ("layer_norm",)
    assert "remat_call('aten.mul.Tensor'" in program.module.code
    # (both outputs freed: the recipes hold the norm's input, a graph input, and parameters)
    assert freed == 2 * x.numel() * x.element_size()


def _dropout_site(sites):
    return next(s for s in sites if s.node.target in (bool_mask_dropout, bool_mask_dropout_remat))


def test_a_dropout_over_a_relu_site_holds_it_nested():
    """Without softmax sites (`scores`) too, a dropout over a ReLU site (recomputed with its layer norm) holds it
    nested: neither output is kept."""
    torch.manual_seed(0)
    model, x = ReluThenDropout(), torch.randn(16, 64)
    _, sites, freed = _planned_traced_measured(model, (x,))
    dropout = _dropout_site(sites)
    # (the input-fed linear too: its output, which the norm saves, is recomputed from the input)
    assert {s.node.name for s in sites} == {"linear", "relu", dropout.node.name}
    assert dropout.holds == ("relu",) and dropout.call_with == () and dropout.kept == ()
    assert freed == 3 * 16 * 64 * 4


def test_a_dropout_on_an_input_without_gradient_counts_the_mask_its_recipe_keeps():
    """No op saves the mask of a dropout whose input needs no gradient: its recipe keeps it, packed (a bit per
    element, a 32nd of the float32 output it frees), planned so."""
    torch.manual_seed(0)
    model, x = InputDropout(), torch.randn(16, 64)
    _, sites, freed = _planned_traced_measured(model, (x,))
    assert len(_dropout_site(sites).kept) == 1
    assert freed == 16 * 64 * 4 - 16 * 64 // 8


@pytest.mark.parametrize("name,products,scores", [("hf_gpt2", True, False), ("hf_gpt2", True, True),
                                                  ("hf_llama", False, False), ("gat", False, False)])
def test_every_site_applied_is_planned_as_traced_on_examples(name, products, scores):
    """Hugging Face GPT-2's Conv1D flattens the layer norm it multiplies (a view of a site's output); Llama's RMS
    norm multiplies one site's output by its weight in another (cheap sites alone: the holder was a plain recipe,
    keeping the inner output as a tensor); the GAT drops out its input features (no gradient, so no op saves the
    mask): each was planned low before, by 655,360, 262,144 and 1,156 bytes; now to the byte."""
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = example(name)
    _planned_traced_measured(model, args, kwargs, loss_fn, products, scores)


def test_a_group_norm_site_is_its_output_not_its_statistics():
    """The group norm's site is its output (what the GELU saves), not the last tensor its node made (a detached
    statistic): planned as traced, its output freed."""
    torch.manual_seed(0)
    model, x = ConvGroupNormGelu(), torch.randn(2, 16, 32)
    _, sites, freed = _planned_traced_measured(model, (x,))
    norm = next(s for s in sites if s.node.name == "group_norm")
    assert norm.bytes == x.numel() * x.element_size()
    assert freed >= norm.bytes
