"""Recurrent models (issue 30 §4): `nn.LSTM` on CPU runs oneDNN's layer kernel (`aten.mkldnn_rnn_layer`), which
cannot take symbolic sizes, whose fake kernel returns its workspace empty, and which the op table does not know.
The cost model traces such kernels at the example's sizes, gives the workspace the CPU kernel's size and measures
what an unknown op saves, so an LSTM is estimated as measured."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem
from fxmem.cli import main
from fxmem.costmodel.trace import trace_forward
from fxmem.kernel_sizes import rnn_workspace_bytes

aten = torch.ops.aten
# what these check is oneDNN's LSTM kernel, which CPU builds without oneDNN do not run
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="nn.LSTM runs oneDNN's layer kernel only where torch has oneDNN")
LSTM_FILE = """
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y)


def build_model():
    torch.manual_seed(0)
    return Tagger()


def example_inputs():
    return (torch.randn(8, 50, 32),)
"""


class _Reader(nn.Module):
    """An LSTM reading the model's input directly, its mean over time into a linear head."""

    def __init__(self, **lstm):
        super().__init__()
        self.rnn = nn.LSTM(32, 64, **lstm)
        self.head = nn.Linear(64 * (2 if lstm.get("bidirectional") else 1), 10)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y.mean(1 if self.rnn.batch_first else 0))


CASES = {"two_layers_batch_first": (dict(num_layers=2, batch_first=True), (8, 50, 32)),
         "bidirectional_time_first": (dict(bidirectional=True), (40, 8, 32))}


@pytest.mark.parametrize("case", CASES)
def test_an_lstm_reading_the_input_is_estimated_as_measured(case):
    lstm, shape = CASES[case]
    torch.manual_seed(0)
    model, x = _Reader(**lstm), torch.randn(*shape)
    measured = fxmem.measure(model, (x,))
    for method in ("static", "traced"):
        est = fxmem.estimate(model, (x,), method=method)
        assert est.unknown_ops == [], method
        assert abs(est.peak / measured.peak - 1) < 0.005, (method, est.peak, measured.peak)
    static = fxmem.estimate(model, (x,))
    assert static.activations == measured.activations
    assert any("measured on fake tensors: aten.mkldnn_rnn_layer.default" in note for note in static.notes)
    assert fxmem.estimate(model, (x,), mode="inference").unknown_ops == []  # no backward here: never unknown


