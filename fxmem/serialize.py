"""The module.pt pickle of results saved by fxmem's formats 1-2 (before module.json).

`fxmem.load` reads such a result only with `trust_code=True`: unpickling runs code. The reconstructors below are
what those pickles name (`fxmem.serialize._new_graph_module`, ...), so they stay importable here; `dumps` writes the
same pickle (for tests of the legacy path). New results describe their structure as JSON data (`fxmem.structure`).
Graphs are pickled as data (nodes with named targets, resolved again on load by import), and a GraphModule as an
empty instance first, then its state, so that anything inside it that refers back to it unpickles as that one
instance. Design: docs/design/results.md, "The old pickle format".
"""
from __future__ import annotations

import importlib
import io
import pickle
import types
from typing import Any

import torch
from torch import fx
from torch.fx._lazy_graph_module import _get_graph_module_cls
from torch.fx.graph_module import _CodeOnlyModule

from .program import ROOT_HOOK_ATTRS

_META_KEEP = ("nn_module_stack", "stack_trace", "fxmem_mode_flag")
# graph targets that moved to another module: (module, name) saved by earlier versions -> the module now
_MOVED_TARGETS = {("fxmem.nn.recast", "remat"): "fxmem.nn.remat",
                  ("fxmem.nn.recast", "remat_call"): "fxmem.nn.remat"}


def _encode_target(target) -> tuple:
    if isinstance(target, str):
        return ("str", target)
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._opname, target._overloadname)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("hop", target.name())
    mod = getattr(target, "__module__", None)
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if mod is None and getattr(target, "__self__", None) is not None:
        mod = type(target.__self__).__module__
    if mod is None or qual is None:
        raise TypeError(f"cannot save graph target {target!r}")
    if mod == "_operator":
        mod = "operator"
    return ("py", mod, qual)


def _decode_target(encoded: tuple):
    kind = encoded[0]
    if kind == "str":
        return encoded[1]
    if kind == "op":
        _, namespace, name, overload = encoded
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, overload or "default")
    if kind == "hop":
        return getattr(torch.ops.higher_order, encoded[1])
    _, mod, qual = encoded
    obj: Any = importlib.import_module(_MOVED_TARGETS.get((mod, qual), mod))
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _encode_arg(arg):
    if isinstance(arg, fx.Node):
        return ("__node__", arg.name)
    if isinstance(arg, tuple):
        return ("__tuple__", [_encode_arg(x) for x in arg])
    if isinstance(arg, list):
        return [_encode_arg(x) for x in arg]
    if isinstance(arg, dict):
        return {"__dict__": [(k, _encode_arg(v)) for k, v in arg.items()]}
    if isinstance(arg, slice):
        return ("__slice__", _encode_arg(arg.start), _encode_arg(arg.stop), _encode_arg(arg.step))
    if isinstance(arg, (torch._ops.OpOverload, types.FunctionType, types.BuiltinFunctionType)):
        return ("__target__", _encode_target(arg))
    return arg


def _decode_arg(arg, env):
    if isinstance(arg, tuple) and arg and arg[0] == "__node__":
        return env[arg[1]]
    if isinstance(arg, tuple) and arg and arg[0] == "__tuple__":
        return tuple(_decode_arg(x, env) for x in arg[1])
    if isinstance(arg, tuple) and arg and arg[0] == "__slice__":
        return slice(*(_decode_arg(x, env) for x in arg[1:]))
    if isinstance(arg, tuple) and arg and arg[0] == "__target__":
        return _decode_target(arg[1])
    if isinstance(arg, list):
        return [_decode_arg(x, env) for x in arg]
    if isinstance(arg, dict) and "__dict__" in arg:
        return {k: _decode_arg(v, env) for k, v in arg["__dict__"]}
    return arg


def graph_state(graph: fx.Graph) -> dict:
    nodes = []
    for node in graph.nodes:
        nodes.append({"op": node.op, "name": node.name, "target": _encode_target(node.target),
                      "args": _encode_arg(node.args), "kwargs": _encode_arg(node.kwargs),
                      "meta": {k: v for k, v in node.meta.items() if k in _META_KEEP and _picklable(v)}})
    return {"nodes": nodes, "codegen": graph._codegen}


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False


def graph_from_state(state: dict) -> fx.Graph:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for node_state in state["nodes"]:
        args = _decode_arg(node_state["args"], env)
        kwargs = _decode_arg(node_state["kwargs"], env)
        target = _decode_target(node_state["target"])
        node = graph.create_node(node_state["op"], target, tuple(args), dict(kwargs), name=node_state["name"])
        node.meta.update(node_state.get("meta", {}))
        env[node_state["name"]] = node
    graph._codegen = state["codegen"]
    return graph


def _init_from_body(graph_module: fx.GraphModule, body: dict, state: dict, class_name: str) -> fx.GraphModule:
    """Initialise `graph_module` (a new, uninitialised GraphModule) from a pickled `__dict__` and graph state."""
    graph = graph_from_state(state)
    com = _CodeOnlyModule(body)
    type(graph_module).__init__(graph_module, com, graph, class_name=class_name)
    for attr_name, attr_value in body.items():
        if not hasattr(graph_module, attr_name) or attr_name in ROOT_HOOK_ATTRS:
            setattr(graph_module, attr_name, attr_value)
    return graph_module


def _new_graph_module() -> fx.GraphModule:
    """Step one of unpickling a GraphModule: an uninitialised instance (of its own class, as GraphModule makes
    one per instance), memoized by the unpickler before its state is read."""
    cls = _get_graph_module_cls()
    return cls.__new__(cls)


def _fill_graph_module(graph_module: fx.GraphModule, state: tuple) -> None:
    """Step two: the state, read in full (back-references to `graph_module` inside it are `graph_module` itself)."""
    body, graph_st, class_name = state
    _init_from_body(graph_module, body, graph_st, class_name)


def _rebuild_graph_module(body: dict, state: dict, class_name: str):
    """One-step rebuild: what results saved by earlier versions of fxmem refer to (kept so they still load)."""
    return _init_from_body(_new_graph_module(), body, state, class_name)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, fx.GraphModule):
            body = {k: v for k, v in obj.__dict__.items() if k not in ("_graph", "_code", "_lineno_map",
                                                                         "_prologue_start")}
            body.pop("_tracer_cls", None)
            body.pop("_tracer_extras", None)
            # (callable, args, state, listitems, dictitems, state_setter): `obj` is memoized after
            # `_new_graph_module()` and before its state, so references back to it resolve to the same instance
            return (_new_graph_module, (), (body, graph_state(obj.graph), type(obj).__name__), None, None,
                    _fill_graph_module)
        return NotImplemented


pickle_module = types.SimpleNamespace(Pickler=_Pickler, Unpickler=pickle.Unpickler, dump=None, load=pickle.load,
                                      __name__="fxmem.serialize")


def dumps(module: torch.nn.Module) -> bytes:
    buf = io.BytesIO()
    torch.save(module, buf, pickle_module=pickle_module)
    return buf.getvalue()
