"""Parameters the loss's backward never reaches get no gradient and no optimizer state: the static estimate
counts neither, as `fxmem.measure` sees (a registered module never called, a branch whose result is dropped, an
output the loss ignores, a parameter used through `.detach()` or under `torch.no_grad()`), and still counts a frozen
parameter's neighbours and a tied parameter once."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem
from fxmem.costmodel import estimate, trace_forward


class UnusedModule(nn.Module):
    """A large linear registered but never called."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(32, 32), nn.Linear(256, 256)

    def forward(self, x):
        return self.used(x)


class DroppedBranch(nn.Module):
    """A branch computed in forward and dropped."""

    def __init__(self):
        super().__init__()
        self.used, self.branch = nn.Linear(32, 32), nn.Linear(32, 128)

    def forward(self, x):
        dropped = self.branch(x)
        del dropped
        return self.used(x)


class IgnoredOutput(nn.Module):
    """Two outputs; the loss (`first_output_loss`) reads the first."""

    def __init__(self):
        super().__init__()
        self.used, self.aux = nn.Linear(32, 32), nn.Linear(32, 96)

    def forward(self, x):
        return self.used(x), self.aux(x)


class DetachedParameter(nn.Module):
    """A parameter read through `.detach()` only."""

    def __init__(self):
        super().__init__()
        self.used, self.scale = nn.Linear(32, 32), nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        return self.used(x) + (x @ self.scale.detach().t()).sum(-1, keepdim=True)


class NoGradStatistic(nn.Module):
    """A linear run under `torch.no_grad()` whose result scales the output."""

    def __init__(self):
        super().__init__()
        self.used, self.stat = nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, x):
        with torch.no_grad():
            scale = self.stat(x).mean()
        return self.used(x) * scale


class FrozenLayer(nn.Module):
    """A frozen linear (requires_grad=False) before a trainable one: the contrast, estimated right before too."""

    def __init__(self):
        super().__init__()
        self.used, self.frozen = nn.Linear(32, 32), nn.Linear(32, 32)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.used(self.frozen(x))


class TiedWeights(nn.Module):
    """Two linears sharing one weight (one gradient, one state), and an unused linear."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.unused = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(64, 64)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def first_output_loss(output, inputs):
    return output[0].float().mean()


# model class, loss_fn, the parameters the backward reaches
CASES = {
    "unused_module": (UnusedModule, None, {"used.weight", "used.bias"}),
    "dropped_branch": (DroppedBranch, None, {"used.weight", "used.bias"}),
    "ignored_output": (IgnoredOutput, first_output_loss, {"used.weight", "used.bias"}),
    "detached_parameter": (DetachedParameter, None, {"used.weight", "used.bias"}),
    "no_grad_statistic": (NoGradStatistic, None, {"used.weight", "used.bias"}),
    "frozen_layer": (FrozenLayer, None, {"used.weight", "used.bias"}),
    "tied_weights": (TiedWeights, None, {"first.weight", "first.bias", "second.bias"}),
}


def _program(name: str):
    cls, loss_fn, _ = CASES[name]
    torch.manual_seed(0)
    model, x = cls(), torch.randn(8, 32)
    return fxmem.capture(copy.deepcopy(model), (x,)), model, x, loss_fn


@pytest.mark.parametrize("name", sorted(CASES))
def test_trace_names_the_parameters_backward_reaches(name):
    program, _, x, loss_fn = _program(name)
    traced = trace_forward(program, (x,), {}, "train", loss_fn)
    names = {id(param): path for path, param in program.module.named_parameters()}
    assert {names[id(param)] for param in traced.trained} == CASES[name][2]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_static_estimate_counts_gradients_and_state_as_measured(name, optimizer):
    program, model, x, loss_fn = _program(name)
    static = estimate(program, optimizer=optimizer, loss_fn=loss_fn)
    measured = fxmem.measure(copy.deepcopy(model), (x,), optimizer=optimizer, loss_fn=loss_fn)
    for field in ("params", "grads", "optimizer_state", "activations", "peak"):
        assert getattr(static, field) == getattr(measured, field), (field, getattr(static, field),
                                                                    getattr(measured, field))


def test_inference_trace_trains_nothing():
    program, _, x, _ = _program("unused_module")
    assert trace_forward(program, (x,), {}, "inference").trained == []
