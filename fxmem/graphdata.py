"""An fx graph as JSON data, and back with every field checked.

    doc = graph_to_data(gm.graph)         # {"nodes": [...], "pytree": {...} | None}
    graph = graph_from_data(doc)          # GraphDataError naming the node if anything is not allowed

A node is `{"op", "name", "target", "args", "kwargs", "meta"}`. Call targets are qualified names resolved against
`fxmem.targets` (the allow-list); arguments are JSON with tagged values (`{"$node": name}`, `{"$tuple": [...]}`,
`{"$dtype": "float32"}`, ...); meta keeps the module stack, stack trace and mode flag. Names that fx's code
generator writes into the module's source (node names, placeholder and attribute targets, the forward's argument
names and keyword keys, the child a mode dispatch calls) must be plain identifiers, so the generated code is only
ever what fx itself generates for such a graph. The input/output structure (pytree specs) is decoded here too, without `treespec_loads` (which would
import modules named in its data): builtin containers, and output classes of the libraries in
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


def is_identifier(s) -> bool:
    return isinstance(s, str) and s.isidentifier() and not keyword.iskeyword(s)


def is_path(s, allow_empty: bool = False) -> bool:
    """A dotted module/attribute path of plain names (`h.0.attn`)."""
    if s == "" and allow_empty:
        return True
    return isinstance(s, str) and all(_ATOM.match(a) for a in s.split("."))


# ============================================================================================ values

def encode_value(v):
    """A node argument as JSON (ValueError for a type fxmem does not save)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$float": repr(v)}
    if isinstance(v, fx.Node):
        return {"$node": v.name}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if type(v) in (tuple, torch.Size):
        return {"$tuple": [encode_value(x) for x in v]}
    if isinstance(v, dict):
        return {"$dict": [[encode_value(k), encode_value(x)] for k, x in v.items()]}
    if isinstance(v, slice):
        return {"$slice": [encode_value(v.start), encode_value(v.stop), encode_value(v.step)]}
    if v is Ellipsis:
        return {"$ellipsis": None}
    for tag, kind in (("$dtype", torch.dtype), ("$layout", torch.layout), ("$memory_format", torch.memory_format)):
        if isinstance(v, kind):
            return {tag: str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"$device": str(v)}
    try:
        return {"$target": target_name(v)}
    except TargetError:
        raise ValueError(f"an argument of type {type(v).__module__}.{type(v).__qualname__}, which fxmem does not "
                         "save") from None


def decode_value(v, env: dict):
    """The argument `encode_value` wrote; GraphDataError for anything else."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [decode_value(x, env) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise GraphDataError(f"not an argument value: {_short(v)}")
    (tag, x), = v.items()
    if tag == "$node":
        if x not in env:
            raise GraphDataError(f"refers to node {_short(x)}, which is not defined before it")
        return env[x]
    if tag == "$tuple" and isinstance(x, list):
        return tuple(decode_value(e, env) for e in x)
    if tag == "$dict" and isinstance(x, list) and all(isinstance(e, list) and len(e) == 2 for e in x):
        return {_hashable(decode_value(k, env)): decode_value(e, env) for k, e in x}
    if tag == "$slice" and isinstance(x, list) and len(x) == 3:
        return slice(*(decode_value(e, env) for e in x))
    if tag == "$ellipsis" and x is None:
        return Ellipsis
    if tag == "$float" and x in ("inf", "-inf", "nan"):
        return float(x)
    if tag == "$device" and isinstance(x, str) and re.match(r"^[a-z]+(:[0-9]+)?$", x):
        return torch.device(x)
    if tag == "$target":
        return resolve_target(x)
    kinds = {"$dtype": torch.dtype, "$layout": torch.layout, "$memory_format": torch.memory_format}
    if tag in kinds and isinstance(x, str) and x in TORCH_CONSTANTS[kinds[tag]]:
        return TORCH_CONSTANTS[kinds[tag]][x]
    raise GraphDataError(f"not an argument value: {_short(v)}")


def _hashable(k):
    if isinstance(k, (list, dict)):
        raise GraphDataError(f"not a dictionary key: {_short(k)}")
    return k


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


# ============================================================================================ graphs

def graph_to_data(graph: fx.Graph) -> dict:
    """`graph` as JSON data (ValueError naming the node for what cannot be saved)."""
    nodes = []
    for n in graph.nodes:
        try:
            target = target_name(n.target) if n.op == "call_function" else n.target
            nodes.append({"op": n.op, "name": n.name, "target": target,
                          "args": [encode_value(a) for a in n.args],
                          "kwargs": {k: encode_value(a) for k, a in n.kwargs.items()},
                          "meta": _meta_to_data(n.meta)})
        except (TargetError, ValueError) as e:
            raise ValueError(f"node {n.name}: {e}") from None
    return {"nodes": nodes, "pytree": _codegen_to_data(graph._codegen)}


def graph_from_data(data) -> fx.Graph:
    """The graph `graph_to_data` described, every node checked (GraphDataError names the node)."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise GraphDataError("a graph needs a list of nodes")
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for i, d in enumerate(data["nodes"]):
        name = d.get("name") if isinstance(d, dict) else None
        try:
            node = _node_from_data(g, d, env)
        except (GraphDataError, TargetError) as e:
            raise GraphDataError(f"node {name if is_identifier(name) else '#' + str(i)}: {e}") from None
        env[node.name] = node
    g._codegen = _codegen_from_data(data.get("pytree"))
    try:
        g.lint()
    except Exception as e:  # noqa: BLE001  (fx's own consistency check, whatever it raises)
        raise GraphDataError(f"not a valid graph: {e}") from None
    return g


