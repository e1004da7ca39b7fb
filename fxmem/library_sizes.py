"""Sizes a library computes from tensor values, kept symbolic while a model is captured.

PyG's `scatter(src, index, dim_size=None)` (behind `global_add_pool`, `global_mean_pool`, `global_max_pool` and
other pooling called without `size=`) computes the output size as `int(index.max()) + 1`. `int()` needs a concrete
value, which torch.export cannot give for a value that depends on the input data, so such a model fails to capture.
While capture runs, `library_sizes_symbolic` binds every reference PyG's modules hold to that function to one that
computes the same size as `index.max().item() + 1`: export keeps it as a size read from the data at run time (an
unbacked symbol), so the captured module pools any number of graphs, exactly as the model does. Eager calls get the
same value either way. Nothing changes when torch_geometric is not imported.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading

import torch

_PYG_SCATTER = ("torch_geometric.utils._scatter", "scatter")


def _size_from_index(index: torch.Tensor):
    """The size PyG computes (`int(index.max()) + 1`), as a value export keeps symbolic: a non-negative index is
    checked at run time (a negative one is out of bounds for the scatter anyway)."""
    largest = index.max().item()
    torch._check(largest >= 0)
    return largest + 1


def _sized_scatter(original):
    """`original` (PyG's scatter) with `dim_size` computed by `_size_from_index` when the caller left it out."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def scatter(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        index = bound.arguments.get("index")
        if bound.arguments.get("dim_size") is None and isinstance(index, torch.Tensor) and index.numel() > 0:
            bound.arguments["dim_size"] = _size_from_index(index)
        return original(*bound.args, **bound.kwargs)

    return scatter


def _references(original) -> list[tuple[dict, str]]:
    """(module namespace, name) of every loaded torch_geometric module's global that is `original`."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch_geometric" or name.startswith("torch_geometric.")):
            continue
        namespace = getattr(module, "__dict__", {})
        found.extend((namespace, key) for key, value in list(namespace.items()) if value is original)
    return found


_LOCK = threading.Lock()
_DEPTH = 0
_BOUND: list[tuple[dict, str, object, object]] = []  # (namespace, name, original, sized) while bound


def _bind() -> None:
    module_name, attribute = _PYG_SCATTER
    module = sys.modules.get(module_name)
    original = getattr(module, attribute, None) if module is not None else None
    if original is None:
        return
    sized = _sized_scatter(original)
    for namespace, key in _references(original):
        namespace[key] = sized
        _BOUND.append((namespace, key, original, sized))


def _unbind() -> None:
    for namespace, key, original, sized in _BOUND:
        if namespace.get(key) is sized:
            namespace[key] = original
    _BOUND.clear()


@contextlib.contextmanager
def library_sizes_symbolic():
    """While inside, PyG's scatter computes a missing `dim_size` symbolically (see the module docstring); captures
    running at once in several threads share one binding, undone when the last one ends."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            _bind()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _unbind()
