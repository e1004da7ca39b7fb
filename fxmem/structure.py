"""A result's module structure as JSON data (module.json), and the module rebuilt from it with every field checked.

    doc, tensors = describe(gm, mode="train", quantized={...})  # saving (quantized layers' state taken out)
    gm = build(doc, tensors)                                    # loading; StructureError says what is wrong
    code = generated_code(doc)                                  # the code `build` would give the module

Only plain containers, GraphModules (graphs: `fxmem.graphdata`) and fxmem's runtime modules
(`fxmem.module_configs`) load; every parameter and buffer comes from the weights file, and every tensor there must
be used. The document's fields: docs/design/results.md, "The module structure as data".
"""
from __future__ import annotations

import torch
from torch import fx, nn

from .graphdata import GraphDataError, graph_from_data, graph_to_data, is_identifier, is_path
from .module_configs import KINDS, Config, ConfigError, kind_of
from .nn import recast
from .nn.lowbit import QuantLinear
from .nn.modes import ModeGraph, ModeRefusal
from .program import keep_persistence_when_copied

STRUCTURE_KIND = "fxmem-structure"
STRUCTURE_VERSION = 1
MODES = ("train", "inference")
CONTAINER = "torch.nn.Module"
GRAPH_MODULE = "torch.fx.GraphModule"
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class StructureError(ValueError):
    """A structure document that does not describe a module fxmem loads (the message says where)."""


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _where(path: str) -> str:
    return f"module {path or '<root>'}"


# ============================================================================================ saving

def plain_tensors(module: nn.Module) -> list[tuple[nn.Module, str, str, str, torch.Tensor]]:
    """(owner, "parameter" | "buffer", attribute name, qualified name, tensor) for every parameter and buffer."""
    out = []
    for mname, mod in module.named_modules():
        for kind, store in (("parameter", mod._parameters), ("buffer", mod._buffers)):
            for n, t in store.items():
                if t is not None:
                    out.append((mod, kind, n, _join(mname, n), t))
    return out


def describe(gm: fx.GraphModule, *, mode: str, quantized: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the structure document, the tensors to store by name). Quantized linears' bitsandbytes state must be out of
    the modules (`QuantLinear.without_quantized_state`) and in `quantized`. ValueError says what cannot be saved."""
    root = _describe_module(gm, "", {})
    specs, weights, first = [], {}, {}
    for mod, kind, n, qual, t in plain_tensors(gm):
        if type(t) not in (torch.Tensor, nn.Parameter):
            raise ValueError(f"{qual} is a {type(t).__module__}.{type(t).__qualname__}, which fxmem does not know "
                             "how to store (only plain tensors and fxmem's quantized linears are saved)")
        if not is_path(qual):
            raise ValueError(f"the tensor name {qual!r} is not a plain dotted name")
        spec = {"name": qual, "kind": kind, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        spec.update({"requires_grad": t.requires_grad} if kind == "parameter" else
                    {"persistent": n not in mod._non_persistent_buffers_set})
        if id(t) in first:
            spec["tie"] = first[id(t)]  # tied: stored once, under the first name
        else:
            first[id(t)] = qual
            weights[qual] = t.detach().contiguous().cpu()
        specs.append(spec)
    doc = {"kind": STRUCTURE_KIND, "version": STRUCTURE_VERSION, "mode": mode, "root": root, "tensors": specs,
           "quantized": quantized}
    return doc, weights


def _describe_module(m: nn.Module, path: str, seen: dict) -> dict:
    if id(m) in seen:
        return {"alias": seen[id(m)]}
    seen[id(m)] = path
    where = f"{_where(path)} ({type(m).__name__})"
    _require_no_hooks(m, where)
    built: tuple = ()
    if isinstance(m, fx.GraphModule):
        d = {"class": GRAPH_MODULE, "config": {"class_name": type(m).__name__, "recast": recast.installed(m),
                                               "offload_plan": getattr(m, "fxmem_offload", None)}}
        try:
            d["graph"] = graph_to_data(m.graph)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    elif type(m) is nn.Module:
        d = {"class": CONTAINER, "config": {}}
    else:
        kind = kind_of(m)
        if kind is None:
            raise ValueError(f"{where} is a {type(m).__module__}.{type(m).__qualname__}, which fxmem's result "
                             "format does not hold (plain containers, GraphModules and fxmem's runtime modules)")
        try:
            d = {"class": kind.name, "config": kind.config(m)}
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        built = kind.built
    modules = []
    for name, child in m._modules.items():
        if name in built:
            continue
        if not is_path(name) or "." in name:
            raise ValueError(f"{where}: the submodule name {name!r} is not a plain name")
        modules.append([name, None if child is None else _describe_module(child, _join(path, name), seen)])
    d["modules"] = modules
    return d


def _require_no_hooks(m: nn.Module, where: str) -> None:
    """Hooks are code: a result holds none, except fxmem.nn.recast's pair, which loading installs again."""
    for attr in _HOOKS:
        hooks = getattr(m, attr, None) or {}
        allowed = 1 if recast.installed(m) and attr in ("_forward_pre_hooks", "_forward_hooks") else 0
        if len(hooks) > allowed:
            raise ValueError(f"{where} has {attr[1:]} ({', '.join(type(h).__name__ for h in hooks.values())}), "
                             "which a saved result does not hold; remove them before saving")


