"""The Program: what capture produces and every pass reads and rewrites.

A Program holds the trainable GraphModule (aten-level graph, original parameter names), the example inputs, the
input structure, and per-node metadata. `refresh()` re-validates the graph and recomputes each node's concrete
shape/dtype/requires-grad at the example inputs (`node.meta["fxmem_val"]`, a FakeTensor), which the cost model
reads. Passes must not mutate existing parameters in place (they create new ones): `snapshot()` shares modules.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from .fake import (meta_as_device, module_tensors, sizing_device, static_sizes_if_needed,
                   with_data_dependent_fallback)
from .kernel_layouts import CpuKernelLayouts
from .nn.remat import op_call


@dataclass(frozen=True)
class SpecializedDim:
    input: str
    dim: int
    size: int

    def __str__(self):
        return f"{self.input} dim {self.dim} = {self.size}"



def deep_copy(obj):
    """copy.deepcopy of a graph or graph module, without torch's warning about it: copying a graph's pytree specs
    makes new LeafSpecs, which torch 2.13's pytree reports as a deprecated isinstance check (a FutureWarning per
    copy, raised inside torch, nothing for the caller to act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated", category=FutureWarning)
        return copy.deepcopy(obj)


@dataclass
class Program:
    module: fx.GraphModule
    example_args: tuple
    example_kwargs: dict
    mode: str = "train"
    input_names: list[str] = field(default_factory=list)
    input_specs: list = field(default_factory=list)
    specialized: list[SpecializedDim] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    model_name: str = "Model"

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph

    # ----------------------------------------------------------------------------------------------- inputs
    def flat_inputs(self, args=None, kwargs=None) -> list:
        args = self.example_args if args is None else args
        kwargs = self.example_kwargs if kwargs is None else kwargs
        flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
        return flat

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ----------------------------------------------------------------------------------------------- graph upkeep
    def refresh(self, *, dce: bool = True) -> None:
        """lint, dead-code elimination, recompile, and concrete metadata at the example inputs."""
        graph = self.module.graph
        if dce:
            graph.eliminate_dead_code(is_impure_node=is_impure)
        graph.lint()
        self.module.recompile()
        with_data_dependent_fallback(lambda: static_sizes_if_needed(
            lambda static: propagate_meta(self.module, self.flat_inputs(), self.mode, static)))

    def snapshot(self) -> "Program":
        """A copy for rollback: a new graph and GraphModule; submodules and parameters are shared."""
        graph_module = self.module
        new_graph = deep_copy(graph_module.graph)
        new_module = fx.GraphModule(graph_module, new_graph, class_name=type(graph_module).__name__)
        for attr in ("_in_spec", "_out_spec"):
            if hasattr(graph_module, attr):
                setattr(new_module, attr, getattr(graph_module, attr))
        # the same module tree (GraphModule() copies only what the graph references, which would drop unused
        # or tied parameters and the original module types)
        new_module._modules = dict(graph_module._modules)
        new_module._parameters = dict(graph_module._parameters)
        new_module._buffers = dict(graph_module._buffers)
        new_module._non_persistent_buffers_set = set(graph_module._non_persistent_buffers_set)
        keep_persistence_when_copied(new_module)
        # module hooks a pass installed on the root (e.g. fxmem.nn.recast's scope) belong to the program
        for attr in ROOT_HOOK_ATTRS:
            if hasattr(graph_module, attr):
                setattr(new_module, attr, copy.copy(getattr(graph_module, attr)))
        new_module.train(graph_module.training)
        return Program(module=new_module, example_args=self.example_args, example_kwargs=self.example_kwargs,
                       mode=self.mode, input_names=list(self.input_names), input_specs=list(self.input_specs),
                       specialized=list(self.specialized), notes=list(self.notes), model_name=self.model_name)

    def code(self) -> str:
        return self.module.code


# hooks on the root module that GraphModule(...) does not carry over to a module rebuilt from a graph
ROOT_HOOK_ATTRS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_deepcopy_hooks")


