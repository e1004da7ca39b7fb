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

from .compiled_budget import planned_budget, set_planned_budget
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
            for attr, tensor in store.items():
                if tensor is not None:
                    out.append((mod, kind, attr, _join(mname, attr), tensor))
    return out


def describe(graph_module: fx.GraphModule, *, mode: str, quantized: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the structure document, the tensors to store by name). Quantized linears' bitsandbytes state must be out of
    the modules (`QuantLinear.without_quantized_state`) and in `quantized`. ValueError says what cannot be saved."""
    root = _describe_module(graph_module, "", {})
    specs, weights, first = [], {}, {}
    for mod, kind, attr, qual, tensor in plain_tensors(graph_module):
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            raise ValueError(f"{qual} is a {type(tensor).__module__}.{type(tensor).__qualname__}, which fxmem does "
                             "not know how to store (only plain tensors and fxmem's quantized linears are saved)")
        if not is_path(qual):
            raise ValueError(f"the tensor name {qual!r} is not a plain dotted name")
        spec = {"name": qual, "kind": kind, "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape)}
        spec.update({"requires_grad": tensor.requires_grad} if kind == "parameter" else
                    {"persistent": attr not in mod._non_persistent_buffers_set})
        if id(tensor) in first:
            spec["tie"] = first[id(tensor)]  # tied: stored once, under the first name
        else:
            first[id(tensor)] = qual
            weights[qual] = tensor.detach().contiguous().cpu()
        specs.append(spec)
    doc = {"kind": STRUCTURE_KIND, "version": STRUCTURE_VERSION, "mode": mode, "root": root, "tensors": specs,
           "quantized": quantized}
    budget = planned_budget(graph_module)
    if budget is not None:  # the compiler setting the result was planned for (fxmem.compile reads it)
        doc["compile"] = {"activation_memory_budget": budget}
    return doc, weights


def _describe_module(module: nn.Module, path: str, seen: dict) -> dict:
    if id(module) in seen:
        return {"alias": seen[id(module)]}
    seen[id(module)] = path
    where = f"{_where(path)} ({type(module).__name__})"
    _require_no_hooks(module, where)
    built: tuple = ()
    if isinstance(module, fx.GraphModule):
        entry = {"class": GRAPH_MODULE, "config": {"class_name": type(module).__name__,
                                                   "recast": recast.installed(module),
                                                   "offload_plan": getattr(module, "fxmem_offload", None)}}
        try:
            entry["graph"] = graph_to_data(module.graph)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    elif type(module) is nn.Module:
        entry = {"class": CONTAINER, "config": {}}
    else:
        kind = kind_of(module)
        if kind is None:
            raise ValueError(f"{where} is a {type(module).__module__}.{type(module).__qualname__}, which fxmem's "
                             "result format does not hold (plain containers, GraphModules and fxmem's runtime modules)")
        try:
            entry = {"class": kind.name, "config": kind.config(module)}
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        built = kind.built
    modules = []
    for name, child in module._modules.items():
        if name in built:
            continue
        if not is_path(name) or "." in name:
            raise ValueError(f"{where}: the submodule name {name!r} is not a plain name")
        modules.append([name, None if child is None else _describe_module(child, _join(path, name), seen)])
    entry["modules"] = modules
    return entry


def _require_no_hooks(module: nn.Module, where: str) -> None:
    """Hooks are code: a result holds none, except fxmem.nn.recast's pair, which loading installs again."""
    for attr in _HOOKS:
        hooks = getattr(module, attr, None) or {}
        allowed = 1 if recast.installed(module) and attr in ("_forward_pre_hooks", "_forward_hooks") else 0
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
            except Exception as error:  # noqa: BLE001  (fx's consistency check, whatever it raises)
                raise StructureError(f"{_where(path)}: {error}") from None
        if isinstance(mod, ModeGraph):
            _check_mode_graph(root, path, mod)
    keep_persistence_when_copied(root)
    root.train(doc["mode"] == "train")
    if "compile" in doc:
        set_planned_budget(root, doc["compile"]["activation_memory_budget"])
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
    if not keys <= set(doc) <= keys | {"compile"}:
        raise StructureError(f"the document must hold exactly {', '.join(sorted(keys))} (and compile, optional)")
    if "compile" in doc:
        _check_compile(doc["compile"])
    if doc["mode"] not in MODES:
        raise StructureError(f"mode must be one of {', '.join(MODES)}, got {doc['mode']!r}")
    if not isinstance(doc["tensors"], list) or not isinstance(doc["quantized"], dict):
        raise StructureError("tensors must be a list and quantized an object")


def _check_compile(setting) -> None:
    """The optional compiler setting: {"activation_memory_budget": a fraction in (0, 1]}."""
    budget = setting.get("activation_memory_budget") if isinstance(setting, dict) else None
    if set(setting if isinstance(setting, dict) else ()) != {"activation_memory_budget"} or \
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise StructureError(f"compile must be {{\"activation_memory_budget\": a fraction in (0, 1]}}, got "
                             f"{setting!r}")