# ============================================================================================ loading

class _Build:
    """What building one document shares: modules by path (for aliases), offload runtimes by id."""

    def __init__(self):
        self.modules: dict[str, nn.Module] = {}
        self.runtimes: dict = {}


def build(doc, tensors: dict[str, torch.Tensor]) -> fx.GraphModule:
    """The module `doc` describes, its tensors taken from `tensors` (StructureError for anything not allowed)."""
    _check_document(doc)
    root = _build_module(doc["root"], "", _Build())
    if not isinstance(root, fx.GraphModule):
        raise StructureError("the root module must be a GraphModule")
    used = _place_tensors(root, doc["tensors"], tensors)
    used |= load_quantized(root, doc["quantized"], tensors)
    unused = sorted(set(tensors) - used)
    if unused:
        raise StructureError(f"the weights hold {len(unused)} tensor(s) the structure does not use "
                             f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''})")
    for path, mod in root.named_modules():
        if isinstance(mod, fx.GraphModule):
            try:
                mod.graph.lint()  # now with its owner: get_attr/call_module targets must exist
            except Exception as e:  # noqa: BLE001  (fx's consistency check, whatever it raises)
                raise StructureError(f"{_where(path)}: {e}") from None
        if isinstance(mod, ModeGraph):
            _check_mode_graph(root, path, mod)
    keep_persistence_when_copied(root)
    root.train(doc["mode"] == "train")
    return root


def _check_mode_graph(root: nn.Module, path: str, mod: ModeGraph) -> None:
    """The tensors a mode's graph reads from the module that dispatches to it are that module's."""
    owner = root.get_submodule(path.rpartition(".")[0])
    names = {n for n, _ in owner.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in owner.named_buffers(remove_duplicate=False)}
    missing = [p for p in mod.attr_paths if p not in names]
    if missing:
        raise StructureError(f"{_where(path)}: reads {missing[0]}, which is not a tensor of the module it serves")


def _check_document(doc) -> None:
    if not isinstance(doc, dict) or doc.get("kind") != STRUCTURE_KIND:
        raise StructureError(f"not an fxmem structure document (kind {STRUCTURE_KIND!r})")
    if doc.get("version") != STRUCTURE_VERSION:
        raise StructureError(f"structure version {doc.get('version')!r}; this fxmem reads {STRUCTURE_VERSION}")
    keys = {"kind", "version", "mode", "root", "tensors", "quantized"}
    if set(doc) != keys:
        raise StructureError(f"the document must hold exactly {', '.join(sorted(keys))}")
    if doc["mode"] not in MODES:
        raise StructureError(f"mode must be one of {', '.join(MODES)}, got {doc['mode']!r}")
    if not isinstance(doc["tensors"], list) or not isinstance(doc["quantized"], dict):
        raise StructureError("tensors must be a list and quantized an object")


def _build_module(d, path: str, ctx: _Build) -> nn.Module:
    where = _where(path)
    if isinstance(d, dict) and set(d) == {"alias"}:
        target = ctx.modules.get(d["alias"]) if isinstance(d["alias"], str) else None
        if target is None:
            raise StructureError(f"{where}: alias {d['alias']!r} does not name a module described before it")
        return target
    if not isinstance(d, dict) or not {"class", "config", "modules"} <= set(d) <= {"class", "config", "modules",
                                                                                    "graph"}:
        raise StructureError(f"{where}: a module is an object with class, config, modules (and graph)")
    children = _build_children(d["modules"], path, ctx)
    cls = d["class"]
    try:
        if cls == GRAPH_MODULE:
            m = _build_graph_module(d, children, where)
        elif cls == CONTAINER:
            Config(d["config"], where).done()
            m = nn.Module()
        else:
            m = _build_runtime_module(d, children, where, ctx)
    except (ConfigError, GraphDataError) as e:
        raise StructureError(str(e)) from None
    for name, child in children.items():
        if m._modules.get(name, child) is not child:
            raise StructureError(f"{where}: the {cls} built has another submodule {name}")
        m._modules[name] = child
    ctx.modules[path] = m
    return m


