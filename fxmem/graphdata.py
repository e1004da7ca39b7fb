"""An fx graph as JSON data, and back with every field checked.

    doc = graph_to_data(gm.graph)         # {"nodes": [...], "pytree": {...} | None}
    graph = graph_from_data(doc)          # GraphDataError naming the node if anything is not allowed

A node is `{"op", "name", "target", "args", "kwargs", "meta"}`. Call targets are qualified names resolved against
`fxmem.targets` (the allow-list); arguments are JSON with tagged values (`{"$node": name}`, `{"$tuple": [...]}`,
`{"$dtype": "float32"}`, ...); meta keeps the module stack, stack trace and mode flag. Names that fx's code generator
writes into the module's source (node names, placeholder and attribute targets, the forward's argument names and keyword
keys, the child a mode dispatch calls) must be plain identifiers, so the generated code is only ever what fx itself
generates for such a graph. The input/output structure (pytree specs) is decoded here too, without `treespec_loads`
(which would import modules named in its data): builtin containers, and output classes of the libraries in
`PYTREE_LIBRARIES` that register themselves with torch's pytree (Hugging Face `ModelOutput`s).
"""
from __future__ import annotations

import importlib
import keyword
import math
import re
from collections import OrderedDict

import torch
from torch import fx
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from .nn.modes import ModeDispatchCodeGen
from .targets import TargetError, check_attribute_name, check_op_name_args, resolve_target, target_name

OPS = ("placeholder", "get_attr", "call_function", "call_module", "call_method", "output")
META_KEEP = ("nn_module_stack", "stack_trace", "fxmem_mode_flag")
PYTREE_LIBRARIES = ("transformers",)
_BUILTIN_CONTAINERS = {"builtins.tuple": tuple, "builtins.list": list, "builtins.dict": dict,
                       "collections.OrderedDict": OrderedDict}
# torch's dtypes, layouts and memory formats by name (looked up here, never by attribute on the torch module)
TORCH_CONSTANTS = {kind: {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, kind)}
                   for kind in (torch.dtype, torch.layout, torch.memory_format)}
DTYPES = TORCH_CONSTANTS[torch.dtype]
_ATOM = re.compile(r"^(?!__)[A-Za-z0-9_]+$")  # a module/attribute name; not a dunder (`__class__`)


class GraphDataError(ValueError):
    """Graph data that does not describe an allowed graph (the message names the node)."""


def is_identifier(text) -> bool:
    return isinstance(text, str) and text.isidentifier() and not keyword.iskeyword(text)


def is_path(text, allow_empty: bool = False) -> bool:
    """A dotted module/attribute path of plain names (`h.0.attn`)."""
    if text == "" and allow_empty:
        return True
    return isinstance(text, str) and all(_ATOM.match(a) for a in text.split("."))


# ============================================================================================ values

