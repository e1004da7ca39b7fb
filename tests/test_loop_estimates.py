"""Models that loop over time (issue 30 §4): a recurrent cell run step by step in Python, a selective scan written
as a loop (what Hugging Face's Mamba runs on CPU), a two-layer GRU (a composite op looping in C++), and recurrent
states both fed to the next step and collected for the output (stacked, joined, summed, unsqueezed at each step and
joined). The static estimate equals the traced one and the measurement on all but the GRU, which it estimates at
most 2% high."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem

from .conftest import estimates_and_measured

BATCH, STEPS, HIDDEN = 4, 16, 32


class _CellLoop(nn.Module):
    """One nn.RNNCell over the steps, its outputs stacked into a linear head: its two weights get a gradient at
    every step, added to what they have out of place."""

    def __init__(self):
        super().__init__()
        self.cell, self.head = nn.RNNCell(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 4)

    def forward(self, x):
        state = x.new_zeros(x.shape[0], HIDDEN)
        outs = []
        for step in range(x.shape[1]):
            state = self.cell(x[:, step], state)
            outs.append(state)
        return self.head(torch.stack(outs, 1))


class _ScanLoop(nn.Module):
    """A diagonal state-space scan as Mamba's CPU path writes it: per-step decay and input from chunks of one
    projection, state = decay[:, t] * state + input[:, t]; each step's select and slice backward makes a buffer of
    the whole tensor's size."""

    def __init__(self, state: int = 4):
        super().__init__()
        self.proj, self.out = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.decay = nn.Parameter(torch.randn(HIDDEN, state))

    def forward(self, x):
        delta, gate = self.proj(x).chunk(2, -1)
        decay = torch.exp(delta.unsqueeze(-1) * self.decay)
        drive = (delta * x).unsqueeze(-1)
        state = x.new_zeros(x.shape[0], HIDDEN, self.decay.shape[1])
        outs = []
        for step in range(x.shape[1]):
            state = decay[:, step] * state + drive[:, step]
            outs.append(state.sum(-1))
        return self.out(torch.stack(outs, 1) * torch.sigmoid(gate))


class _TwoLayerGRU(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.rnn, self.head = nn.GRU(HIDDEN, hidden, num_layers=2, batch_first=True), nn.Linear(hidden, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


LOOPS = {"rnn_cell_loop": _CellLoop, "scan_loop": _ScanLoop, "two_layer_gru": _TwoLayerGRU}


@pytest.mark.parametrize("steps", [3, STEPS])
@pytest.mark.parametrize("name", ["rnn_cell_loop", "scan_loop"])
def test_static_estimate_of_a_cell_or_scan_loop_equals_traced_and_measured(name, steps):
    """A cell's weights, read through `weight.t()` at every step: the gradient each step makes waits at that
    transpose's backward and is added to the weight's there, once the step's other gradients are gone (the walk
    added it at the step's matmul, with them: 640 B high from 4 steps on)."""
    torch.manual_seed(0)
    model, x = LOOPS[name](), torch.randn(BATCH, steps, HIDDEN)
    program = fxmem.capture(model, (x,))
    assert fxmem.estimate(program).unknown_ops == []
    static, traced, measured = estimates_and_measured(program, (x,))
    assert static == traced == measured


def test_static_estimate_of_a_composite_gru_is_within_two_percent_of_measured():
    """`nn.GRU` runs as one composite op whose in-place gate arithmetic the walk follows op by op: exact on the
    activations; where backward holds the peak (a few steps), up to 2048 B per step high there (the gate
    gradients' joins), never low."""
    torch.manual_seed(0)
    model, x = LOOPS["two_layer_gru"](), torch.randn(BATCH, STEPS, HIDDEN)
    program = fxmem.capture(model, (x,))
    static = fxmem.estimate(program)
    measured = fxmem.measure(copy.deepcopy(program.module), (x,))
    assert static.unknown_ops == [], static.unknown_ops
    assert static.activations == measured.activations
    assert 0 <= static.peak - measured.peak <= 0.02 * measured.peak, (static.peak, measured.peak)


class _StateLoop(nn.Module):
    """A recurrent cell written out step by step, each state fed to the next step and collected (`collect`; as
    `state.unsqueeze(1)` at each step where it names `unsqueezed`): a tanh cell, or a GRU-like one whose state the
    gate, the candidate and the blend all read (`gated`); the recurrent weight a parameter or one derived from it
    once (`derived`), read at every step."""

    def __init__(self, collect: str, gated: bool = False, derived: bool = False):
        super().__init__()
        self.collect, self.gated, self.derived = collect, gated, derived
        self.recur = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)
        self.inp = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)
        if gated:
            self.gate_recur = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)
            self.gate_inp = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)

    def step(self, state, x_step, recur):
        candidate = torch.tanh(state @ recur + x_step @ self.inp)
        if not self.gated:
            return candidate
        gate = torch.sigmoid(state @ self.gate_recur + x_step @ self.gate_inp)
        return (1 - gate) * candidate + gate * state

    def forward(self, x):
        recur = -torch.exp(self.recur) if self.derived else self.recur
        state, states = x.new_zeros(x.shape[0], HIDDEN), []
        for step in range(x.shape[1]):
            state = self.step(state, x[:, step], recur)
            states.append(state.unsqueeze(1) if self.collect.startswith("unsqueezed") else state)
        return _COLLECT[self.collect](states)