def _build_children(entries, path: str, ctx: _Build) -> dict[str, nn.Module | None]:
    if not isinstance(entries, list):
        raise StructureError(f"{_where(path)}: modules must be a list of [name, module]")
    children: dict = {}
    for e in entries:
        if not (isinstance(e, list) and len(e) == 2 and is_path(e[0]) and "." not in e[0]) or e[0] in children:
            raise StructureError(f"{_where(path)}: each submodule is [a new plain name, module]")
        children[e[0]] = None if e[1] is None else _build_module(e[1], _join(path, e[0]), ctx)
    return children


def _build_runtime_module(d: dict, children: dict, where: str, ctx: _Build) -> nn.Module:
    kind = KINDS.get(d["class"]) if isinstance(d["class"], str) else None
    if kind is None:
        raise StructureError(f"{where}: class {str(d['class'])[:80]!r} is not one a saved result may hold (plain "
                             "containers, GraphModules and fxmem's runtime modules)")
    if "graph" in d or set(children) != set(kind.children) or any(children[n] is None for n in kind.children):
        raise StructureError(f"{where}: a {kind.cls.__name__} has the submodules {list(kind.children)} and no graph")
    cfg = Config(d["config"], where)
    try:
        m = kind.build(cfg, children, ctx.runtimes)
    except ImportError as e:
        package = (e.name or "").split(".")[0] or "a module"
        raise StructureError(f"{where} is a {kind.cls.__name__}; loading it needs the package {package}, which "
                             f"is not installed ({e})") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {e}") from None
    cfg.done()
    return m


def _build_graph_module(d: dict, children: dict, where: str) -> fx.GraphModule:
    cfg = Config(d["config"], where)
    class_name = cfg.get("class_name", str)
    installed, plan = cfg.get("recast", bool), cfg.get("offload_plan", dict, optional=True)
    cfg.done()
    if not is_identifier(class_name):
        raise ConfigError(f"{where}: class_name {class_name[:80]!r} is not an identifier")
    if plan is not None and not _plain_json(plan):
        raise ConfigError(f"{where}: offload_plan must hold only strings, numbers, booleans and lists of them")
    try:
        graph = graph_from_data(d.get("graph"))
    except GraphDataError as e:
        raise GraphDataError(f"{where}: {e}") from None
    gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name=class_name)
    for name, child in children.items():
        gm._modules[name] = child
    gm.graph = graph  # generates the forward from the checked graph
    info = getattr(graph._codegen, "pytree_info", None)
    if info is not None:
        gm._in_spec, gm._out_spec = info.in_spec, info.out_spec
    branch = getattr(graph._codegen, "branch", None)  # the forward starts by calling this child in its mode
    if branch is not None and not isinstance(children.get(branch), (ModeGraph, ModeRefusal)):
        raise ConfigError(f"{where}: its forward dispatches to {branch}, which is not a ModeGraph or ModeRefusal")
    if installed:
        recast.install(gm)
    if plan is not None:
        gm.fxmem_offload = plan
    return gm


def _plain_json(v) -> bool:
    if v is None or isinstance(v, (str, int, float, bool)):
        return True
    if isinstance(v, list):
        return all(_plain_json(x) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _plain_json(x) for k, x in v.items())


def _place_tensors(root: nn.Module, specs: list, tensors: dict) -> set[str]:
    """Put every described parameter/buffer in place; each plain tensor of the module must be one of them."""
    placed: dict[str, torch.Tensor] = {}
    for spec in specs:
        name = spec.get("name") if isinstance(spec, dict) else None
        if not is_path(name) or name in placed:
            raise StructureError(f"tensor entry {str(name)[:80]!r}: not a new dotted name")
        owner_path, _, attr = name.rpartition(".")
        try:
            owner = root.get_submodule(owner_path)
        except AttributeError:
            raise StructureError(f"tensor {name}: there is no module {owner_path}") from None
        placed[name] = _put_tensor(owner, attr, spec, tensors, placed)
    ids = {id(t) for t in placed.values()}
    for _, _, _, qual, t in plain_tensors(root):
        if type(t) in (torch.Tensor, nn.Parameter) and id(t) not in ids:
            raise StructureError(f"tensor {qual} of the module is not given by the structure's tensors")
    return {n for n, s in zip(placed, specs) if "tie" not in s}