def _node_from_data(g: fx.Graph, d, env: dict) -> fx.Node:
    if not isinstance(d, dict) or set(d) - {"op", "name", "target", "args", "kwargs", "meta"}:
        raise GraphDataError("a node is an object with op, name, target, args, kwargs and meta")
    op, name, target = d.get("op"), d.get("name"), d.get("target")
    if op not in OPS:
        raise GraphDataError(f"unknown op {_short(op)}")
    if not is_identifier(name) or name in env:
        raise GraphDataError(f"the name {_short(name)} is not a new identifier")
    if not isinstance(d.get("args"), list) or not isinstance(d.get("kwargs"), dict):
        raise GraphDataError("args must be a list and kwargs an object")
    args = tuple(decode_value(a, env) for a in d["args"])
    kwargs = {}
    for k, a in d["kwargs"].items():
        if not is_identifier(k):
            raise GraphDataError(f"keyword {_short(k)} is not an identifier")
        kwargs[k] = decode_value(a, env)
    target = _target_from_data(op, target, args, kwargs)
    node = g.create_node(op, target, args, kwargs, name=name)
    if node.name != name:
        raise GraphDataError(f"the name {name} is reserved")
    node.meta.update(_meta_from_data(d.get("meta", {})))
    return node


def _target_from_data(op: str, target, args: tuple, kwargs: dict):
    if op == "call_function":
        fn = resolve_target(target)
        check_op_name_args(fn, args, kwargs)
        if fn is getattr:
            check_attribute_name("getattr", args[1] if len(args) == 2 else None)
        return fn
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


def _meta_from_data(d) -> dict:
    if not isinstance(d, dict) or set(d) - set(META_KEEP):
        raise GraphDataError(f"meta may hold only {', '.join(META_KEEP)}")
    out: dict = {}
    if "nn_module_stack" in d:
        rows = d["nn_module_stack"]
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 3 and
                                                 all(isinstance(x, str) for x in r) for r in rows):
            raise GraphDataError("meta nn_module_stack must be a list of [key, path, type name]")
        out["nn_module_stack"] = {k: (path, ty) for k, path, ty in rows}
    if "stack_trace" in d:
        if not isinstance(d["stack_trace"], str):
            raise GraphDataError("meta stack_trace must be a string")
        out["stack_trace"] = d["stack_trace"]
    if "fxmem_mode_flag" in d:
        if not isinstance(d["fxmem_mode_flag"], bool):
            raise GraphDataError("meta fxmem_mode_flag must be true or false")
        out["fxmem_mode_flag"] = d["fxmem_mode_flag"]
    return out


# ============================================================================================ input/output structure

def _codegen_to_data(codegen) -> dict | None:
    if type(codegen) is CodeGen:
        return None
    if type(codegen) not in (_PyTreeCodeGen, ModeDispatchCodeGen):
        raise ValueError(f"the graph's code generator is a {type(codegen).__qualname__}, which fxmem does not save")
    info = codegen.pytree_info
    d = {"orig_args": list(info.orig_args), "in_spec": spec_to_data(info.in_spec),
         "out_spec": None if info.out_spec is None else spec_to_data(info.out_spec)}
    if type(codegen) is ModeDispatchCodeGen:
        d["dispatch"] = codegen.branch  # the child serving the other mode (`fxmem.nn.modes`)
    return d


def _codegen_from_data(d):
    if d is None:
        return CodeGen()
    if not isinstance(d, dict) or not {"orig_args", "in_spec", "out_spec"} <= set(d) <= {"orig_args", "in_spec",
                                                                                        "out_spec", "dispatch"}:
        raise GraphDataError("pytree must hold orig_args, in_spec and out_spec (and dispatch)")
    branch = d.get("dispatch")
    if "dispatch" in d and not (is_identifier(branch) and is_path(branch)):
        raise GraphDataError(f"dispatch {_short(branch)} is not a submodule name")
    orig = d["orig_args"]
    if not isinstance(orig, list) or not all(is_identifier(a) for a in orig):
        raise GraphDataError("the forward's argument names (orig_args) must be identifiers")
    in_spec = spec_from_data(d["in_spec"])
    # keyword inputs: generated code writes their keys as literals
    if in_spec.type is tuple and in_spec.num_children == 2 and in_spec.child(1).type is dict:
        if not all(is_identifier(k) for k in in_spec.child(1).context):
            raise GraphDataError("keyword input names must be identifiers")
    out_spec = None if d["out_spec"] is None else spec_from_data(d["out_spec"])
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


def spec_from_data(d) -> pytree.TreeSpec:
    if not isinstance(d, dict) or set(d) != {"type", "context", "children"} or not isinstance(d["children"], list):
        raise GraphDataError("a pytree spec is an object with type, context and children")
    if d["type"] is None:
        if d["context"] is not None or d["children"]:
            raise GraphDataError("a pytree leaf has no context or children")
        return pytree.treespec_leaf()
    typ = _pytree_type(d["type"])
    ctx, children = d["context"], [spec_from_data(c) for c in d["children"]]
    if typ in (tuple, list):
        if ctx is not None:
            raise GraphDataError(f"a {d['type']} spec has no context")
    elif not (isinstance(ctx, list) and len(ctx) == len(children) and
              all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in ctx)):
        raise GraphDataError(f"a {d['type']} spec needs one key (string or integer) per child")
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
        except ImportError as e:
            raise GraphDataError(f"the model's output type {name} needs {module}, which cannot be imported "
                                 f"({e})") from None
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