def _build_module(entry, path: str, ctx: _Build) -> nn.Module:
    where = _where(path)
    if isinstance(entry, dict) and set(entry) == {"alias"}:
        target = ctx.modules.get(entry["alias"]) if isinstance(entry["alias"], str) else None
        if target is None:
            raise StructureError(f"{where}: alias {entry['alias']!r} does not name a module described before it")
        return target
    if not isinstance(entry, dict) or not {"class", "config", "modules"} <= set(entry) <= {"class", "config", "modules",
                                                                                    "graph"}:
        raise StructureError(f"{where}: a module is an object with class, config, modules (and graph)")
    children = _build_children(entry["modules"], path, ctx)
    cls = entry["class"]
    try:
        if cls == GRAPH_MODULE:
            module = _build_graph_module(entry, children, where)
        elif cls == CONTAINER:
            Config(entry["config"], where).done()
            module = nn.Module()
        else:
            module = _build_runtime_module(entry, children, where, ctx)
    except (ConfigError, GraphDataError) as error:
        raise StructureError(str(error)) from None
    for name, child in children.items():
        if module._modules.get(name, child) is not child:
            raise StructureError(f"{where}: the {cls} built has another submodule {name}")
        module._modules[name] = child
    ctx.modules[path] = module
    return module


def _build_children(entries, path: str, ctx: _Build) -> dict[str, nn.Module | None]:
    if not isinstance(entries, list):
        raise StructureError(f"{_where(path)}: modules must be a list of [name, module]")
    children: dict = {}
    for entry in entries:
        if (not (isinstance(entry, list) and len(entry) == 2 and is_path(entry[0]) and "." not in entry[0])
                or entry[0] in children):
            raise StructureError(f"{_where(path)}: each submodule is [a new plain name, module]")
        children[entry[0]] = None if entry[1] is None else _build_module(entry[1], _join(path, entry[0]), ctx)
    return children


def _build_runtime_module(entry: dict, children: dict, where: str, ctx: _Build) -> nn.Module:
    kind = KINDS.get(entry["class"]) if isinstance(entry["class"], str) else None
    if kind is None:
        raise StructureError(f"{where}: class {str(entry['class'])[:80]!r} is not one a saved result may hold (plain "
                             "containers, GraphModules and fxmem's runtime modules)")
    if "graph" in entry or set(children) != set(kind.children) or any(children[n] is None for n in kind.children):
        raise StructureError(f"{where}: a {kind.cls.__name__} has the submodules {list(kind.children)} and no graph")
    cfg = Config(entry["config"], where)
    try:
        module = kind.build(cfg, children, ctx.runtimes)
    except ImportError as error:
        package = (error.name or "").split(".")[0] or "a module"
        raise StructureError(f"{where} is a {kind.cls.__name__}; loading it needs the package {package}, which "
                             f"is not installed ({error})") from None
    except (TypeError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{where}: {error}") from None
    cfg.done()
    return module


def _build_graph_module(entry: dict, children: dict, where: str) -> fx.GraphModule:
    cfg = Config(entry["config"], where)
    class_name = cfg.get("class_name", str)
    installed, plan = cfg.get("recast", bool), cfg.get("offload_plan", dict, optional=True)
    cfg.done()
    if not is_identifier(class_name):
        raise ConfigError(f"{where}: class_name {class_name[:80]!r} is not an identifier")
    if plan is not None and not _plain_json(plan):
        raise ConfigError(f"{where}: offload_plan must hold only strings, numbers, booleans and lists of them")
    try:
        graph = graph_from_data(entry.get("graph"))
    except GraphDataError as error:
        raise GraphDataError(f"{where}: {error}") from None
    graph_module = fx.GraphModule(nn.Module(), fx.Graph(), class_name=class_name)
    for name, child in children.items():
        graph_module._modules[name] = child
    graph_module.graph = graph  # generates the forward from the checked graph
    info = getattr(graph._codegen, "pytree_info", None)
    if info is not None:
        graph_module._in_spec, graph_module._out_spec = info.in_spec, info.out_spec
    branch = getattr(graph._codegen, "branch", None)  # the forward starts by calling this child in its mode
    if branch is not None and not isinstance(children.get(branch), (ModeGraph, ModeRefusal)):
        raise ConfigError(f"{where}: its forward dispatches to {branch}, which is not a ModeGraph or ModeRefusal")
    if installed:
        recast.install(graph_module)
    if plan is not None:
        graph_module.fxmem_offload = plan
    return graph_module


def _plain_json(value) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, list):
        return all(_plain_json(x) for x in value)
    return isinstance(value, dict) and all(isinstance(k, str) and _plain_json(x) for k, x in value.items())


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
    for _, _, _, qual, tensor in plain_tensors(root):
        if type(tensor) in (torch.Tensor, nn.Parameter) and id(tensor) not in ids:
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
        except RuntimeError as error:
            raise StructureError(f"tensor {name}: {error}") from None
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
        except (ValueError, TypeError, KeyError, AssertionError, RuntimeError) as error:
            raise StructureError(f"{_where(path)}: cannot rebuild the quantized layer: {error}") from None
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


def _collect_code(entry, path: str, sections: list) -> None:
    if not isinstance(entry, dict) or "alias" in entry:
        return
    cls = entry.get("class")
    if cls not in KINDS and cls not in (CONTAINER, GRAPH_MODULE):
        raise StructureError(f"{_where(path)}: class {str(cls)[:80]!r} is not one a saved result may hold")
    if cls == GRAPH_MODULE:
        try:
            graph = graph_from_data(entry.get("graph"))
        except GraphDataError as error:
            raise StructureError(f"{_where(path)}: {error}") from None
        sections.append((path, graph.python_code(root_module="self").src))
    for child in entry.get("modules") or []:
        if isinstance(child, list) and len(child) == 2 and is_path(child[0]):
            _collect_code(child[1], _join(path, child[0]), sections)