def is_impure(node: fx.Node) -> bool:
    """Whether dead-code elimination must keep `node`: inputs and outputs, module calls, in-place ops, assertions."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "call_module":
        return True  # guards, checkpoint regions, stateful modules: keep
    if node.op == "call_function":
        target = node.target
        op = op_call(target, node.args)[0]  # (remat_call of an in-place op writes its input too)
        if getattr(op, "_schema", None) is not None and op._schema.is_mutable:
            return True
        if target is torch.ops.aten._assert_tensor_metadata.default:
            return True
        name = getattr(target, "__name__", "")
        if name in ("count_batch",) or name.startswith("_assert"):
            return True
    return node.is_impure() if hasattr(node, "is_impure") else False


# --------------------------------------------------------------------------------------------- metadata

def module_path(node: fx.Node) -> str:
    """The innermost module path of a node ('' for the root), from `nn_module_stack`."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return node.meta.get("fxmem_module_path", "")
    path = list(stack.values())[-1][0]
    return _clean_path(path)


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """[(path, type name), ...] outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, module_type in stack.values():
        tname = module_type if isinstance(module_type, str) else getattr(module_type, "__qualname__", str(module_type))
        out.append((_clean_path(path), tname.rsplit(".", 1)[-1]))
    return [entry for entry in out if entry[0] != ""] or out


def _clean_path(path: str) -> str:
    # export writes "L['self'].transformer.h[0]" in some versions and "transformer.h.0" in others
    clean = path.replace("L['self']", "").replace("L__self__", "")
    clean = clean.replace("[", ".").replace("]", "").replace("'", "")
    clean = clean.replace("._modules.", ".")
    while ".." in clean:
        clean = clean.replace("..", ".")
    return clean.strip(".")


def propagate_meta(graph_module: fx.GraphModule, flat_inputs: list, mode: str, static_inputs: bool = False) -> None:
    """Run the graph under FakeTensorMode at the example inputs; store concrete outputs in meta["fxmem_val"].

    Parameters keep their requires_grad, so meta says which values need grad (train mode). No real memory.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    on_device = meta_as_device(fake_mode, module_tensors(graph_module) + list(flat_inputs), sizing_device(flat_inputs))
    with fake_mode:
        fake_inputs = [fake_mode.from_tensor(x, static_shapes=static_inputs) if isinstance(x, torch.Tensor) else x
                       for x in flat_inputs]

    class _Prop(fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            node.meta["fxmem_val"] = out
            return out

    grad_ctx = torch.enable_grad() if mode == "train" else torch.no_grad()
    was_training = graph_module.training
    graph_module.train(mode == "train")
    try:
        with buffers_kept(graph_module), fake_mode, CpuKernelLayouts(), grad_ctx:
            _Prop(graph_module).run(*fake_inputs, enable_io_processing=False)
    finally:
        graph_module.train(was_training)
    del on_device  # (a model built on the meta device: its fakes on the inputs' device, held through the run)


def copy_buffer_persistence(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Buffers that are non-persistent in `source` (registered with persistent=False, or a graph's constants) are
    non-persistent in `target` at the same paths: GraphModule registers every tensor it copies as a persistent
    buffer, which would add keys to `state_dict()`."""
    for path, mod in source.named_modules():
        names = getattr(mod, "_non_persistent_buffers_set", None)
        if not names:
            continue
        try:
            owner = target.get_submodule(path) if path else target
        except AttributeError:
            continue
        for name in names:
            if name in owner._buffers:
                owner._non_persistent_buffers_set.add(name)


# GraphModule.__deepcopy__ rebuilds a module's own buffers as persistent ones; it sets again the attributes named
# under this key of the module's `meta` (torch.fx.graph_module._USER_PRESERVED_ATTRIBUTES_KEY)
_PRESERVED_ON_COPY = "_user_preserved_attributes"


def keep_persistence_when_copied(module: torch.nn.Module) -> None:
    """`copy.deepcopy` of every GraphModule in `module` keeps which of its buffers are non-persistent (so a copy's
    `state_dict()` has the keys the module's has): each one's `meta` names its own set of non-persistent buffers,
    which deepcopy copies and sets on the copy. Call again after replacing a module's set."""
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule):
            sub.meta.setdefault(_PRESERVED_ON_COPY, {})["_non_persistent_buffers_set"] = \
                sub._non_persistent_buffers_set


def tensor_bytes(value) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    return int(value.numel()) * value.element_size()


def tree_tensor_bytes(tree) -> int:
    return sum(tensor_bytes(x) for x in pytree.tree_leaves(tree))


def call_signature_repr(program: Program) -> str:
    return ", ".join(program.input_names)


def as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


@contextlib.contextmanager
def buffers_kept(*modules: torch.nn.Module):
    """Running a module changes buffers (batch-norm statistics, step counters, EMAs), and so does tracing it under
    FakeTensorMode (an in-place op whose inputs are all real tensors, `steps += 1`, runs for real there): their
    values are put back afterwards (each buffer once, however many of `modules` share it; all of them: a kernel
    that updates running statistics does not bump the version counter)."""
    saved, seen = [], set()
    for module in modules:
        for buffer in module.buffers():
            if id(buffer) not in seen:
                seen.add(id(buffer))
                saved.append((buffer, buffer.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved_value in saved:
                buffer.copy_(saved_value)
