"""The user's model comes back from every entry point (capture, estimate, measure, plan_batch, transform, the CLI)
exactly as it was handed over: parameter values, `.grad` and requires_grad, buffers (step counters, batch-norm
statistics, EMAs), every submodule's training flag and the RNG states, bit for bit, although fxmem runs it (and
programs sharing its tensors) in train mode many times. A transform's result starts from that same state: its first
training step equals the untouched model's (outputs, gradients, buffers after the step), bit for bit."""
from __future__ import annotations

import copy
import inspect
import random
import textwrap
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fxmem
from fxmem.cli import main
from fxmem.userstate import model_state_kept


class StepCounter(nn.Module):
    """(a) A step counter buffer advanced by every training forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.steps += 1
        return self.fc2(torch.tanh(self.fc1(x)))


class BatchNormNet(nn.Module):
    """(b) Batch-norm running statistics and num_batches_tracked."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class EmaNet(nn.Module):
    """(c) An EMA of the inputs updated by every forward, which the output depends on."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return self.fc2(torch.tanh(self.fc1(x - self.ema)))


class DropoutNet(nn.Module):
    """(d) Dropout: every training forward draws from the global RNG."""

    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class FrozenNormNet(nn.Module):
    """(e) A training model whose batch norm the user froze in eval (running statistics used, not updated)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.drop, self.fc2 = nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Dropout(0.2), \
            nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


class Everything(nn.Module):
    """(a)-(e) in one model, for the slower entry points."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.frozen = nn.Linear(8, 32), nn.BatchNorm1d(32), nn.BatchNorm1d(32)
        self.drop, self.fc2, self.fc3 = nn.Dropout(0.2), nn.Linear(32, 32), nn.Linear(32, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        if self.training:
            self.steps += 1
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        h = self.drop(torch.relu(self.norm(self.fc1(x - self.ema))))
        return self.fc3(torch.tanh(self.frozen(self.fc2(h))))


MODELS = {"step_counter": StepCounter, "batch_norm": BatchNormNet, "ema": EmaNet, "dropout": DropoutNet,
          "frozen_norm": FrozenNormNet}


def build(name: str):
    """The model as a user hands it over: in train mode (a frozen norm in eval), buffers away from their initial
    values, gradients left from an earlier backward. Returns (model, example inputs)."""
    torch.manual_seed(0)
    model = Everything() if name == "everything" else MODELS[name]()
    with torch.no_grad():
        for b in model.buffers():
            b.add_(torch.rand(b.shape) if b.is_floating_point() else 3)
    for m in model.modules():
        if m is not model and isinstance(m, nn.BatchNorm1d) and (name == "frozen_norm" or m is
                                                                 getattr(model, "frozen", None)):
            m.eval()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model, (torch.randn(16, 8),)


def queued_cuda_seeds() -> list:
    """The seeds `torch.manual_seed` queued for CUDA's initialisation (CUDA not initialised yet: every manual_seed
    call queues one), which a later first use of CUDA applies."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None:
        return []
    return [inspect.getclosurevars(call[0]).nonlocals.get("seed") for call in tracker.get_calls() if call]


