"""Shared fixtures: example model files loaded once per session, deterministic torch settings."""
from __future__ import annotations

import functools
import importlib
import os
import pathlib
import warnings

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py") if p.stem != "__init__")

# one intra-op thread per pytest-xdist worker (the workers share the cores), else up to two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
warnings.filterwarnings("ignore", category=FutureWarning)


@functools.lru_cache(maxsize=None)
def example_module(name: str):
    return importlib.import_module(f"examples.{name}")


def example(name: str, **build_kwargs):
    """(model, args, kwargs, loss_fn) for an example, built fresh (deterministic)."""
    from fxmem.modelfile import split_inputs
    mod = example_module(name)
    model = mod.build_model(**build_kwargs)
    args, kwargs = split_inputs(mod.example_inputs())
    return model, args, kwargs, getattr(mod, "loss_fn", None)


def grads(module, args, kwargs, loss_fn):
    """(output, {param name: grad}) of one forward + default-or-given loss + backward, from cleared grads."""
    from fxmem.step import compute_loss
    for p in module.parameters():
        p.grad = None
    out = module(*args, **kwargs)
    compute_loss(loss_fn, out, args, kwargs).backward()
    return out, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
