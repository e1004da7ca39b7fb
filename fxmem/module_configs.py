"""fxmem's runtime modules in a saved result: each class's configuration as JSON, and how loading rebuilds it.

    kind = kind_of(module)                                  # saving: None for a class not listed here
    data = kind.config(module)                              # JSON: the constructor's arguments
    module = KINDS[name].build(Config(data, where), children, runtimes)   # loading; ConfigError names the key

`children` are the submodules the result describes (built first: a region's body, a LoRA layer's base); `built`
names the submodules a class makes itself (a gate's layers, bitsandbytes' inner layer), which are not described.
Parameters and buffers are not part of a configuration: the loader puts every one in place from the weights file
afterwards (`fxmem.structure`). These classes, plain containers and GraphModules are all a result may hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .graphdata import DTYPES, GraphDataError, is_path, spec_from_data, spec_to_data
from .guards import CONSTANT_TYPES, DimSpec, InputGuard, InputSpec
from .nn.attention import LOWRANK_DTYPES, HybridAttention, SemiseparableAttention
from .nn.checkpoint import CheckpointRegion
from .nn.gating import GatedResidual
from .nn.lowbit import QUANT_KINDS, FrozenLinear, LoRALinear, QuantLinear
from .nn.modes import ModeFlag, ModeGraph, ModeRefusal
from .nn.offload import TIERS, OffloadRegion, OffloadRuntime
from .nn.quantized_weights import WEIGHT_KINDS, QuantizedWeight
from .nn.regions import RegionInfo


class ConfigError(ValueError):
    """A configuration that does not describe a module of its class (the message names the key)."""


class Config:
    """A module's configuration as read from a result: typed access, unknown keys refused."""

    def __init__(self, data, where: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: config must be an object")
        self.data, self.where, self.read = data, where, set()

    def get(self, key: str, kind, *, optional: bool = False):
        """The value of `key`, of type `kind` (a type or a tuple; float accepts int; None only if optional)."""
        self.read.add(key)
        if key not in self.data:
            if optional:
                return None
            raise ConfigError(f"{self.where}: config has no {key!r}")
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if value is None and optional:
            return None
        ok = any(isinstance(value, k) and not (isinstance(value, bool) and k is not bool) for k in kinds) or \
            (float in kinds and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{self.where}: config {key!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                              f"got {type(value).__name__}")
        return float(value) if float in kinds and isinstance(value, int) and int not in kinds else value

    def choice(self, key: str, allowed) -> str:
        value = self.get(key, str)
        if value not in allowed:
            raise ConfigError(f"{self.where}: config {key!r} must be one of {', '.join(allowed)}, got {value!r}")
        return value

    def ints(self, key: str) -> tuple[int, ...]:
        value = self.get(key, list)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise ConfigError(f"{self.where}: config {key!r} must be a list of integers")
        return tuple(value)

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.get(key, list)
        if not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{self.where}: config {key!r} must be a list of strings")
        return tuple(value)

    def done(self) -> None:
        extra = sorted(set(self.data) - self.read)
        if extra:
            raise ConfigError(f"{self.where}: config has unknown keys {', '.join(map(repr, extra))}")


@dataclass(frozen=True)
class ModuleKind:
    name: str  # as saved: the class's module and name
    cls: type
    config: Callable[[nn.Module], dict]
    build: Callable  # (Config, children: dict[str, nn.Module], runtimes: dict[int, OffloadRuntime]) -> module
    children: tuple[str, ...] = ()  # described submodules the builder takes
    built: tuple[str, ...] = ()  # submodules the class makes itself


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(cfg: Config, key: str) -> torch.dtype:
    name = cfg.get(key, str)
    if name not in DTYPES:
        raise ConfigError(f"{cfg.where}: config {key!r} is not a torch dtype: {name[:40]!r}")
    return DTYPES[name]


# ============================================================================================ per class

def _guard_config(module: InputGuard) -> dict:
    specs = []
    for input_spec in module.specs:
        spec = {"name": input_spec.name, "dtype": input_spec.dtype,
                "dims": None if input_spec.dims is None else [[d.static, d.symbol, d.lower, d.upper]
                                                               for d in input_spec.dims]}
        if input_spec.constant:
            spec["constant"] = list(input_spec.constant)
        specs.append(spec)
    return {"specs": specs}


def _guard_build(cfg: Config, children, runtimes) -> InputGuard:
    specs = []
    for entry in cfg.get("specs", list):
        if not isinstance(entry, dict) \
                or not {"name", "dtype", "dims"} <= set(entry) <= {"name", "dtype", "dims", "constant"} \
                or not isinstance(entry["name"], str) or not isinstance(entry["dtype"], (str, type(None))) \
                or not isinstance(entry["dims"], (list, type(None))):
            raise ConfigError(f"{cfg.where}: each input spec is an object with name, dtype and dims (and constant)")
        dims = None
        if entry["dims"] is not None:
            dims = tuple(_dim_spec(d, cfg.where) for d in entry["dims"])
        specs.append(InputSpec(entry["name"], dims, entry["dtype"], _constant(entry.get("constant", []), cfg.where)))
    return InputGuard(specs)


def _constant(data, where: str) -> tuple:
    """An input spec's constant: [] (none) or [value], a JSON bool, number or string."""
    if not isinstance(data, list) or len(data) > 1 or (data and type(data[0]) not in CONSTANT_TYPES):
        raise ConfigError(f"{where}: an input spec's constant is [] or [a bool, number or string]")
    return tuple(data)


def _dim_spec(entry, where: str) -> DimSpec:
    def opt_int(value):
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if not (isinstance(entry, list) and len(entry) == 4 and opt_int(entry[0])
            and isinstance(entry[1], (str, type(None))) and opt_int(entry[2]) and opt_int(entry[3])):
        raise ConfigError(f"{where}: a dim spec is [static size, symbol, lower, upper]")
    return DimSpec(*entry)


def _checkpoint_config(module: CheckpointRegion) -> dict:
    config = {"keep_ops": sorted(module.keep_ops), "label": module.label, "restore_args": list(module.restore_args)}
    if module.fxmem_region.as_recipes:
        config["recipes"] = True  # (absent: torch's checkpoint, as every file written before recipe regions)
    return config


def _checkpoint_build(cfg: Config, children, runtimes) -> CheckpointRegion:
    return CheckpointRegion(children["body"], cfg.strings("keep_ops"), label=cfg.get("label", str),
                            restore_args=cfg.ints("restore_args"), recipes=bool(cfg.get("recipes", bool, optional=True)))


def _offload_config(module: OffloadRegion) -> dict:
    runtime, info = module.runtime, module.fxmem_region
    model_body = None
    if info.kind == "recompute":  # around a checkpoint region: the cost model runs that region's body
        model_body = next((p for p, sub in module.named_modules() if sub is info.body and p), None)
        if model_body is None:
            raise ValueError("its modelled body is not one of its submodules")
    # (not its scratch directory: a path of the saving machine; the loading one uses its temp dir)
    return {"runtime": {"id": id(runtime), "tier": runtime.tier, "prefetch": runtime.prefetch,
                        "min_bytes": runtime.min_bytes, "unlink_early": bool(runtime.unlink_early)},
            "index": module.index, "last": module.last, "param_args": list(module.param_args),
            "inputs_too": module.inputs_too, "label": module.label, "model_body": model_body,
            "keep_ops": sorted(info.keep_ops)}


def _offload_build(cfg: Config, children, runtimes) -> OffloadRegion:
    body = children["body"]
    rt_cfg = Config(cfg.get("runtime", dict), cfg.where + " runtime")
    key = rt_cfg.get("id", int)
    args = (rt_cfg.choice("tier", TIERS), rt_cfg.get("prefetch", int), rt_cfg.get("min_bytes", int))
    unlink_early = rt_cfg.get("unlink_early", bool)
    rt_cfg.done()
    if args[1] < 0 or args[2] < 0:
        raise ConfigError(f"{cfg.where}: runtime prefetch and min_bytes must be >= 0")
    runtime = runtimes.get(key)
    if runtime is None:
        runtime = runtimes[key] = OffloadRuntime(*args, unlink_early=unlink_early)
    elif (runtime.tier, runtime.prefetch, runtime.min_bytes, runtime.unlink_early) != args + (unlink_early,):
        raise ConfigError(f"{cfg.where}: runtime {key} is configured differently by another region")
    path = cfg.get("model_body", str, optional=True)
    model_body = None
    if path is not None:
        head, _, rest = path.partition(".")
        if head != "body":
            raise ConfigError(f"{cfg.where}: model_body must be a submodule of body, got {path!r}")
        try:
            model_body = body.get_submodule(rest) if rest else body
        except AttributeError:
            raise ConfigError(f"{cfg.where}: model_body {path!r} is not a submodule") from None
    index, last, param_args = cfg.get("index", int), cfg.get("last", bool), cfg.ints("param_args")
    inputs_too, label, keep_ops = cfg.get("inputs_too", bool), cfg.get("label", str), frozenset(cfg.strings("keep_ops"))
    checkpoint_region = (RegionInfo(kind="recompute", body=model_body, keep_ops=keep_ops)
                         if model_body is not None else None)
    return OffloadRegion(body, runtime, index=index, last=last, param_args=param_args, inputs_too=inputs_too,
                         label=label, checkpoint_region=checkpoint_region)


def _quant_config(module: QuantLinear) -> dict:
    return {"kind": module.kind, "in_features": module.in_features, "out_features": module.out_features,
            "compute_dtype": _dtype_name(module.compute_dtype), "threshold": module.threshold,
            "double_quant": module.double_quant, "bias": module.bias is not None}


def _quant_build(cfg: Config, children, runtimes) -> QuantLinear:
    kind = cfg.choice("kind", QUANT_KINDS)
    shape = (cfg.get("in_features", int), cfg.get("out_features", int))
    if min(shape) < 1:
        raise ConfigError(f"{cfg.where}: in_features and out_features must be positive")
    return QuantLinear.for_loading(*shape, kind, threshold=cfg.get("threshold", float),
                                   double_quant=cfg.get("double_quant", bool),
                                   compute_dtype=_dtype(cfg, "compute_dtype"), bias=cfg.get("bias", bool))


def _stored_config(module: QuantizedWeight) -> dict:
    return {"kind": module.kind, "shape": list(module.shape), "dtype": _dtype_name(module.dtype),
            "row_dims": module.row_dims, "blocksize": module.blocksize}


def _stored_build(cfg: Config, children, runtimes) -> QuantizedWeight:
    kind, shape = cfg.choice("kind", WEIGHT_KINDS), cfg.ints("shape")
    blocksize = cfg.get("blocksize", int)
    if len(shape) < 2 or min(shape) < 1:
        raise ConfigError(f"{cfg.where}: shape must have 2 or more positive dims")
    if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise ConfigError(f"{cfg.where}: blocksize must be a power of two from 32 to 4096, got {blocksize}")
    try:
        return QuantizedWeight.for_loading(shape, kind, dtype=_dtype(cfg, "dtype"), row_dims=cfg.get("row_dims", int),
                                           blocksize=blocksize)
    except ValueError as error:
        raise ConfigError(f"{cfg.where}: {error}") from None


def _frozen_config(module: FrozenLinear) -> dict:
    return {"in_features": module.in_features, "out_features": module.out_features, "transposed": module.transposed,
            "compute_dtype": _dtype_name(module.compute_dtype), "bias": module.bias is not None}


def _frozen_build(cfg: Config, children, runtimes) -> FrozenLinear:
    shape = (cfg.get("in_features", int), cfg.get("out_features", int))
    if min(shape) < 1:
        raise ConfigError(f"{cfg.where}: in_features and out_features must be positive")
    transposed = cfg.get("transposed", bool)
    weight = torch.empty(shape if transposed else shape[::-1], device="meta")  # (the weights file gives both)
    bias = torch.empty(shape[1], device="meta") if cfg.get("bias", bool) else None
    return FrozenLinear(weight, bias, transposed=transposed, compute_dtype=_dtype(cfg, "compute_dtype"))


def _mode_graph_config(module: ModeGraph) -> dict:
    return {"serves_training": module.serves_training, "attr_paths": list(module.attr_paths),
            "out_spec": spec_to_data(module.out_spec)}


def _mode_graph_build(cfg: Config, children, runtimes) -> ModeGraph:
    paths = cfg.strings("attr_paths")
    if not all(is_path(p) for p in paths):
        raise ConfigError(f"{cfg.where}: attr_paths must be dotted names of the root's tensors")
    try:
        out_spec = spec_from_data(cfg.get("out_spec", dict))
    except GraphDataError as error:
        raise ConfigError(f"{cfg.where}: out_spec: {error}") from None
    return ModeGraph(children["module"], cfg.get("serves_training", bool), list(paths), out_spec)


def _mode_refusal_build(cfg: Config, children, runtimes) -> ModeRefusal:
    return ModeRefusal(cfg.get("serves_training", bool), cfg.get("reason", str))


def _lora_config(module: LoRALinear) -> dict:
    dropout_p = module.dropout.p if isinstance(module.dropout, nn.Dropout) else 0.0
    return {"in_features": int(module.lora_A.shape[1]), "out_features": int(module.lora_B.shape[0]),
            "rank": module.rank, "alpha": module.alpha, "dropout": float(dropout_p)}


def _lora_build(cfg: Config, children, runtimes) -> LoRALinear:
    dropout_p = cfg.get("dropout", float)
    if not 0 <= dropout_p < 1:
        raise ConfigError(f"{cfg.where}: dropout must be in [0, 1)")
    return LoRALinear(children["base"], cfg.get("in_features", int), cfg.get("out_features", int),
                      rank=cfg.get("rank", int), alpha=cfg.get("alpha", float), dropout=dropout_p)


def _gated_config(module: GatedResidual) -> dict:
    return {"x_index": module.x_index, "features": module.features, "feature_dim": module.feature_dim,
            "reduction": module.reduction, "threshold": module.threshold, "per_sample": module.per_sample,
            "row_safe": module.row_safe, "label": module.label, "force_open": bool(module.force_open)}


def _gated_build(cfg: Config, children, runtimes) -> GatedResidual:
    features, reduction = cfg.get("features", int), cfg.get("reduction", int)
    if features < 1 or reduction < 1:
        raise ConfigError(f"{cfg.where}: features and reduction must be positive")
    module = GatedResidual(children["body"], cfg.get("x_index", int), features, feature_dim=cfg.get("feature_dim", int),
                      reduction=reduction, threshold=cfg.get("threshold", float),
                      per_sample=cfg.get("per_sample", bool), label=cfg.get("label", str),
                      row_safe=cfg.get("row_safe", bool))
    module.force_open = cfg.get("force_open", bool)
    return module


def _hybrid_config(module: HybridAttention) -> dict:
    return {"scale": module.scale, "causal": module.causal, "top_k": module.top_k, "chunk_size": module.chunk_size,
            "heads": module.heads, "rank": module.rank,
            "in_features": None if module.q_proj is None else int(module.q_proj.in_features)}


def _hybrid_build(cfg: Config, children, runtimes) -> HybridAttention:
    module = HybridAttention(cfg.get("scale", float), cfg.get("causal", bool), cfg.get("top_k", int),
                        cfg.get("chunk_size", int))
    heads, rank, in_features = cfg.get("heads", int), cfg.get("rank", int), cfg.get("in_features", int, optional=True)
    if in_features is not None:
        if min(heads, rank, in_features) < 1:
            raise ConfigError(f"{cfg.where}: heads, rank and in_features must be positive")
        module.q_proj, module.k_proj = nn.Linear(in_features, heads * rank), nn.Linear(in_features, heads * rank)
        module.heads, module.rank = heads, rank
    return module


def _semisep_config(module: SemiseparableAttention) -> dict:
    return {"scale": module.scale, "causal": module.causal, "rank": module.rank, "band": module.band,
            "hierarchical": module.hierarchical, "lowrank_dtype": module.lowrank_dtype,
            "head_dim": int(module.features.shape[-1])}


def _semisep_build(cfg: Config, children, runtimes) -> SemiseparableAttention:
    rank, head_dim = cfg.get("rank", int), cfg.get("head_dim", int)
    if min(rank, head_dim) < 1:
        raise ConfigError(f"{cfg.where}: rank and head_dim must be positive")
    return SemiseparableAttention(cfg.get("scale", float), cfg.get("causal", bool), rank=rank,
                                  band=cfg.get("band", int), hierarchical=cfg.get("hierarchical", bool),
                                  lowrank_dtype=cfg.choice("lowrank_dtype", tuple(LOWRANK_DTYPES)),
                                  head_dim=head_dim)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


KINDS: dict[str, ModuleKind] = {k.name: k for k in (
    ModuleKind(_name(ModeFlag), ModeFlag, lambda m: {}, lambda cfg, children, runtimes: ModeFlag()),
    ModuleKind(_name(ModeGraph), ModeGraph, _mode_graph_config, _mode_graph_build, ("module",)),
    ModuleKind(_name(ModeRefusal), ModeRefusal, lambda m: {"serves_training": m.serves_training, "reason": m.reason},
               _mode_refusal_build),
    ModuleKind(_name(InputGuard), InputGuard, _guard_config, _guard_build),
    ModuleKind(_name(CheckpointRegion), CheckpointRegion, _checkpoint_config, _checkpoint_build, ("body",)),
    ModuleKind(_name(OffloadRegion), OffloadRegion, _offload_config, _offload_build, ("body",)),
    ModuleKind(_name(QuantLinear), QuantLinear, _quant_config, _quant_build, (), ("inner",)),
    ModuleKind(_name(FrozenLinear), FrozenLinear, _frozen_config, _frozen_build),
    ModuleKind(_name(QuantizedWeight), QuantizedWeight, _stored_config, _stored_build),
    ModuleKind(_name(LoRALinear), LoRALinear, _lora_config, _lora_build, ("base",), ("dropout",)),
    ModuleKind(_name(GatedResidual), GatedResidual, _gated_config, _gated_build, ("body",), ("gate",)),
    ModuleKind(_name(HybridAttention), HybridAttention, _hybrid_config, _hybrid_build, (), ("q_proj", "k_proj")),
    ModuleKind(_name(SemiseparableAttention), SemiseparableAttention, _semisep_config, _semisep_build),
)}
_BY_CLASS = {k.cls: k for k in KINDS.values()}


def kind_of(module: nn.Module) -> ModuleKind | None:
    return _BY_CLASS.get(type(module))
