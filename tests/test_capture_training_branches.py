"""Models whose python reads `self.training` behave as the model in both modes after fxmem.

torch.export evaluates such a read once, in the captured mode. fxmem compares the other mode with the model; where
it differs, that mode is captured too and the result switches graphs on its own `training` flag. Each style below
(a training-only branch, a submodule's flag, the flag passed to F.dropout, an eval-only branch, a nested module, an
HF-style checkpointing guard, a mode-dependent SDPA dropout, a counter only training advances, a training-only
output) is checked in eval mode and in a seeded train step (outputs, gradients, buffers), after `fxmem.load`, and
through the CLI.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxmem
from fxmem import pipeline
from fxmem.compare import compare_outputs
from fxmem.errors import CaptureError
from fxmem.nn.modes import ModeGraph
from fxmem.pipeline import Change, PassResult
from fxmem.policy import unregister_options
from fxmem.program import buffers_kept

from .conftest import ROOT, grads


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)


class NoiseInTraining(_Base):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.training:
            h = h + 0.5 * torch.randn_like(h)
        return self.fc2(h)


class SubmoduleFlag(_Base):
    """Batch norm while its own flag says training, a fixed scale otherwise."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        h = self.fc1(x)
        h = self.bn(h) if self.bn.training else h * 0.5
        return self.fc2(torch.relu(h))


class DropoutKeyword(_Base):
    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), p=0.3, training=self.training))


class DropoutPositional(_Base):
    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.3, self.training))


class EvalOnlyBranch(_Base):
    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        if not self.training:
            return y * 2
        return y


class DropPath(nn.Module):
    """Stochastic depth as vision models write it: identity unless training."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], 1).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop_path = DropPath(0.5)

    def forward(self, x):
        return x + self.drop_path(torch.relu(self.fc(x)))


class NestedDropPath(_Base):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.fc2(self.blocks(self.fc1(x)))


class CheckpointGuard(_Base):
    """Hugging Face's guard: gradient checkpointing only while training."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2))
        self.gradient_checkpointing = True

    def forward(self, x):
        h = self.fc1(x)
        if self.gradient_checkpointing and self.training:
            h = checkpoint(self.layer, h, use_reentrant=False)
        else:
            h = self.layer(h)
        return self.fc2(h)


class AttentionDropout(nn.Module):
    """SDPA with `dropout_p=self.p if self.training else 0.0`: the op has no train flag to follow the mode."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.p = 0.3

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(x.shape))


class TrainingCounter(_Base):
    """Counts training calls in a buffer; the output is the same in both modes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.steps.add_(1)
        return self.fc2(torch.relu(self.fc1(x)))