def state_of(model: nn.Module) -> dict:
    """Everything the user's model and the process hold that fxmem must hand back unchanged."""
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "param_ids": {n: id(p) for n, p in model.named_parameters()},
            "grads": {n: (id(p.grad), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
            "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "training": {n: m.training for n, m in model.named_modules()},
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "numpy_rng": np.random.get_state(),
            "cuda_queued_seeds": queued_cuda_seeds(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []}


def assert_same(before: dict, after: dict) -> None:
    for key in ("params", "buffers"):
        assert after[key].keys() == before[key].keys(), key
        for n, t in before[key].items():
            assert t.dtype == after[key][n].dtype and torch.equal(t, after[key][n]), f"{key}: {n}"
    for n, (grad_id, grad) in before["grads"].items():
        got = after["grads"][n]
        assert got[0] == grad_id and (grad is None or torch.equal(got[1], grad)), f"grad of {n}"
    for key in ("training", "param_ids", "requires_grad", "python_rng", "cuda_queued_seeds"):
        assert after[key] == before[key], key
    assert torch.equal(before["torch_rng"], after["torch_rng"]), "torch RNG state"
    assert len(before["cuda_rng"]) == len(after["cuda_rng"]) and \
        all(torch.equal(a, b) for a, b in zip(before["cuda_rng"], after["cuda_rng"])), "CUDA RNG states"
    np_before, np_after = before["numpy_rng"], after["numpy_rng"]
    assert np_before[0] == np_after[0] and np.array_equal(np_before[1], np_after[1]) and \
        np_before[2:] == np_after[2:], "numpy RNG state"


def first_step(module: nn.Module, x) -> tuple:
    """One seeded training step from cleared gradients: (output, gradients, buffers after the step)."""
    for p in module.parameters():
        p.grad = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        out = module(*x)
        out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), grads, {n: b.clone() for n, b in module.named_buffers()}


def assert_starts_like(result_module: nn.Module, untouched: nn.Module, x) -> None:
    """The result's first training step, then its eval forward, equal the untouched model's, bit for bit."""
    result_module.train()
    ref, got = first_step(untouched, x), first_step(result_module, x)
    assert torch.equal(ref[0], got[0]), "output of the first training step"
    for what, ref_d, got_d in (("gradient", ref[1], got[1]), ("buffer after the step", ref[2], got[2])):
        for n, t in ref_d.items():
            assert n in got_d and torch.equal(t, got_d[n]), f"{what} {n}"
    untouched.eval()
    result_module.eval()
    with torch.no_grad():
        assert torch.equal(untouched(*x), result_module(*x)), "eval output"


def run_kept(name: str, call):
    """(model, x, untouched copy, what `call(model, x)` returned), asserting the model came back unchanged."""
    model, x = build(name)
    untouched = copy.deepcopy(model)
    before = state_of(model)
    out = call(model, x)
    assert_same(before, state_of(model))
    return model, x, untouched, out


# ============================================================================================ entry points

@pytest.mark.parametrize("name", ["everything", "ema"])  # (the EMA written under no_grad: a higher-order op)
def test_transform_low_keeps_the_model_and_the_result_starts_from_it(name):
    _, x, untouched, res = run_kept(name, lambda m, x: fxmem.transform(m, x, policy="low"))
    assert all(r.status in ("applied", "unchanged") for r in res.records)  # no pass rolled back: runs agree
    assert_starts_like(res.module, untouched, x)


CHECKPOINT_OFFLOAD = {"version": 1, "extends": "low", "budget": "20%",
                      "passes": {"offload": {"enabled": True, "activations": True, "min_bytes": 0,
                                             "bandwidth": "1GB/s"}}}


def test_transform_with_checkpoint_and_offload_keeps_the_model_and_the_result_starts_from_it():
    _, x, untouched, res = run_kept("everything", lambda m, x: fxmem.transform(m, x, policy=CHECKPOINT_OFFLOAD))
    statuses = {r.name: r.status for r in res.records}
    assert statuses["checkpoint"] == statuses["offload"] == "applied"
    assert_starts_like(res.module, untouched, x)


def test_transform_high_keeps_the_model_and_the_result_holds_its_buffers():
    """A lossy policy (bf16 compute): the user's model comes back unchanged; the result's buffers are the model's
    (no step counted, no statistic moved)."""
    _, _, untouched, res = run_kept("everything", lambda m, x: fxmem.transform(m, x, policy="high"))
    assert {r.name: r.status for r in res.records}["precision"] == "applied"
    got = dict(res.module.named_buffers())
    for n, b in untouched.named_buffers():
        assert torch.equal(got[n].to(b.dtype), b), n


@pytest.mark.parametrize("name", MODELS)
def test_capture_keeps_the_model_and_its_flags(name):
    _, x, untouched, program = run_kept(name, lambda m, x: fxmem.capture(m, x))
    assert_starts_like(program.module, untouched, x)


@pytest.mark.parametrize("name", MODELS)
def test_estimate_keeps_the_model(name):
    run_kept(name, lambda m, x: fxmem.estimate(m, x, method="traced"))


@pytest.mark.parametrize("name", MODELS)
def test_measure_keeps_the_model_although_it_takes_optimizer_steps(name):
    _, _, _, prof = run_kept(name, lambda m, x: fxmem.measure(m, x, optimizer="adamw"))
    assert prof.optimizer_state > 0  # the steps ran (AdamW state existed)


@pytest.mark.parametrize("name", MODELS)
def test_plan_batch_keeps_the_model(name):
    # (batch statistics of a batch of 1 divide by zero: the batch-norm model is planned for inference)
    mode = "inference" if name == "batch_norm" else "train"
    _, _, _, plan = run_kept(name, lambda m, x: fxmem.plan_batch(m, x, budget=2 ** 30, mode=mode))
    assert plan["batch"] > 0


def test_a_transform_that_fails_keeps_the_model():
    """The state is put back on the way out of an error too (here a budget no pass can reach, after the runs)."""
    model, x = build("everything")
    before = state_of(model)
    with pytest.raises(fxmem.BudgetError):
        fxmem.transform(model, x, policy="low", budget=1024, strict=True)
    assert_same(before, state_of(model))


@pytest.mark.cuda
def test_transform_of_a_cuda_model_keeps_the_cuda_generator():
    model, x = build("everything")
    model, x = model.cuda(), tuple(t.cuda() for t in x)  # (.cuda() moves the gradients too)
    untouched = copy.deepcopy(model)
    before = state_of(model)
    assert before["cuda_rng"]
    res = fxmem.transform(model, x, policy="low")
    assert_same(before, state_of(model))
    assert_starts_like(res.module, untouched, x)


def test_cli_optimize_saves_a_result_that_starts_from_the_built_model(tmp_path, capsys):
    """The model file's model is run by the input check and the transform; the saved result holds its state as
    build_model() made it."""
    model_file = tmp_path / "model.py"
    model_file.write_text(textwrap.dedent("""
        from tests.test_user_state import build
        def build_model():
            return build("everything")[0]
        def example_inputs():
            return build("everything")[1]
    """))
    out = tmp_path / "out"
    code = main(["optimize", str(model_file), "--policy", "low", "--out", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    untouched, x = build("everything")
    loaded = fxmem.load(out)
    got = dict(loaded.named_buffers())
    for n, b in untouched.named_buffers():
        assert torch.equal(got[n], b), n
    assert_starts_like(loaded, untouched, x)


# ============================================================================================ the rule itself

def test_a_parameter_the_forward_writes_in_place_is_said():
    """Parameter values are not copied (that would double the weights): a forward that writes one is named."""
    model = nn.Linear(4, 4)
    with pytest.warns(RuntimeWarning, match="'weight'"):
        with model_state_kept(model):
            with torch.no_grad():
                model.weight.clamp_(-0.1, 0.1)


def test_parameter_values_are_put_back_when_asked():
    model = nn.Linear(4, 4)
    before = state_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with model_state_kept(model, parameter_values=True):
            torch.optim.SGD(model.parameters(), lr=1.0).zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=1.0).step()
            model.weight.requires_grad_(False)
            model.eval()
    assert_same(before, state_of(model))