_COLLECT = {"stack": lambda states: torch.stack(states, 1), "cat": lambda states: torch.cat(states, 1),
            "sum": sum, "mean": lambda states: torch.stack(states).mean(0), "last": lambda states: states[-1],
            "stack_unsqueezed_after": lambda states: torch.stack([state.unsqueeze(1) for state in states], 1),
            "unsqueezed_cat": lambda states: torch.cat(states, 1),
            "unsqueezed_stack": lambda states: torch.stack(states, 1)}


class _Bidirectional(nn.Module):
    """Two state loops, one over the reversed steps, their stacked states joined per step."""

    def __init__(self, gated: bool = False):
        super().__init__()
        self.ahead, self.back = _StateLoop("stack", gated), _StateLoop("stack", gated)

    def forward(self, x):
        return torch.cat([self.ahead(x), self.back(x.flip(1)).flip(1)], -1)


STATE_LOOPS = {
    "tanh_stack": lambda: _StateLoop("stack"), "tanh_stack_derived_weight": lambda: _StateLoop("stack", derived=True),
    "tanh_cat": lambda: _StateLoop("cat"), "tanh_cat_derived_weight": lambda: _StateLoop("cat", derived=True),
    "tanh_sum": lambda: _StateLoop("sum"), "tanh_sum_derived_weight": lambda: _StateLoop("sum", derived=True),
    "tanh_last": lambda: _StateLoop("last"), "tanh_mean": lambda: _StateLoop("mean"),
    "tanh_stack_unsqueezed_after_the_loop": lambda: _StateLoop("stack_unsqueezed_after"),
    "tanh_unsqueezed_cat": lambda: _StateLoop("unsqueezed_cat"),
    "tanh_unsqueezed_stack": lambda: _StateLoop("unsqueezed_stack"),
    "gated_unsqueezed_cat": lambda: _StateLoop("unsqueezed_cat", gated=True),
    "gated_stack": lambda: _StateLoop("stack", gated=True), "gated_sum": lambda: _StateLoop("sum", gated=True),
    "bidirectional": _Bidirectional, "bidirectional_gated": lambda: _Bidirectional(gated=True),
}


@pytest.mark.parametrize("name", STATE_LOOPS)
def test_static_estimate_of_a_state_fed_on_and_collected_equals_traced_and_measured(name):
    torch.manual_seed(0)
    model, x = STATE_LOOPS[name](), torch.randn(BATCH, 6, HIDDEN)
    static, traced, measured = estimates_and_measured(fxmem.capture(model, (x,)), (x,))
    assert static == traced == measured
