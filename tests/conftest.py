"""Shared fixtures: example model files loaded once per session, deterministic torch settings."""
from __future__ import annotations

import functools
import importlib
import os
import pathlib
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py") if p.stem != "__init__")

# one intra-op thread per pytest-xdist worker (the workers share the cores), else up to two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
warnings.filterwarnings("ignore", category=FutureWarning)


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops (packet name) and records the row counts of mm/addmm inputs."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}
        self.mm_rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        self.ops[name] = self.ops.get(name, 0) + 1
        if name in ("mm", "addmm"):
            a = args[1] if name == "addmm" else args[0]
            self.mm_rows.append(int(a.shape[0]))
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> int:
        return self.ops.get("mm", 0) + self.ops.get("addmm", 0)


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