def _put_tensor(owner: nn.Module, attr: str, spec: dict, tensors: dict, placed: dict) -> torch.Tensor:
    name, kind = spec["name"], spec.get("kind")
    keys = {"name", "kind", "dtype", "shape", "tie", "requires_grad" if kind == "parameter" else "persistent"}
    flag = spec.get("requires_grad" if kind == "parameter" else "persistent")
    shape = spec.get("shape")
    if kind not in ("parameter", "buffer") or not set(spec) - {"tie"} <= keys or not isinstance(flag, bool) or \
            not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise StructureError(f"tensor {name}: an entry has kind, dtype, shape and requires_grad or persistent")
    if "tie" in spec:
        value = placed.get(spec["tie"]) if isinstance(spec["tie"], str) else None
        if value is None:
            raise StructureError(f"tensor {name}: tied to {spec['tie']!r}, which is not an entry before it")
    else:
        value = tensors.get(name)
        if value is None:
            raise StructureError(f"tensor {name}: not in the weights file")
    if str(value.dtype).removeprefix("torch.") != spec.get("dtype") or list(value.shape) != shape:
        raise StructureError(f"tensor {name}: the weights hold {value.dtype} {list(value.shape)}, the structure says "
                             f"{spec.get('dtype')} {shape}")
    if "tie" not in spec and kind == "parameter":
        try:
            value = nn.Parameter(value, requires_grad=flag)
        except RuntimeError as e:
            raise StructureError(f"tensor {name}: {e}") from None
    if (kind == "parameter") != isinstance(value, nn.Parameter):
        raise StructureError(f"tensor {name}: tied to a tensor of another kind")
    store, other = (owner._parameters, owner._buffers) if kind == "parameter" else (owner._buffers, owner._parameters)
    if attr in other or attr in owner._modules or (attr in owner.__dict__ and attr not in store):
        raise StructureError(f"tensor {name}: {attr} is already another attribute of its module")
    store[attr] = value
    if kind == "buffer":
        (owner._non_persistent_buffers_set.discard if flag else owner._non_persistent_buffers_set.add)(attr)
    return value


def load_quantized(root: nn.Module, quantized: dict, tensors: dict) -> set[str]:
    """Give each quantized linear its bitsandbytes weight and state; return the tensor names used."""
    found = {p: m for p, m in root.named_modules() if isinstance(m, QuantLinear)}
    if set(found) != set(quantized):
        missing = sorted(set(found) ^ set(quantized))
        raise StructureError(f"quantized state and quantized layers differ ({', '.join(missing[:3])})")
    used = set()
    for path, fields in quantized.items():
        names = fields.get("tensors") if isinstance(fields, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise StructureError(f"{_where(path)}: quantized state needs the list of its tensors")
        mine = {n: tensors[f"{path}.{n}"] for n in names if f"{path}.{n}" in tensors}
        try:
            found[path].load_quantized_state(mine, fields)
        except (ValueError, TypeError, KeyError, AssertionError, RuntimeError) as e:
            raise StructureError(f"{_where(path)}: cannot rebuild the quantized layer: {e}") from None
        used |= {f"{path}.{n}" for n in mine}
    return used


# ============================================================================================ code

def format_code(class_name: str, sections: list[tuple[str, str]]) -> str:
    """The readable code of a module: one titled section per GraphModule, (path, code) in module order."""
    parts = []
    for path, code in sections:
        parts.append(f"# ---- {class_name}" + (f".{path}" if path else "") + " ----\n" + code.strip() + "\n")
    return "\n".join(parts)


def generated_code(doc) -> str:
    """The code of every GraphModule `doc` describes, as `build(doc, ...)` would generate it (no module is built:
    graphs are checked and generated only)."""
    _check_document(doc)
    sections: list[tuple[str, str]] = []
    _collect_code(doc["root"], "", sections)
    root = doc["root"]
    cfg = root.get("config") if isinstance(root, dict) and root.get("class") == GRAPH_MODULE else None
    name = cfg.get("class_name") if isinstance(cfg, dict) else None
    if not is_identifier(name):
        raise StructureError("the root module must be a GraphModule with a class_name")
    return format_code(name, sections)


def _collect_code(d, path: str, sections: list) -> None:
    if not isinstance(d, dict) or "alias" in d:
        return
    cls = d.get("class")
    if cls not in KINDS and cls not in (CONTAINER, GRAPH_MODULE):
        raise StructureError(f"{_where(path)}: class {str(cls)[:80]!r} is not one a saved result may hold")
    if cls == GRAPH_MODULE:
        try:
            graph = graph_from_data(d.get("graph"))
        except GraphDataError as e:
            raise StructureError(f"{_where(path)}: {e}") from None
        sections.append((path, graph.python_code(root_module="self").src))
    for e in d.get("modules") or []:
        if isinstance(e, list) and len(e) == 2 and is_path(e[0]):
            _collect_code(e[1], _join(path, e[0]), sections)
