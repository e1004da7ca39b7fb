"""Models that loop over time (issue 30 §4): a recurrent cell run step by step in Python, a selective scan written
as a loop (what Hugging Face's Mamba runs on CPU), a two-layer GRU (a composite op looping in C++). The static
estimate of a training step is within 2% of fxmem.measure on the same captured program: a weight every step reads,
a slice of one tensor read at every step, and a composite op's temporaries each once cost it 3-9%."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem

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


@pytest.mark.parametrize("name", LOOPS)
def test_static_estimate_of_a_looping_model_is_within_two_percent_of_measured(name):
    torch.manual_seed(0)
    model, x = LOOPS[name](), torch.randn(BATCH, STEPS, HIDDEN)
    program = fxmem.capture(model, (x,))
    static = fxmem.estimate(program)
    measured = fxmem.measure(copy.deepcopy(program.module), (x,))
    assert static.unknown_ops == [], static.unknown_ops
    assert abs(static.peak / measured.peak - 1) <= 0.02, (static.peak, measured.peak)
