"""What one training (or inference) step is, shared by measurement and the traced estimate.

A training step = forward, loss, backward, optimizer.step(), zero_grad(set_to_none=True). The default loss is
the sum of `.float().mean()` over every floating-point tensor in the flattened output.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw", "adamw8bit", "adam8bit", "paged_adamw8bit")


def default_loss(output: Any, inputs: Any = None) -> torch.Tensor:
    terms = [t.float().mean() for t in pytree.tree_leaves(output)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not terms:
        terms = [t.float().mean() for t in pytree.tree_leaves(output)
                 if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not terms:
        raise ValueError("the model's output has no floating-point tensor to build a default loss from; "
                         "pass loss_fn=")
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def make_torch_optimizer(name: str, params: list[nn.Parameter], lr: float = 1e-3):
    """The optimizer a step uses. 8-bit optimizers come from bitsandbytes."""
    name = (name or "none").lower()
    params = [p for p in params if p.requires_grad]
    if name == "none" or not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name in ("adamw8bit", "adam8bit", "paged_adamw8bit"):
        import warnings

        import bitsandbytes as bnb
        cls = {"adamw8bit": bnb.optim.AdamW8bit, "adam8bit": bnb.optim.Adam8bit,
               "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")


def call_model(model: Callable, args: tuple, kwargs: dict):
    return model(*args, **kwargs)


def compute_loss(loss_fn, output, args, kwargs):
    if loss_fn is None:
        return default_loss(output)
    # the model file's protocol: loss_fn(output, inputs) with inputs as example_inputs() returned them
    inputs = kwargs if (kwargs and not args) else args
    return loss_fn(output, inputs)


def training_step(model, args, kwargs, optimizer, loss_fn=None, marks: Callable[[str], None] | None = None):
    """One step; `marks(phase)` is called at 'forward', 'backward', 'optimizer', 'end' boundaries."""
    mark = marks or (lambda _phase: None)
    mark("forward")
    out = model(*args, **kwargs)
    loss = compute_loss(loss_fn, out, args, kwargs)
    mark("backward")
    loss.backward()
    mark("optimizer")
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in _params_of(model):
            p.grad = None
    mark("end")
    del out, loss


def _params_of(model):
    return model.parameters() if isinstance(model, nn.Module) else []
