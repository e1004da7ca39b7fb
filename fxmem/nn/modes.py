"""Train/eval switching for captured graphs.

`torch.export` bakes `training=True/False` into dropout and batch-norm calls. fxmem makes those arguments read
the GraphModule's own `training` flag through a `ModeFlag` submodule, so `.train()` / `.eval()` behave as they
do on the user's module. Where the model's python itself reads `self.training`, the other mode is a graph of its
own (`ModeGraph`), which the root's forward switches to.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree

from ..errors import CaptureError


class ModeFlag(nn.Module):
    """Returns the module's `training` flag; `.train()`/`.eval()` on the parent propagate to it."""

    def forward(self) -> bool:
        return self.training


def count_batch(num_batches_tracked: torch.Tensor, training: bool) -> torch.Tensor:
    """Batch-norm's `num_batches_tracked += 1`, which only happens in training mode.

    Not under FakeTensorMode: shape propagation and the traced cost model run the graph on fake inputs with the
    module's real buffers, and must not count a batch the user never ran. Under torch.compile the compiled graph
    counts (the dispatch-mode query is not traceable: checking it would break the graph)."""
    if training and (torch.compiler.is_compiling()
                     or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None):
        num_batches_tracked.add_(1)
    return num_batches_tracked


torch.fx.wrap("count_batch")


# ------------------------------------------------------------------------------------------- one graph per mode

_DISPATCH: contextvars.ContextVar[bool] = contextvars.ContextVar("fxmem_mode_dispatch", default=True)


@contextlib.contextmanager
def mode_dispatch(enabled: bool):
    """Turn `ModeGraph` dispatch off (or back on) in this context. While passes rewrite and evaluate a program,
    every run of it is a run of its main graph, whatever mode they run it in; the pipeline checks the other mode's
    graph with dispatch on."""
    token = _DISPATCH.set(enabled)
    try:
        yield
    finally:
        _DISPATCH.reset(token)


class ModeGraph(nn.Module):
    """The graph of the mode a captured program's main graph does not serve.

    When the model's python reads `self.training` (an `if self.training:` branch, noise added in training only,
    a mode-dependent value passed to an op with no train flag), its two modes are two programs; fxmem captures
    both. The root GraphModule's forward starts with `if self.<name>.takes(self): return self.<name>(self, ...)`
    (`ModeDispatchCodeGen`), so `.train()` / `.eval()` switch graphs. This graph holds no parameters or buffers of
    its own: it reads the root's, by name, at every call (`attr_paths`), so training, `load_state_dict`, `.to()` and
    passes that replace a tensor under the same name are seen by both graphs.
    """

    def __init__(self, module: torch.fx.GraphModule, training: bool, attr_paths: list[str], out_spec):
        super().__init__()
        self.module = module              # placeholders: the root tensors at `attr_paths`, then the flat inputs
        self.serves_training = training
        self.attr_paths = list(attr_paths)
        self.out_spec = out_spec          # the output structure of this mode (it may differ from the other's)

    def takes(self, root: nn.Module) -> bool:
        """Whether `root` in its current mode runs this graph."""
        return root.training == self.serves_training and _DISPATCH.get()

    def forward(self, root: nn.Module, *flat_inputs):
        tensors = [tensor_at(root, path) for path in self.attr_paths]
        out = self.module(*tensors, *flat_inputs)
        return pytree.tree_unflatten(list(out), self.out_spec)

    def extra_repr(self) -> str:
        return f"serves={'train' if self.serves_training else 'eval'}, reads={len(self.attr_paths)} tensors"


class ModeRefusal(nn.Module):
    """Stands for a mode the program cannot run faithfully (the model's python reads `self.training` and that mode
    could not be captured, or its capture does not reproduce the model): a call in that mode raises a CaptureError
    that says why, rather than run another model."""

    def __init__(self, training: bool, reason: str):
        super().__init__()
        self.serves_training = training
        self.reason = reason

    def takes(self, root: nn.Module) -> bool:
        return root.training == self.serves_training and _DISPATCH.get()

    def forward(self, root: nn.Module, *flat_inputs):
        raise CaptureError(self.reason)


def tensor_at(root: nn.Module, path: str) -> torch.Tensor:
    """The attribute at a dotted `path` of `root` (a parameter or buffer); AttributeError when there is none."""
    owner, _, name = path.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, name)


def mode_graph(module: nn.Module) -> ModeGraph | None:
    """The `ModeGraph` child of a captured program's module, if it has one."""
    return next((m for m in module.children() if isinstance(m, ModeGraph)), None)


class ModeDispatchCodeGen(_PyTreeCodeGen):
    """torch.export's pytree code generation, plus a first line that hands the call to the child `branch` (a
    `ModeGraph` or a `ModeRefusal`) when the module is in the mode it serves. It is part of the graph
    (`graph._codegen`), so it survives passes, copies, recompilation and saving."""

    def __init__(self, pytree_info, branch: str):
        super().__init__(pytree_info)
        self.branch = branch

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *, expanded_def: bool = False) -> str:
        names = [v.split(":")[0].split("=")[0].split("#")[0].strip().lstrip("*") for v in free_vars]
        head = super().gen_fn_def(free_vars, maybe_return_annotation, expanded_def=expanded_def)
        call = ", ".join(["self"] + [n for n in names if n != "self"])
        return head + f"\n    if self.{self.branch}.takes(self): return self.{self.branch}({call})"
