"""One graph per mode, for models whose python reads `self.training`.

`attach_mode_graph` makes a second capture (the mode the program's main graph does not serve) a
`fxmem.nn.modes.ModeGraph` child of the program's module, and gives the main graph the code generator that
dispatches to it (`ModeDispatchCodeGen`); `attach_mode_refusal` makes that mode raise instead, where it cannot be
served faithfully. The second graph's reads of the model's parameters and buffers become
inputs, fed from the root module at each call, so both graphs always run on the same tensors.
"""
from __future__ import annotations

from torch import fx, nn
from torch.fx.graph import CodeGen, _PyTreeCodeGen

from .errors import CaptureError
from .nn.modes import ModeDispatchCodeGen, ModeGraph, ModeRefusal, tensor_at
from .program import Program, copy_buffer_persistence



def attach_mode_graph(program: Program, other: Program, state_names: set[str]) -> str:
    """Serve `other.mode` with `other`'s graph: `program.module` runs it whenever its `training` flag is that mode's.
    `state_names`: the model's parameter and buffer names (other attributes the graph reads stay its own). Returns
    the name of the child that holds it."""
    root, graph_module = program.module, other.module
    _require_pytree_code(program, graph_module)
    if graph_module._in_spec != root._in_spec:
        raise CaptureError(f"cannot switch {program.model_name} between its train and eval graphs: the two "
                           "captures take their inputs in different structures")
    training = other.mode == "train"
    paths = _inputs_from_root(graph_module, root, state_names)
    graph_module.graph._codegen = CodeGen()  # flat inputs, flat outputs: ModeGraph restores the structure
    flat = fx.GraphModule(graph_module, graph_module.graph,
                          class_name=f"{program.model_name}{'Train' if training else 'Eval'}")
    copy_buffer_persistence(graph_module, flat)
    return _dispatch_to(program, ModeGraph(flat, training, paths, graph_module._out_spec))


def attach_mode_refusal(program: Program, training: bool, reason: str) -> str:
    """Make a call of `program.module` in the given mode raise a CaptureError saying `reason` (a mode that cannot be
    served faithfully). Returns the name of the child that refuses."""
    _require_pytree_code(program)
    return _dispatch_to(program, ModeRefusal(training, reason))


def _require_pytree_code(program: Program, *others: fx.GraphModule) -> None:
    for graph_module in (program.module, *others):
        if type(graph_module.graph._codegen) is not _PyTreeCodeGen:
            raise CaptureError(f"cannot switch {program.model_name} between its train and eval graphs: torch.export "
                               f"generated {type(graph_module.graph._codegen).__name__} code, "
                               "which fxmem does not know")


def _dispatch_to(program: Program, child: ModeGraph | ModeRefusal) -> str:
    """Add `child` to the program's module and start its forward with the switch to it."""
    root = program.module
    word = "train" if child.serves_training else "eval"
    name = f"{word}_graph" if isinstance(child, ModeGraph) else f"no_{word}_mode"
    root.add_submodule(name, child)
    root.graph._codegen = ModeDispatchCodeGen(root.graph._codegen.pytree_info, name)
    root.recompile()
    return name


def _inputs_from_root(graph_module: fx.GraphModule, root: nn.Module, state_names: set[str]) -> list[str]:
    """Turn `graph_module`'s reads of the model's tensors (get_attr of a name in `state_names`) into leading
    placeholders; return their names in order. A tensor only this graph reads is added to `root` under its name."""
    graph = graph_module.graph
    first_input = next((n for n in graph.nodes if n.op == "placeholder"), None)
    placeholders: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target not in state_names:
            continue
        path = node.target
        if path not in placeholders:
            _ensure_on_root(root, graph_module, path)
            ctx = graph.inserting_before(first_input) if first_input is not None else graph.inserting_before(None)
            with ctx:
                placeholders[path] = graph.placeholder("root_" + path.replace(".", "_"))
        node.replace_all_uses_with(placeholders[path])
        graph.erase_node(node)
    graph.lint()
    return list(placeholders)


def _ensure_on_root(root: nn.Module, graph_module: fx.GraphModule, path: str) -> None:
    """`root` gets `graph_module`'s tensor at `path` (the same tensor object) unless it has one there already."""
    try:
        tensor_at(root, path)
        return
    except AttributeError:
        pass
    owner_path, _, leaf = path.rpartition(".")
    source_owner = graph_module.get_submodule(owner_path) if owner_path else graph_module
    owner = root
    for part in owner_path.split(".") if owner_path else []:
        if part not in owner._modules:
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]
    tensor = getattr(source_owner, leaf)
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=leaf not in source_owner._non_persistent_buffers_set)