def encode_value(value):
    """A node argument as JSON (ValueError for a type fxmem does not save)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, fx.Node):
        return {"$node": value.name}
    if isinstance(value, list):
        return [encode_value(x) for x in value]
    if type(value) in (tuple, torch.Size):
        return {"$tuple": [encode_value(x) for x in value]}
    if isinstance(value, dict):
        return {"$dict": [[encode_value(k), encode_value(x)] for k, x in value.items()]}
    if isinstance(value, slice):
        return {"$slice": [encode_value(value.start), encode_value(value.stop), encode_value(value.step)]}
    if value is Ellipsis:
        return {"$ellipsis": None}
    for tag, kind in (("$dtype", torch.dtype), ("$layout", torch.layout), ("$memory_format", torch.memory_format)):
        if isinstance(value, kind):
            return {tag: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    try:
        return {"$target": target_name(value)}
    except TargetError:
        raise ValueError(f"an argument of type {type(value).__module__}.{type(value).__qualname__}, which fxmem "
                         "does not save") from None


def decode_value(value, env: dict):
    """The argument `encode_value` wrote; GraphDataError for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode_value(payload, env) for payload in value]
    if not isinstance(value, dict) or len(value) != 1:
        raise GraphDataError(f"not an argument value: {_short(value)}")
    (tag, payload), = value.items()
    if tag == "$node":
        if payload not in env:
            raise GraphDataError(f"refers to node {_short(payload)}, which is not defined before it")
        return env[payload]
    if tag == "$tuple" and isinstance(payload, list):
        return tuple(decode_value(e, env) for e in payload)
    if tag == "$dict" and isinstance(payload, list) and all(isinstance(e, list) and len(e) == 2 for e in payload):
        return {_hashable(decode_value(k, env)): decode_value(e, env) for k, e in payload}
    if tag == "$slice" and isinstance(payload, list) and len(payload) == 3:
        return slice(*(decode_value(e, env) for e in payload))
    if tag == "$ellipsis" and payload is None:
        return Ellipsis
    if tag == "$float" and payload in ("inf", "-inf", "nan"):
        return float(payload)
    if tag == "$device" and isinstance(payload, str) and re.match(r"^[a-z]+(:[0-9]+)?$", payload):
        return torch.device(payload)
    if tag == "$target":
        return resolve_target(payload)
    kinds = {"$dtype": torch.dtype, "$layout": torch.layout, "$memory_format": torch.memory_format}
    if tag in kinds and isinstance(payload, str) and payload in TORCH_CONSTANTS[kinds[tag]]:
        return TORCH_CONSTANTS[kinds[tag]][payload]
    raise GraphDataError(f"not an argument value: {_short(value)}")


def _hashable(key):
    if isinstance(key, (list, dict)):
        raise GraphDataError(f"not a dictionary key: {_short(key)}")
    return key


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ============================================================================================ graphs

def graph_to_data(graph: fx.Graph) -> dict:
    """`graph` as JSON data (ValueError naming the node for what cannot be saved)."""
    nodes = []
    for node in graph.nodes:
        try:
            target = target_name(node.target) if node.op == "call_function" else node.target
            nodes.append({"op": node.op, "name": node.name, "target": target,
                          "args": [encode_value(a) for a in node.args],
                          "kwargs": {k: encode_value(a) for k, a in node.kwargs.items()},
                          "meta": _meta_to_data(node.meta)})
        except (TargetError, ValueError) as error:
            raise ValueError(f"node {node.name}: {error}") from None
    return {"nodes": nodes, "pytree": _codegen_to_data(graph._codegen)}


