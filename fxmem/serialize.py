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


def _encode_target(t) -> tuple:
    if isinstance(t, str):
        return ("str", t)
    if isinstance(t, torch._ops.OpOverload):
        return ("op", t.namespace, t._opname, t._overloadname)
    if isinstance(t, torch._ops.HigherOrderOperator):
        return ("hop", t.name())
    mod = getattr(t, "__module__", None)
    qual = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    if mod is None and getattr(t, "__self__", None) is not None:
        mod = type(t.__self__).__module__
    if mod is None or qual is None:
        raise TypeError(f"cannot save graph target {t!r}")
    if mod == "_operator":
        mod = "operator"
    return ("py", mod, qual)


def _decode_target(e: tuple):
    kind = e[0]
    if kind == "str":
        return e[1]
    if kind == "op":
        _, ns, name, overload = e
        packet = getattr(getattr(torch.ops, ns), name)
        return getattr(packet, overload or "default")
    if kind == "hop":
        return getattr(torch.ops.higher_order, e[1])
    _, mod, qual = e
    obj: Any = importlib.import_module(_MOVED_TARGETS.get((mod, qual), mod))
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _encode_arg(a):
    if isinstance(a, fx.Node):
        return ("__node__", a.name)
    if isinstance(a, tuple):
        return ("__tuple__", [_encode_arg(x) for x in a])
    if isinstance(a, list):
        return [_encode_arg(x) for x in a]
    if isinstance(a, dict):
        return {"__dict__": [(k, _encode_arg(v)) for k, v in a.items()]}
    if isinstance(a, slice):
        return ("__slice__", _encode_arg(a.start), _encode_arg(a.stop), _encode_arg(a.step))
    if isinstance(a, (torch._ops.OpOverload, types.FunctionType, types.BuiltinFunctionType)):
        return ("__target__", _encode_target(a))
    return a


def _decode_arg(a, env):
    if isinstance(a, tuple) and a and a[0] == "__node__":
        return env[a[1]]
    if isinstance(a, tuple) and a and a[0] == "__tuple__":
        return tuple(_decode_arg(x, env) for x in a[1])
    if isinstance(a, tuple) and a and a[0] == "__slice__":
        return slice(*(_decode_arg(x, env) for x in a[1:]))
    if isinstance(a, tuple) and a and a[0] == "__target__":
        return _decode_target(a[1])
    if isinstance(a, list):
        return [_decode_arg(x, env) for x in a]
    if isinstance(a, dict) and "__dict__" in a:
        return {k: _decode_arg(v, env) for k, v in a["__dict__"]}
    return a


def graph_state(graph: fx.Graph) -> dict:
    nodes = []
    for n in graph.nodes:
        nodes.append({"op": n.op, "name": n.name, "target": _encode_target(n.target),
                      "args": _encode_arg(n.args), "kwargs": _encode_arg(n.kwargs),
                      "meta": {k: v for k, v in n.meta.items() if k in _META_KEEP and _picklable(v)}})
    return {"nodes": nodes, "codegen": graph._codegen}


def _picklable(v) -> bool:
    try:
        pickle.dumps(v)
        return True
    except Exception:  # noqa: BLE001
        return False


def graph_from_state(state: dict) -> fx.Graph:
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for d in state["nodes"]:
        args = _decode_arg(d["args"], env)
        kwargs = _decode_arg(d["kwargs"], env)
        target = _decode_target(d["target"])
        node = g.create_node(d["op"], target, tuple(args), dict(kwargs), name=d["name"])
        node.meta.update(d.get("meta", {}))
        env[d["name"]] = node
    g._codegen = state["codegen"]
    return g


def _init_from_body(gm: fx.GraphModule, body: dict, state: dict, class_name: str) -> fx.GraphModule:
    """Initialise `gm` (a new, uninitialised GraphModule) from a pickled `__dict__` and graph state."""
    graph = graph_from_state(state)
    com = _CodeOnlyModule(body)
    type(gm).__init__(gm, com, graph, class_name=class_name)
    for k, v in body.items():
        if not hasattr(gm, k) or k in ROOT_HOOK_ATTRS:
            setattr(gm, k, v)
    return gm


def _new_graph_module() -> fx.GraphModule:
    """Step one of unpickling a GraphModule: an uninitialised instance (of its own class, as GraphModule makes
    one per instance), memoized by the unpickler before its state is read."""
    cls = _get_graph_module_cls()
    return cls.__new__(cls)


def _fill_graph_module(gm: fx.GraphModule, state: tuple) -> None:
    """Step two: the state, read in full (back-references to `gm` inside it are `gm` itself)."""
    body, graph_st, class_name = state
    _init_from_body(gm, body, graph_st, class_name)


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