class AuxOutput(_Base):
    """Returns an auxiliary head's output in training only (as Inception-style networks do)."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.training:
            return self.fc2(h), self.aux(h)
        return self.fc2(h)


# model class, example input shape, number of torch.export calls (2: the other mode differs and is captured too)
CASES = {
    "noise_in_training": (NoiseInTraining, (6, 8), 2),
    "submodule_flag": (SubmoduleFlag, (6, 8), 2),
    "dropout_keyword": (DropoutKeyword, (6, 8), 1),
    "dropout_positional": (DropoutPositional, (6, 8), 1),
    "eval_only_branch": (EvalOnlyBranch, (6, 8), 2),
    "nested_drop_path": (NestedDropPath, (6, 8), 2),
    "checkpoint_guard": (CheckpointGuard, (6, 8), 1),
    "attention_dropout": (AttentionDropout, (2, 6, 16), 2),
    "training_counter": (TrainingCounter, (6, 8), 2),
    "aux_output": (AuxOutput, (6, 8), 2),
}


def _build(name):
    cls, shape, _ = CASES[name]
    torch.manual_seed(0)
    return cls(), torch.randn(*shape)


def _step(module, x, training):
    """Outputs, gradients and buffers of one seeded forward + default loss + backward, in the given mode; buffers
    and gradients are put back (the model and the result may share tensors)."""
    was = module.training
    module.train(training)
    saved = {n: p.grad for n, p in module.named_parameters()}
    try:
        with buffers_kept(module), torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            out, g = grads(module, (x,), {}, None)
            after = {n: b.clone() for n, b in module.named_buffers()}
    finally:
        for n, p in module.named_parameters():
            p.grad = saved[n]
        module.train(was)
    return out, g, after


def _assert_same_in_both_modes(model, result, x):
    """Outputs, gradients and buffers after one step, in eval mode then in train mode, from the model's buffers
    (transform's own runs may have advanced the result's: issue 32's second item, not what is checked here)."""
    model_buffers = dict(model.named_buffers())
    with torch.no_grad():
        for n, b in result.named_buffers():
            if n in model_buffers:
                b.copy_(model_buffers[n])
    for training in (False, True):
        ref_out, ref_grads, ref_buffers = _step(model, x, training)
        got_out, got_grads, got_buffers = _step(result, x, training)
        where = "train" if training else "eval"
        assert compare_outputs(ref_out, got_out, atol=1e-5, rtol=1e-4) is None, where
        assert ref_grads.keys() == got_grads.keys(), where
        for n in ref_grads:
            torch.testing.assert_close(got_grads[n], ref_grads[n], atol=1e-5, rtol=1e-4, msg=f"{where}: {n}")
        for n, b in got_buffers.items():
            torch.testing.assert_close(b, ref_buffers[n], msg=f"{where}: buffer {n}")


def _count_exports(monkeypatch) -> list:
    calls = []
    real = torch.export.export

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(torch.export, "export", counting)
    return calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_result_matches_the_model_in_eval_and_train_mode_also_after_load(name, tmp_path, monkeypatch):
    model, x = _build(name)
    exports = _count_exports(monkeypatch)
    res = fxmem.transform(copy.deepcopy(model), (x,), policy="low")
    assert len(exports) == CASES[name][2]
    assert all(r.status in ("applied", "unchanged") for r in res.records), [(r.name, r.reason) for r in res.records]
    _assert_same_in_both_modes(model, res.module, x)
    loaded = fxmem.load(res.save(tmp_path / "out"))
    _assert_same_in_both_modes(model, loaded, x)


def test_note_names_the_module_and_line_that_reads_the_flag():
    model, x = _build("nested_drop_path")
    res = fxmem.transform(model, (x,), policy="low")
    note = next(n for n in res.report.notes if "self.training" in n)
    assert "in module 'blocks.0.drop_path' (DropPath) at" in note
    assert f"{__file__}:" in note and "keep = x.new_empty(x.shape[0], 1).bernoulli_(1 - self.p)" in note
    assert "captured eval mode too" in note and "'eval_graph'" in note


def test_a_model_without_a_training_branch_is_captured_once(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    x = torch.randn(6, 8)
    exports = _count_exports(monkeypatch)
    for mode in ("train", "inference"):
        program = fxmem.capture(copy.deepcopy(model), (x,), mode=mode)
        assert not any(isinstance(m, ModeGraph) for m in program.module.modules())
        assert "self.training" not in program.module.code and program.notes == []
        # an eval capture's batch norm counts batches in train mode, as nn.BatchNorm does (no second graph for it)
        program.module.train()
        counter = program.module.get_buffer("1.num_batches_tracked")
        before = int(counter)
        program.module(x)
        assert int(counter) == before + 1
    assert len(exports) == 2  # one per capture


def test_inference_result_refuses_train_mode_where_the_model_trains_differently(tmp_path, monkeypatch):
    """An inference capture keeps its eval graph (its passes quantize and prune weights a train graph would read);
    where the model's training differs, a call in train mode raises rather than run the eval graph with dropout
    on, also after load. No second capture."""
    model, x = _build("noise_in_training")
    exports = _count_exports(monkeypatch)
    res = fxmem.transform(copy.deepcopy(model), (x,), policy="inference")
    assert len(exports) == 1
    assert any("'no_train_mode'" in n and "train NoiseInTraining itself" in n for n in res.report.notes)
    loaded = fxmem.load(res.save(tmp_path / "out"))
    model.eval()
    for result in (res.module, loaded):
        result.eval()
        with torch.no_grad():
            torch.testing.assert_close(result(x), model(x))
        result.train()
        with pytest.raises(CaptureError, match="this result of NoiseInTraining runs in eval mode only: captured in "
                                               "eval mode, NoiseInTraining computes something else"):
            result(x)


def test_the_other_graph_reads_the_trained_parameters_and_buffers():
    """An optimizer step on the result (train graph) and on the model give the same eval outputs after: the eval
    graph reads the root's tensors, it holds none of its own."""
    model, x = _build("submodule_flag")
    result = fxmem.transform(copy.deepcopy(model), (x,), policy="low").module
    assert not list(result.eval_graph.parameters()) and not list(result.eval_graph.buffers())
    for module in (model, result):
        module.train()
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        torch.manual_seed(3)
        module(x).square().mean().backward()
        opt.step()
        module.eval()
    with torch.no_grad():
        torch.testing.assert_close(result(x), model(x))
    result.load_state_dict(model.state_dict())  # same keys as the model: no copy of the weights under eval_graph
    result.double()
    with torch.no_grad():
        torch.testing.assert_close(result(x.double()), model.double()(x.double()))


@dataclasses.dataclass
class _GrowOptions:
    param: str = "fc2.weight"


class _ReplaceEvalOnlyWeight:
    """Test-only: leaves the main graph alone and swaps a weight only the eval-mode graph reads for one of another
    shape (what a pass that rewrites weights in place of the graph's does to a graph it does not rewrite)."""
    name = "test_replace_weight"
    exact = True
    test_only = True
    Options = _GrowOptions

    def run(self, program, ctx):
        owner, _, leaf = ctx.options.param.rpartition(".")
        mod = copy.copy(program.module.get_submodule(owner))  # copy on write: the snapshot shares submodules
        mod._parameters = dict(mod._parameters)
        setattr(mod, leaf, nn.Parameter(torch.zeros(getattr(mod, leaf).shape[0], 3)))
        setattr(program.module, owner, mod)
        return PassResult(program, True, [Change("test", owner, [], [], "swap a weight")])


class EvalHead(_Base):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        return y if self.training else self.head(y)


def test_a_pass_that_breaks_the_other_modes_graph_is_rolled_back():
    pipeline.register(_ReplaceEvalOnlyWeight)
    try:
        torch.manual_seed(0)
        model, x = EvalHead(), torch.randn(6, 8)
        policy = {"version": 1, "mode": "train", "optimizer": "adamw",
                  "passes": {"test_replace_weight": {"enabled": True, "param": "head.weight"}}}
        res = fxmem.transform(copy.deepcopy(model), (x,), policy=policy)
    finally:
        pipeline.REGISTRY.pop(_ReplaceEvalOnlyWeight.name, None)
        unregister_options(_ReplaceEvalOnlyWeight.name)
    rec = res.records[0]
    assert rec.status == "rolled_back"
    assert rec.reason.startswith("the eval-mode graph (the model reads self.training) fails after the pass")
    _assert_same_in_both_modes(model, res.module, x)


class DataDependentInEval(_Base):
    def forward(self, x):
        h = self.fc1(x)
        if not self.training and h.sum() > -1e9:  # a python branch on a tensor value: export cannot capture it
            h = h * 2
        return self.fc2(h)


def test_other_mode_that_cannot_be_captured_is_a_capture_error():
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    with pytest.raises(CaptureError) as info:
        fxmem.transform(DataDependentInEval(), (x,), policy="low")
    msg = str(info.value)
    assert "\n" not in msg
    assert "computes something else than DataDependentInEval in eval mode" in msg
    assert "capturing eval mode as well failed" in msg
    details = msg.rsplit("torch's full error, traceback and partial graph: ", 1)[1]  # the eval capture's, kept
    assert "GuardOnDataDependentSymNode" in open(details, encoding="utf-8").read()
    os.remove(details)


MODEL_FILE = """
    import torch
    from torch import nn


    class DropPathNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            if self.training:
                h = h * h.new_empty(h.shape[0], 1).bernoulli_(0.5) / 0.5
            return self.fc2(h)


    def build_model():
        torch.manual_seed(0)
        return DropPathNet()


    def example_inputs():
        torch.manual_seed(1)
        return (torch.randn(6, 8),)
"""


def test_cli_optimize_writes_a_result_that_matches_in_both_modes(tmp_path):
    path = tmp_path / "droppath.py"
    path.write_text(textwrap.dedent(MODEL_FILE))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "fxmem.cli", "optimize", str(path), "--policy", "low", "--strict",
                        "--budget", "100%", "--out", str(out)], capture_output=True, text=True, cwd=str(ROOT),
                       timeout=600)
    assert r.returncode == 0, r.stderr
    notes = json.loads((out / "report.json").read_text())["notes"]
    assert any("self.training" in n and "captured eval mode too" in n for n in notes)
    assert "if self.eval_graph.takes(self): return self.eval_graph(self, x)" in (out / "transformed.py").read_text()
    spec = importlib.util.spec_from_file_location("droppath", path)
    droppath = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(droppath)
    _assert_same_in_both_modes(droppath.build_model(), fxmem.load(out), droppath.example_inputs()[0])
