"""What the model does while torch.export traces it: the module being run (`ModuleTracker`), the custom
`torch.autograd.Function`s it calls and the gradient hooks it registers on tensors (`FunctionCalls`), both of
which non-strict export drops (`DROPPED`); `record_function_calls` records them for the duration of an export."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXMEM_DIR = os.path.dirname(os.path.abspath(__file__))

class ModuleTracker:
    """Forward hooks that keep the stack of module paths being run: where a recorded call was made, and where
    capture failed."""

    def __init__(self, model: nn.Module):
        self.stack: list[str] = []
        self.deepest: list[str] = []
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._pre(name or "<root>")))
            self.handles.append(mod.register_forward_hook(self._post(), always_call=True))

    def _pre(self, name):
        def hook(mod, inp):
            self.stack.append(name)
            self.deepest = list(self.stack)
        return hook

    def _post(self):
        def hook(mod, inp, out):
            if self.stack:
                self.stack.pop()
        return hook

    def close(self):
        for handle in self.handles:
            handle.remove()


# what torch.export does with the two things `FunctionCalls` records
DROPPED = ("torch.export (non-strict) inlines a custom Function's forward and drops its backward, and drops gradient "
           "hooks registered on tensors in forward")


@dataclass
class FunctionUse:
    """One custom autograd.Function class the model called, or its gradient hooks on tensors, while export traced."""
    name: str                                      # "custom torch.autograd.Function module.qualname", or the hook's
    paths: list[str] = field(default_factory=list)  # nn.Module paths it was called in, first call first
    where: str | None = None                       # source line of the first call

    def describe(self) -> str:
        location = f" at {self.where}" if self.where else ""
        paths = ", ".join(repr(p) for p in self.paths[:3])
        more = f" and {len(self.paths) - 3} more" if len(self.paths) > 3 else ""
        return f"{self.name} (in module {paths}{more}{location})"


class FunctionCalls:
    """Custom `torch.autograd.Function`s the model calls, and gradient hooks it registers on tensors in forward
    (`Tensor.register_hook`, which export drops as well: the hook never runs on the captured module's gradients),
    recorded while export traces.

    Non-strict export runs the model's python: `Function.apply` runs the C++ autograd node's forward, whose aten
    ops the pre-dispatch tracer records one by one; the Function itself leaves nothing in the graph, so its
    backward is replaced by autograd's derivative of the inlined forward. (torch 2.13 keeps a Function only
    through `torch._export.wrappers.allow_in_pre_dispatch_graph`, an experimental decorator the user must put on
    `apply`, which calls the class again by import path at run time; strict export runs the forward under
    no_grad.) The calls are recorded by wrapping `torch.autograd.Function.apply` for the duration of the export,
    with the module path from `ModuleTracker`."""

    def __init__(self):
        self.uses: dict[type, FunctionUse] = {}
        self.tracker: ModuleTracker | None = None

    # Functions that implement an op export keeps as one node (torch.library.custom_op's register_autograd,
    # higher-order ops): the op's autograd kernel runs them again when the graph runs, backward included
    KEPT_BY_EXPORT = ("torch._library.", "torch._higher_order_ops.")

    def record(self, cls: type) -> None:
        if self.tracker is None or not self.tracker.stack:
            return  # not the model's code (export's own machinery)
        if (cls.__module__ or "").startswith(self.KEPT_BY_EXPORT):
            return
        self._add(cls, f"custom torch.autograd.Function {cls.__module__}.{cls.__qualname__}")

    def record_hook(self) -> None:
        if self.tracker is not None and self.tracker.stack:
            self._add(TensorHook, "a gradient hook registered in forward (Tensor.register_hook)")

    def _add(self, key, name: str) -> None:
        path = self.tracker.stack[-1]
        use = self.uses.get(key)
        if use is None:
            use = self.uses[key] = FunctionUse(name, where=_calling_line())
        if path not in use.paths:
            use.paths.append(path)

    def describe(self) -> str:
        return "; ".join(u.describe() for u in self.uses.values())


class TensorHook:
    """Key of `FunctionCalls.uses` for gradient hooks on tensors."""


def is_user_file(filename: str) -> bool:
    """Model code: a real file outside torch and fxmem."""
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_FXMEM_DIR) or "<" in filename)


def _calling_line() -> str | None:
    """file:line of the innermost model-code frame calling in."""
    frame = sys._getframe(2)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


_ACTIVE_CALLS: contextvars.ContextVar[FunctionCalls | None] = contextvars.ContextVar("fxmem_function_calls",
                                                                                   default=None)
_APPLY_LOCK = threading.Lock()
_APPLY_DEPTH = 0
_ORIGINAL_APPLY: Any = None
_ORIGINAL_HOOK: Any = None


def _recording_apply(cls, *args, **kwargs):
    calls = _ACTIVE_CALLS.get()
    if calls is not None:
        calls.record(cls)
    return _ORIGINAL_APPLY.__get__(None, cls)(*args, **kwargs)


def _recording_register_hook(self, hook):
    calls = _ACTIVE_CALLS.get()
    if calls is not None:
        calls.record_hook()
    return _ORIGINAL_HOOK(self, hook)


@contextlib.contextmanager
def record_function_calls(calls: FunctionCalls):
    """Wrap `torch.autograd.Function.apply` (subclasses inherit it; overrides reach it through super().apply) and
    `torch.Tensor.register_hook` while `calls` is active in this context; the originals are put back when the last
    recorder ends."""
    global _APPLY_DEPTH, _ORIGINAL_APPLY, _ORIGINAL_HOOK
    fn_cls = torch.autograd.Function
    with _APPLY_LOCK:
        if _APPLY_DEPTH == 0:
            _ORIGINAL_APPLY = fn_cls.__dict__["apply"]
            fn_cls.apply = classmethod(functools.wraps(_ORIGINAL_APPLY.__func__)(_recording_apply))
            _ORIGINAL_HOOK = torch.Tensor.__dict__["register_hook"]
            torch.Tensor.register_hook = functools.wraps(_ORIGINAL_HOOK)(_recording_register_hook)
        _APPLY_DEPTH += 1
    token = _ACTIVE_CALLS.set(calls)
    try:
        yield
    finally:
        _ACTIVE_CALLS.reset(token)
        with _APPLY_LOCK:
            _APPLY_DEPTH -= 1
            if _APPLY_DEPTH == 0:
                fn_cls.apply = _ORIGINAL_APPLY
                torch.Tensor.register_hook = _ORIGINAL_HOOK