def graph_from_data(data) -> fx.Graph:
    """The graph `graph_to_data` described, every node checked (GraphDataError names the node)."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise GraphDataError("a graph needs a list of nodes")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for position, entry in enumerate(data["nodes"]):
        name = entry.get("name") if isinstance(entry, dict) else None
        try:
            node = _node_from_data(graph, entry, env)
        except (GraphDataError, TargetError) as error:
            raise GraphDataError(f"node {name if is_identifier(name) else '#' + str(position)}: {error}") from None
        env[node.name] = node
    graph._codegen = _codegen_from_data(data.get("pytree"))
    try:
        graph.lint()
    except Exception as error:  # noqa: BLE001  (fx's own consistency check, whatever it raises)
        raise GraphDataError(f"not a valid graph: {error}") from None
    return graph


def _node_from_data(graph: fx.Graph, entry, env: dict) -> fx.Node:
    if not isinstance(entry, dict) or set(entry) - {"op", "name", "target", "args", "kwargs", "meta"}:
        raise GraphDataError("a node is an object with op, name, target, args, kwargs and meta")
    op, name, target = entry.get("op"), entry.get("name"), entry.get("target")
    if op not in OPS:
        raise GraphDataError(f"unknown op {_short(op)}")
    if not is_identifier(name) or name in env:
        raise GraphDataError(f"the name {_short(name)} is not a new identifier")
    if not isinstance(entry.get("args"), list) or not isinstance(entry.get("kwargs"), dict):
        raise GraphDataError("args must be a list and kwargs an object")
    args = tuple(decode_value(arg, env) for arg in entry["args"])
    kwargs = {}
    for key, arg in entry["kwargs"].items():
        if not is_identifier(key):
            raise GraphDataError(f"keyword {_short(key)} is not an identifier")
        kwargs[key] = decode_value(arg, env)
    target = _target_from_data(op, target, args, kwargs)
    node = graph.create_node(op, target, args, kwargs, name=name)
    if node.name != name:
        raise GraphDataError(f"the name {name} is reserved")
    node.meta.update(_meta_from_data(entry.get("meta", {})))
    return node


def _target_from_data(op: str, target, args: tuple, kwargs: dict):
    if op == "call_function":
        function = resolve_target(target)
        check_op_name_args(function, args, kwargs)
        if function is getattr:
            check_attribute_name("getattr", args[1] if len(args) == 2 else None)
        return function
    if op == "call_method":
        check_attribute_name("call_method", target)
    elif op == "placeholder":
        name = target.lstrip("*") if isinstance(target, str) else None
        if not (is_identifier(name) and len(target) - len(name) <= 2):
            raise GraphDataError(f"placeholder target {_short(target)} is not an identifier")
    elif op == "output":
        if target != "output":
            raise GraphDataError("an output node's target is 'output'")
    elif not is_path(target):
        raise GraphDataError(f"{op} target {_short(target)} is not a module/attribute path")
    return target


# ============================================================================================ meta

def _meta_to_data(meta: dict) -> dict:
    out: dict = {}
    stack = meta.get("nn_module_stack")
    if isinstance(stack, dict):
        out["nn_module_stack"] = [[str(k), str(path), ty if isinstance(ty, str) else
                                   f"{getattr(ty, '__module__', '')}.{getattr(ty, '__qualname__', ty)}"]
                                  for k, (path, ty) in stack.items()]
    if isinstance(meta.get("stack_trace"), str):
        out["stack_trace"] = meta["stack_trace"]
    if isinstance(meta.get("fxmem_mode_flag"), bool):
        out["fxmem_mode_flag"] = meta["fxmem_mode_flag"]
    return out


def _meta_from_data(data) -> dict:
    if not isinstance(data, dict) or set(data) - set(META_KEEP):
        raise GraphDataError(f"meta may hold only {', '.join(META_KEEP)}")
    out: dict = {}
    if "nn_module_stack" in data:
        rows = data["nn_module_stack"]
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 3 and
                                                 all(isinstance(x, str) for x in r) for r in rows):
            raise GraphDataError("meta nn_module_stack must be a list of [key, path, type name]")
        out["nn_module_stack"] = {k: (path, ty) for k, path, ty in rows}
    if "stack_trace" in data:
        if not isinstance(data["stack_trace"], str):
            raise GraphDataError("meta stack_trace must be a string")
        out["stack_trace"] = data["stack_trace"]
    if "fxmem_mode_flag" in data:
        if not isinstance(data["fxmem_mode_flag"], bool):
            raise GraphDataError("meta fxmem_mode_flag must be true or false")
        out["fxmem_mode_flag"] = data["fxmem_mode_flag"]
    return out


# ============================================================================================ input/output structure

def _codegen_to_data(codegen) -> dict | None:
    if type(codegen) is CodeGen:
        return None
    if type(codegen) not in (_PyTreeCodeGen, ModeDispatchCodeGen):
        raise ValueError(f"the graph's code generator is a {type(codegen).__qualname__}, which fxmem does not save")
    info = codegen.pytree_info
    data = {"orig_args": list(info.orig_args), "in_spec": spec_to_data(info.in_spec),
         "out_spec": None if info.out_spec is None else spec_to_data(info.out_spec)}
    if type(codegen) is ModeDispatchCodeGen:
        data["dispatch"] = codegen.branch  # the child serving the other mode (`fxmem.nn.modes`)
    return data


def _codegen_from_data(data):
    if data is None:
        return CodeGen()
    if not isinstance(data, dict) or not {"orig_args", "in_spec", "out_spec"} <= set(data) <= {"orig_args", "in_spec",
                                                                                        "out_spec", "dispatch"}:
        raise GraphDataError("pytree must hold orig_args, in_spec and out_spec (and dispatch)")
    branch = data.get("dispatch")
    if "dispatch" in data and not (is_identifier(branch) and is_path(branch)):
        raise GraphDataError(f"dispatch {_short(branch)} is not a submodule name")
    orig = data["orig_args"]
    if not isinstance(orig, list) or not all(is_identifier(a) for a in orig):
        raise GraphDataError("the forward's argument names (orig_args) must be identifiers")
    in_spec = spec_from_data(data["in_spec"])
    # keyword inputs: generated code writes their keys as literals
    if in_spec.type is tuple and in_spec.num_children == 2 and in_spec.child(1).type is dict:
        if not all(is_identifier(k) for k in in_spec.child(1).context):
            raise GraphDataError("keyword input names must be identifiers")
    out_spec = None if data["out_spec"] is None else spec_from_data(data["out_spec"])
    info = _PyTreeInfo(orig, in_spec, out_spec)
    return _PyTreeCodeGen(info) if branch is None else ModeDispatchCodeGen(info, branch)


def spec_to_data(spec: pytree.TreeSpec) -> dict:
    """A pytree spec as JSON: {"type": name or None (a leaf), "context": keys or None, "children": [...]}."""
    if spec.is_leaf():
        return {"type": None, "context": None, "children": []}
    typ = spec.type
    name = next((n for n, t in _BUILTIN_CONTAINERS.items() if t is typ), None)
    if name is None:
        entry = pytree.SUPPORTED_SERIALIZED_TYPES.get(typ)
        name = getattr(entry, "serialized_type_name", None)
        if not isinstance(name, str) or name.split(".")[0] not in PYTREE_LIBRARIES:
            raise ValueError(f"the model's inputs or outputs contain a {typ.__module__}.{typ.__qualname__}, which "
                             "fxmem does not save (tuples, lists, dicts and Hugging Face model outputs are saved)")
    context = spec.context
    if context is not None:
        context = list(context)
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in context):
            raise ValueError(f"a {name} in the model's inputs or outputs has keys fxmem does not save")
    return {"type": name, "context": context, "children": [spec_to_data(c) for c in spec.children()]}


def spec_from_data(data) -> pytree.TreeSpec:
    if (not isinstance(data, dict) or set(data) != {"type", "context", "children"}
            or not isinstance(data["children"], list)):
        raise GraphDataError("a pytree spec is an object with type, context and children")
    if data["type"] is None:
        if data["context"] is not None or data["children"]:
            raise GraphDataError("a pytree leaf has no context or children")
        return pytree.treespec_leaf()
    typ = _pytree_type(data["type"])
    ctx, children = data["context"], [spec_from_data(c) for c in data["children"]]
    if typ in (tuple, list):
        if ctx is not None:
            raise GraphDataError(f"a {data['type']} spec has no context")
    elif not (isinstance(ctx, list) and len(ctx) == len(children) and
              all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in ctx)):
        raise GraphDataError(f"a {data['type']} spec needs one key (string or integer) per child")
    return pytree.TreeSpec(typ, ctx, children)


def _pytree_type(name) -> type:
    """A container type named in a spec: a builtin one, or a registered output class of an allowed library (its
    module is imported if it is not yet: registration happens at import)."""
    if name in _BUILTIN_CONTAINERS:
        return _BUILTIN_CONTAINERS[name]
    if not (is_path(name) and name.split(".")[0] in PYTREE_LIBRARIES and all(is_identifier(a)
                                                                             for a in name.split("."))):
        raise GraphDataError(f"the pytree type {_short(name)} is not one fxmem loads")
    typ = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
    if typ is None:
        module = name.rpartition(".")[0]
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise GraphDataError(f"the model's output type {name} needs {module}, which cannot be imported "
                                 f"({error})") from None
        typ = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
    if typ is None or not _is_model_output(typ):
        raise GraphDataError(f"the pytree type {name} is not a registered model output class")
    return typ


def _is_model_output(typ) -> bool:
    try:
        from transformers.utils import ModelOutput
    except ImportError:
        return False
    return isinstance(typ, type) and issubclass(typ, ModelOutput)
