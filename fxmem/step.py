"""What one training (or inference) step is, shared by measurement and the traced estimate.

A training step = forward, loss, backward, optimizer.step(), zero_grad(set_to_none=True). The default loss is
the sum of `.float().mean()` over every floating-point tensor in the flattened output.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .errors import LossFnError, ModelFileError
from .program import buffers_kept

OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw", "adamw8bit", "adam8bit", "paged_adamw8bit")


def _floating_leaves(output: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def default_loss(output: Any, inputs: Any = None) -> torch.Tensor:
    floating = _floating_leaves(output)
    terms = [t.float().mean() for t in floating if t.requires_grad] or [t.float().mean() for t in floating]
    if not terms:
        raise ValueError("the model's output has no floating-point tensor to build a default loss from; "
                         "pass loss_fn=")
    total = terms[0]
    for term in terms[1:]:
        total = total + term
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
        import bitsandbytes as bnb  # (optional heavy dependency: loaded for the 8-bit optimizers only)
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


def check_trainable(model: nn.Module, args: tuple, kwargs: dict, loss_fn, where: str) -> None:
    """`require_trainable_loss` on one forward of `model` with autograd on, before any work. In eval mode, as the
    pipeline's reference step runs (a training-mode forward may fail where that one does not); the buffers, the RNG
    state and the mode are left as they were."""
    was = model.training
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), buffers_kept(model):
            model.eval()
            output = model(*args, **kwargs)
            require_trainable_loss(model, output, args, kwargs, loss_fn, where)
    finally:
        model.train(was)


def require_trainable_loss(model: nn.Module, output: Any, args: tuple, kwargs: dict, loss_fn, where: str) -> None:
    """A training step runs `loss.backward()`: the loss must be a floating-point tensor that autograd can take back
    to a trainable parameter. `output` is the model's, computed with autograd on. A user error naming `where` (the
    model file, or the model) otherwise: an output with no floating-point tensor (the default loss), a model with
    no trainable parameter, an output that does not depend on one, a constant, detached or integer loss."""
    if loss_fn is None and not _floating_leaves(output):
        raise ModelFileError(f"{where}: the model's output has no floating-point tensor to build the default loss "
                             "from; define loss_fn(output, inputs) in the model file")
    loss = compute_loss(loss_fn, output, args, kwargs)
    said = "loss_fn(output, inputs)"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:  # (the model file's loss_fn says so itself)
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LossFnError(f"{where}: {said} must return a scalar tensor, got {got}")
    if loss.requires_grad:
        return
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        frozen = f" (all {len(params)} are frozen: requires_grad=False)" if params else ""
        raise ModelFileError(f"{where}: the model has no trainable parameters{frozen}, so a training step has "
                             "nothing to update; use inference mode (a policy with mode: inference, e.g. --policy "
                             "inference; fxmem estimate --mode inference)")
    if loss_fn is None:
        raise ModelFileError(f"{where}: the model's output does not depend on its trainable parameters (computed "
                             "under torch.no_grad() or detached?), so the default loss cannot be backpropagated; "
                             "define loss_fn(output, inputs) in the model file")
    if not (loss.is_floating_point() or loss.is_complex()):
        dtype = str(loss.dtype).replace("torch.", "")
        raise LossFnError(f"{where}: {said} returned a loss of dtype {dtype}; backward needs a floating-point loss "
                          "computed from the output (e.g. a cross-entropy, not an argmax)")
    raise LossFnError(f"{where}: {said} returned a loss that does not depend on the model's parameters (a constant or "
                      "a detached tensor: requires_grad is False), so backward cannot run; compute it from `output` "
                      "without .detach(), .item() or torch.no_grad()")


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
        for param in _params_of(model):
            param.grad = None
    mark("end")
    del out, loss


def _params_of(model):
    return model.parameters() if isinstance(model, nn.Module) else []