class _Tagger(nn.Module):
    """An LSTM of 32 features over 16 steps, a linear head at every step."""

    def __init__(self, **lstm):
        super().__init__()
        self.rnn = nn.LSTM(32, 32, batch_first=True, **lstm)
        self.head = nn.Linear(32 * (2 if lstm.get("bidirectional") else 1), 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("lstm", [dict(num_layers=2), dict(bidirectional=True)], ids=["two_layers", "bidirectional"])
def test_an_lstm_in_inference_holds_what_it_made_until_it_returns(lstm):
    """`aten.lstm.input`, looping over layers and directions in C++, holds each layer's output and its initial
    states until it returns: the static walk freed them at their last use (8% low here in inference). A value dies
    where the trace freed it; static is within 2% of measured."""
    torch.manual_seed(0)
    model, x = _Tagger(**lstm), torch.randn(4, 16, 32)
    program = fxmem.capture(model, (x,), mode="inference")
    static = fxmem.estimate(program, mode="inference")
    measured = fxmem.measure(copy.deepcopy(program.module), (x,), mode="inference")
    assert abs(static.peak / measured.peak - 1) <= 0.02, (static.peak, measured.peak)


def test_the_layer_saves_its_workspace_measured_not_guessed():
    """The op table does not know `mkldnn_rnn_layer`; its default (every tensor input) would miss the workspace
    output, the largest thing it saves. Measured on fresh fakes, its saves name that output."""
    torch.manual_seed(0)
    model, x = _Reader(batch_first=True), torch.randn(4, 20, 32)
    program = fxmem.capture(model, (x,))
    traced = trace_forward(program, (x,), {}, "train")
    (layer,) = [r for r in traced.recorder.records if r.func is aten.mkldnn_rnn_layer.default]
    assert layer.known and layer.out_keys[3] in layer.saved
    assert traced.recorder.storage_bytes[layer.out_keys[3]] > 0


def _layer_args(steps: int, batch: int = 8, hidden: int = 64, features: int = 32):
    weights = [torch.randn(4 * hidden, features), torch.randn(4 * hidden, hidden), torch.randn(4 * hidden),
               torch.randn(4 * hidden)]
    return (torch.randn(steps, batch, features), *(w.requires_grad_() for w in weights), torch.zeros(batch, hidden),
            torch.zeros(batch, hidden), False, [], 2, hidden, 1, True, False, False, True)


def test_the_workspace_has_the_cpu_kernels_size_or_is_scaled_from_fewer_steps(monkeypatch):
    args = _layer_args(100)
    real = aten.mkldnn_rnn_layer.default(*args)[3]
    assert rnn_workspace_bytes(args) == real.numel() * real.element_size()
    import fxmem.kernel_sizes as kernel_sizes
    monkeypatch.setattr(kernel_sizes, "REAL_RUN_BYTES", 64 * 1024)  # the call's input is 100 KiB: fewer steps
    monkeypatch.setattr(kernel_sizes, "_WORKSPACE", {})
    scaled = rnn_workspace_bytes(_layer_args(100))
    assert abs(scaled / (real.numel() * real.element_size()) - 1) < 0.01


def test_cli_estimates_an_lstm_model_file(tmp_path, capsys):
    path = tmp_path / "tagger.py"
    path.write_text(LSTM_FILE)
    assert main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "unknown ops: none" in out


def test_an_lstms_unused_final_states_get_no_gradient():
    """`y, _ = lstm(x)`: the final hidden and cell states are stacked by ops off the loss's path, whose backward never
    runs, so backward makes no gradient for them. The static walk gave each one (4 KiB high here) before."""
    torch.manual_seed(0)
    model, x = _Reader(batch_first=True), torch.randn(8, 6, 32)
    measured = fxmem.measure(model, (x,))
    static = fxmem.estimate(model, (x,))
    assert (static.peak, static.activations) == (measured.peak, measured.activations)


class _DroppedEmbeddingLM(nn.Module):
    """Embeddings, dropout, a 2-layer LSTM, a norm and a head: the LSTM a checkpoint region whose input is the
    dropout's output (which only the LSTM's copy of it stood for) and whose output is a getitem of its tuple."""

    def __init__(self):
        super().__init__()
        self.emb, self.drop = nn.Embedding(64, 32), nn.Dropout(0.1)
        self.rnn = nn.LSTM(32, 48, num_layers=2, batch_first=True, dropout=0.1)
        self.norm, self.head = nn.LayerNorm(48), nn.Linear(48, 64)

    def forward(self, ids):
        h, _ = self.rnn(self.drop(self.emb(ids)))
        return self.head(torch.nn.functional.gelu(self.norm(h)))


def test_a_checkpointed_lstm_is_planned_as_estimated_and_measured():
    """The region planner counted the LSTM's output as freed (a getitem of the LSTM's tuple had no storage in the
    trace) and its input as saved anyway (its node's other storage, the dropout mask, is): the plan was 10 KiB, a
    third, below what the result keeps."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))

    def loss_fn(out, inputs):
        return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
    result = fxmem.transform(_DroppedEmbeddingLM(), (ids,), loss_fn=loss_fn, measure=True,
                             policy={"version": 1, "passes": {"checkpoint": {"activation_budget": "40%"}}})
    report = result.report
    metrics = next(r for r in report.passes if r.name == "checkpoint").metrics
    assert any(change.kind == "checkpoint_full" and change.module == "rnn"
               for r in report.passes for change in r.changes)
    assert (metrics["planned_activations"], metrics["planned_peak"]) == \
        (metrics["estimated_activations"], metrics["estimated_peak"])
    assert report.after.activations == report.measured_after.activations
