"""Arguments capture adds to the user's call are bound inside the graph, never added to its signature.

A Hugging Face model with `config.use_cache` returns a cache object that torch.export cannot output, so capture runs
it with `use_cache=False`. Passing that as an input would make the result require an argument the user never
passes. Instead the model's `forward` is bound to those values while capture runs (`defaults_bound`): export sees
the user's own call, and the added values are constants inside the graph.

    added = capture_defaults(model, args, kwargs)   # {"use_cache": False} or {}
    with defaults_bound(model, added):
        ep = torch.export.export(model, args, kwargs, ...)
"""
from __future__ import annotations

import contextlib
import functools
import inspect

from torch import nn

_MISSING = object()


def capture_defaults(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The keyword arguments capture adds to `model(*args, **kwargs)`: `use_cache=False` for a model whose config
    turns its cache on, unless the user's call sets `use_cache` itself (by keyword or by position)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "use_cache", False):
        return {}
    try:
        signature = inspect.signature(model.forward)
        given = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}
    if "use_cache" not in signature.parameters or "use_cache" in given:
        return {}
    return {"use_cache": False}


@contextlib.contextmanager
def defaults_bound(model: nn.Module, added: dict):
    """`model.forward` with `added` bound as keyword arguments while inside; the model's own `forward` (an instance
    attribute the user set, or the class's method) is put back on exit."""
    if not added:
        yield
        return
    own = model.__dict__.get("forward", _MISSING)
    model.forward = functools.partial(model.forward, **added)
    try:
        yield
    finally:
        if own is _MISSING:
            del model.forward
        else:
            model.forward = own


def describe_defaults(added: dict) -> str:
    """A note for the report: what was bound and what that means for the result."""
    values = ", ".join(f"{name}={value!r}" for name, value in added.items())
    return (f"captured with {values} bound inside the graph (the model would otherwise return a cache object that "
            "torch.export cannot output); the result takes the arguments it was called with at capture")
