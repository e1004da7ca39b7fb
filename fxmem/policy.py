"""Policies: YAML -> a typed, validated `Policy`.

A policy says what the user wants (budget, mode, optimizer, which passes with which options); the passes and
the cost model decide what is possible. Schema (version 1):

    version: 1                          # required in every file
    name: high                          # default: the file's stem ("custom" for dicts); not inherited
    description: ...                    # not inherited
    extends: medium                     # a preset name, or a path relative to this file
    mode: train | inference             # default train
    budget: 30% | 6GiB | 0.3 | null     # see fxmem.units
    optimizer: none | sgd | sgd-momentum | adam | adamw | adamw8bit | adam8bit | paged_adamw8bit
    passes:                             # attention, pruning, gating, precision, checkpoint, offload
      checkpoint: {enabled: true, solver: auto}
    verify: {atol: 1e-5, rtol: 1e-4, grad_atol: 1e-5, grad_rtol: 1e-4, seed: 0, enabled: true,
             lossy_tolerance: null, top1_agreement: null, loss_increase: null, metric_tolerance: null,
             outputs: auto, guard_items: 8}   # the guard of lossy changes: fxmem/lossguard.py

Pass sections. `passes.NAME` is a mapping with `enabled` plus the pass's options (`passes.NAME: false` is short for
`{enabled: false}`, an empty section means enabled with defaults). A section that is present without `enabled`
is enabled; inherited and `--set` sections keep the `enabled` they merge onto. An absent section is disabled.
A pass registers its options dataclass (`fxmem.pass_api.register`, or `register_options(name, cls)` for options
alone); its section is then validated against that dataclass (unknown keys, types, defaults) and
`PassSection.options` holds the instance. Unregistered passes keep their keys in `PassSection.raw` with
`options=None`.

Inheritance (`extends`) deep-merges: mappings merge key by key, scalars and lists replace. `overrides` (the CLI's
`--set KEY=VALUE`) merge the same way on top, values read with YAML scalar rules; `Policy.with_overrides` sets
typed values (the Python API's keyword arguments) and validates them the same way.

Every validation error is a `PolicyError` whose message is one line: `FILE:LINE KEY.PATH: what was expected`,
with the file and line the value came from (a parent file for inherited values, `--set '...'` for overrides).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import importlib.resources
import importlib.util
import math
import os
import re
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NamedTuple, Union

import yaml

from . import registry
from .errors import PolicyError
from .units import BUDGET_EXAMPLE, SIZE_EXAMPLE, Budget, Size, format_size, parse_budget, parse_size

__all__ = [
    "Policy", "PassSection", "VerifyOptions", "PolicyError", "Budget", "Size", "KNOWN_PASSES",
    "load_policy", "list_presets", "preset_path", "register_options", "unregister_options", "options_class",
    "registered_options", "check_options_class", "check_pass_name",
]

SCHEMA_VERSION = 1
KNOWN_PASSES: tuple[str, ...] = registry.CANONICAL_ORDER  # the canonical passes, in the order they run

Mode = Literal["train", "inference"]
Optimizer = Literal["none", "sgd", "sgd-momentum", "adam", "adamw", "adamw8bit", "adam8bit", "paged_adamw8bit"]


# ====================================================================================== pass sections
# The table of passes and their options classes is `fxmem.registry`, written by `fxmem.pass_api.register`; these
# functions give a section options without a pass (the policy's own tests, tools).

def register_options(pass_name: str, options_cls: type | None = None, *, replace: bool = False):
    """Register the options dataclass of a pass; the policy validates `passes.<pass_name>` against it.

    Also usable as a decorator: `@register_options("checkpoint")`. Every field needs a default (a disabled or
    empty section still gets a typed instance), `enabled` is reserved, and field types must be ones the validator
    reads: bool, int, float, str, Literal[...], Budget, Size, list[X], tuple[X, ...], dict[str, X], X | None,
    unions, nested dataclasses, Any. Registering the same class again is a no-op; another class for the same
    pass needs replace=True. Names outside KNOWN_PASSES are accepted as extra (test) passes."""
    if options_cls is None:
        return lambda cls: register_options(pass_name, cls, replace=replace)
    check_options_class(pass_name, options_cls)
    registry.set_options(pass_name, options_cls, replace=replace)
    return options_cls


def check_options_class(pass_name: str, options_cls: Any) -> None:
    """Fail now, at registration, if `options_cls` cannot be read from a policy's `passes.<pass_name>` section."""
    check_pass_name(pass_name)
    if not (isinstance(options_cls, type) and dataclasses.is_dataclass(options_cls)):
        raise TypeError(f"options for pass {pass_name!r} must be a dataclass class, got {options_cls!r}")
    _check_options_class(options_cls, f"{options_cls.__qualname__}")


def check_pass_name(pass_name: Any) -> None:
    """A pass name is an identifier (dashes allowed): it is a key of the policy's `passes` mapping."""
    if not isinstance(pass_name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", pass_name):
        raise ValueError(f"pass name must be an identifier, got {pass_name!r}")


def unregister_options(pass_name: str) -> None:
    """Forget a pass's options class (its sections are kept raw again). Unknown names are ignored."""
    registry.set_options(pass_name, None)


def options_class(pass_name: str) -> type | None:
    """The registered options dataclass of a pass, or None."""
    return registry.options_class(pass_name)


@contextlib.contextmanager
def registered_options(mapping: Mapping[str, type] | None = None, *, clear: bool = False) -> Iterator[None]:
    """Temporarily register options classes (tests): restores the previous registry on exit.
    clear=True starts from an empty registry."""
    saved = dict(registry.REGISTRY)
    try:
        if clear:
            registry.REGISTRY.clear()
        for name, cls in (mapping or {}).items():
            register_options(name, cls, replace=True)
        yield
    finally:
        registry.REGISTRY.clear()
        registry.REGISTRY.update(saved)


def _known_passes() -> tuple[str, ...]:
    return registry.known_passes()


# ============================================================================================ the schema
@dataclass(frozen=True)
class VerifyOptions:
    """How each pass is checked. Exact passes must match within atol/rtol (outputs) and grad_atol/grad_rtol
    (gradients). Lossy changes are judged end to end by `fxmem.lossguard` on the guard data (the last `guard_items`
    calibration items, or the example inputs): relative output error at most `lossy_tolerance`, top-1 agreement at
    least `top1_agreement` (class-score outputs), relative loss increase at most `loss_increase` (other outputs,
    with a loss_fn); with an evaluate function, its drop at most `metric_tolerance` instead. A limit left null
    takes the default of each kind of change (`fxmem.lossguard.KIND_LIMITS`). `outputs` says whether outputs
    are class scores (auto: a `logits` entry, or one (batch, classes) / (batch, positions, classes) tensor)."""

    atol: float = 1e-5
    rtol: float = 1e-4
    grad_atol: float = 1e-5
    grad_rtol: float = 1e-4
    lossy_tolerance: float | None = None
    top1_agreement: float | None = None
    loss_increase: float | None = None
    metric_tolerance: float | None = None
    outputs: Literal["auto", "scores", "values"] = "auto"
    guard_items: int = 8
    seed: int = 0
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("atol", "rtol", "grad_atol", "grad_rtol", "lossy_tolerance", "loss_increase",
                     "metric_tolerance"):
            v = getattr(self, name)
            if v is not None and not v >= 0:  # also rejects nan
                raise ValueError(f"{name}: expected a number >= 0, got {v!r}")
        if self.top1_agreement is not None and not 0 <= self.top1_agreement <= 1:
            raise ValueError(f"top1_agreement: expected a share in [0, 1] (0.97 = 97% of predictions unchanged), "
                             f"got {self.top1_agreement!r}")
        if self.guard_items < 1:
            raise ValueError(f"guard_items: expected an integer >= 1, got {self.guard_items!r}")


@dataclass
class PassSection:
    """One `passes.NAME` section. `options` is the registered dataclass instance (None when the pass has no
    registered options class); `raw` is the section as written, minus `enabled`; `line`/`where` say where the
    section came from ("high.yaml:31"), None when it was not written anywhere."""

    enabled: bool
    options: Any
    raw: dict
    line: int | None
    where: str | None = None

    def to_dict(self) -> dict:
        body = _plain(self.options) if self.options is not None else _plain(self.raw)
        return {"enabled": self.enabled, **body}


def _parse_version(value, path, ctx):
    if isinstance(value, bool) or not isinstance(value, int):
        ctx.fail(path, f"expected the integer {SCHEMA_VERSION}, got {_show(value)}")
    if value != SCHEMA_VERSION:
        ctx.fail(path, f"unsupported policy version {value}; this fxmem reads version {SCHEMA_VERSION}")
    return value


def _parse_passes(value, path, ctx) -> dict[str, PassSection]:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        ctx.fail(path, f"expected a mapping of pass names to sections, got {_show(value)}")
    known = _known_passes()
    for name in value:
        if name not in known:
            ctx.fail(path + (name,), f"unknown pass{_suggest(name, known)}; known passes: {', '.join(known)}",
                     at="key")
    out: dict[str, PassSection] = {}
    for name in known:
        cls = options_class(name)
        p = path + (name,)
        if name not in value:
            opts = None
            if cls is not None:
                try:
                    opts = cls()
                except (TypeError, ValueError) as e:
                    ctx.fail(p, f"options class {cls.__qualname__} has no valid defaults: {e}")
            if name in KNOWN_PASSES:
                out[name] = PassSection(enabled=False, options=opts, raw={}, line=None, where=None)
            continue
        sec = value[name]
        if sec is None:
            sec = {}
        if isinstance(sec, bool):
            sec = {"enabled": sec}
        if not isinstance(sec, Mapping):
            ctx.fail(p, f"expected a mapping like {{enabled: true, ...}} or true/false, got {_show(sec)}")
        enabled = sec.get("enabled", True)
        if not isinstance(enabled, bool):
            ctx.fail(p + ("enabled",), f"expected a bool, got {_show(enabled)}")
        raw = {k: copy.deepcopy(v) for k, v in sec.items() if k != "enabled"}
        opts = None
        if cls is not None:
            opts = _build_dataclass(cls, raw, p, ctx, noun=f"option for pass '{name}'",
                                    extra_known=("enabled",))
        loc = ctx.loc(p)
        out[name] = PassSection(enabled=enabled, options=opts, raw=raw, line=loc.line, where=loc.where())
    return out


def _internal(default=None):
    return field(default=default, metadata={"internal": True})


@dataclass(frozen=True)
class Policy:
    """A validated policy. Build it with `load_policy`."""

    version: int = field(metadata={"parse": _parse_version})
    name: str = "custom"
    description: str = ""
    mode: Mode = "train"
    budget: Budget | None = None
    # strict (required): a budget the enabled passes cannot reach is an error (BudgetError, fxmem/budgets.py). Presets
    # use false: a target, the passes go as low as they can and the report says so first. --budget / budget= are
    # strict unless the same call sets budget_strict.
    budget_strict: bool = True
    optimizer: Optimizer = "adamw"
    passes: dict[str, PassSection] = field(default_factory=dict, metadata={"parse": _parse_passes})
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    extends: str | None = None
    source: str = _internal("<dict>")

    @property
    def enabled_passes(self) -> tuple[str, ...]:
        """Names of the enabled passes, in canonical order."""
        return tuple(n for n in self.passes if self.passes[n].enabled)

    def unimplemented_passes(self) -> tuple[str, ...]:
        """Enabled passes whose options class is not registered (their pass is not implemented)."""
        return tuple(n for n in self.enabled_passes if self.passes[n].options is None)

    @property
    def distribution(self) -> str:
        """How the result will be run, as `passes.offload.distributed` declares it: "none", "ddp" or "fsdp" (what
        `fxmem.distribute(module, policy)` runs; the checkpoint pass keeps regions inside blocks for "fsdp")."""
        section = self.passes.get("offload")
        options = section.options if section is not None else None
        return getattr(options, "distributed", None) or "none"

    def section_options(self, name: str, options_cls: type) -> Any:
        """`passes.<name>`'s options as an `options_cls` instance, ready for the pass: the instance validated when
        the policy was read, or (a policy read before the pass registered its options) the section's keys
        validated now; a bad key is a PolicyError naming where the section came from and the key."""
        section = self.passes.get(name)
        if section is not None and isinstance(section.options, options_cls):
            return section.options
        where = section.where if section is not None and section.where else _short(self.source)
        return _build_dataclass(options_cls, section.raw if section is not None else {}, ("passes", name),
                                _Ctx({}, where), noun=f"option for pass '{name}'", extra_known=("enabled",))

    def with_overrides(self, overrides: Mapping[str, Any], *, where: str = "override") -> "Policy":
        """A copy with typed values set at key paths, in order (`{"budget": "40%", "passes.checkpoint.solver":
        "greedy"}`), merged and validated as `--set` values are (`passes.X: False` is short for
        `passes.X.enabled`). A bad key or value is a PolicyError: `WHERE KEY.PATH: what was expected`."""
        policy = self
        for key, value in overrides.items():
            parts = _key_parts(key, where, refused="cannot be overridden; choose the policy file instead")
            policy = _override_passes(policy, parts, value, where) if parts[0] == "passes" else \
                _override_field(policy, parts, value, where)
        return policy

    def to_dict(self) -> dict:
        """The resolved policy as plain data (JSON-ready, fixed key order); `load_policy(p.to_dict())`
        gives an equal policy. `extends` and `source` are left out: the result is already resolved."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("internal") or f.name == "extends":
                continue
            value = getattr(self, f.name)
            if f.name == "passes":
                out["passes"] = {n: s.to_dict() for n, s in value.items()}
            else:
                out[f.name] = _plain(value)
        return out

    def dump_yaml(self) -> str:
        """The resolved policy as YAML (for `fxmem policies show`), with a header naming where it came from."""
        head = f"# resolved policy '{self.name}' from {self.source}"
        if self.extends:
            head += f" (extends {self.extends})"
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True,
                              width=100)
        return head + "\n" + body


# ============================================================================================ locations
class Loc(NamedTuple):
    file: str
    line: int | None = None  # line of the key
    vline: int | None = None  # line of the value

    def where(self, value: bool = False) -> str:
        line = self.vline if value and self.vline is not None else self.line
        return f"{self.file}:{line}" if line else self.file


Path_ = tuple  # a key path: ("passes", "checkpoint", "budget") or with list indices


def _fmt_path(path: Path_) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


class _Ctx:
    """Where values came from, for error messages."""

    def __init__(self, locs: dict[Path_, Loc], default_file: str):
        self.locs = locs
        self.default = Loc(default_file)

    def loc(self, path: Path_) -> Loc:
        p = tuple(path)
        while True:
            if p in self.locs:
                return self.locs[p]
            if not p:
                return self.default
            p = p[:-1]

    def fail(self, path: Path_, what: str, *, at: str = "value"):
        loc = self.loc(path)
        where = loc.where(value=(at == "value" and tuple(path) in self.locs))
        key = _fmt_path(path)
        raise PolicyError(f"{where} {key}: {what}" if key else f"{where}: {what}")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _suggest(word: Any, choices: Sequence[str]) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [c for c in choices if isinstance(c, str)], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ============================================================================================ the validator
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _describe(tp) -> str:
    """'a bool', "one of 'a', 'b'", 'a list of strings' ... for error messages."""
    if tp is Any:
        return "anything"
    if tp is bool:
        return "a bool"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Budget:
        return BUDGET_EXAMPLE
    if tp is Size:
        return SIZE_EXAMPLE
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(_lit(a) for a in args)
    if _is_union(tp):
        parts = [_describe(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " or ".join(parts)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        inner = args[0] if args else Any
        return "a list" if inner is Any else f"a list of {_plural(inner)}"
    if origin in (dict, Mapping) or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _plural(tp) -> str:
    return {bool: "bools", int: "integers", float: "numbers", str: "strings"}.get(tp, f"({_describe(tp)})")


def _lit(v) -> str:
    return f"'{v}'" if isinstance(v, str) else _show(v)


def _check_options_class(cls: type, where: str, *, top: bool = True) -> None:
    """Fail at registration, not at load time, if a field cannot be read from YAML."""
    try:
        hints = _hints(cls)
    except Exception as e:  # an annotation that does not resolve
        raise TypeError(f"{where}: cannot resolve field types: {e}") from None
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if top and f.name == "enabled":
            raise TypeError(f"{where}: 'enabled' is reserved for the pass section; remove that field")
        if top and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise TypeError(f"{where}.{f.name}: every option needs a default")
        _check_type(hints[f.name], f"{where}.{f.name}")


def _check_type(tp, where: str) -> None:
    if tp in (Any, bool, int, float, str, Budget, Size, list, dict, type(None)):
        return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if not all(isinstance(a, (str, int, float, bool)) for a in args):
            raise TypeError(f"{where}: Literal values must be str, int, float or bool")
        return
    if _is_union(tp):
        for a in args:
            _check_type(a, where)
        return
    if origin in (list, Sequence):
        _check_type(args[0] if args else Any, where)
        return
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            _check_type(args[0], where)
            return
        raise TypeError(f"{where}: use tuple[X, ...] (fixed-length tuples are not supported)")
    if origin in (dict, Mapping):
        if args and args[0] is not str:
            raise TypeError(f"{where}: mapping keys must be str")
        if args:
            _check_type(args[1], where)
        return
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        _check_options_class(tp, where, top=False)
        return
    raise TypeError(f"{where}: unsupported option type {tp!r}")


def _convert(value: Any, tp: Any, path: Path_, ctx: _Ctx) -> Any:
    """Check `value` (plain YAML data) against the type `tp`; return the typed value or raise PolicyError."""
    if tp is Any:
        return copy.deepcopy(value)
    if tp is type(None):
        if value is not None:
            ctx.fail(path, f"expected null, got {_show(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            ctx.fail(path, f"expected a bool, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            ctx.fail(path, f"expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            ctx.fail(path, f"expected a number, got {_show(value)}")
        if isinstance(value, float) and math.isnan(value):
            ctx.fail(path, "expected a number, got nan")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            ctx.fail(path, f"expected a string, got {_show(value)}")
        return value
    if tp is Budget:
        try:
            return parse_budget(value)
        except ValueError as e:
            ctx.fail(path, str(e))
    if tp is Size:
        try:
            return Size(parse_size(value))
        except ValueError as e:
            ctx.fail(path, str(e))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        for a in args:
            if value == a and type(value) is type(a):
                return a
        choices = ", ".join(_lit(a) for a in args)
        ctx.fail(path, f"expected one of {choices}, got {_show(value)}{_suggest(value, args)}")
    if _is_union(tp):
        if value is None:
            if type(None) in args:
                return None
            ctx.fail(path, f"expected {_describe(tp)}, got null")
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(value, options[0], path, ctx)
        for a in options:
            try:
                return _convert(value, a, path, ctx)
            except PolicyError:
                continue
        ctx.fail(path, f"expected {_describe(tp)}, got {_show(value)}")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            ctx.fail(path, f"expected {_describe(tp)}, got {_show(value)}")
        inner = args[0] if args else Any
        items = [_convert(v, inner, path + (i,), ctx) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            ctx.fail(path, f"expected a mapping, got {_show(value)}")
        inner = args[1] if args else Any
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                ctx.fail(path, f"expected string keys, got {_show(k)}")
            out[k] = _convert(v, inner, path + (k,), ctx)
        return out
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path, ctx)
    raise TypeError(f"{_fmt_path(path)}: unsupported option type {tp!r}")


def _build_dataclass(cls: type, data: Any, path: Path_, ctx: _Ctx, *, noun: str = "key",
                     extra_known: tuple[str, ...] = ()) -> Any:
    """The one validator: check a mapping against a dataclass's fields (unknown keys, types, required keys),
    fill defaults, build the instance. Fields with metadata {"parse": fn} use fn(value, path, ctx);
    {"internal": True} fields are not user keys. A ValueError from the class (__post_init__) is reported at
    `path`, or at `path.FIELD` when its message reads "FIELD: what was expected"."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        ctx.fail(path, f"expected a mapping, got {_show(data)}")
    hints = _hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")]
    names = [f.name for f in fields]
    for key in data:
        if key not in names:
            known = list(extra_known) + names
            plural = "options" if noun.startswith("option") else "keys"
            ctx.fail(path + (key,), f"unknown {noun}{_suggest(key, known)}; known {plural}: {', '.join(known)}",
                     at="key")
    kwargs = {}
    for f in fields:
        p = path + (f.name,)
        if f.name in data:
            parse: Callable | None = f.metadata.get("parse")
            kwargs[f.name] = parse(data[f.name], p, ctx) if parse else _convert(data[f.name], hints[f.name], p, ctx)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            ctx.fail(path, f"missing required key '{f.name}'", at="key")
        elif f.metadata.get("parse") and f.default_factory is not dataclasses.MISSING:
            kwargs[f.name] = f.metadata["parse"](f.default_factory(), p, ctx)
    try:
        return cls(**kwargs)
    except ValueError as e:
        msg = str(e)
        head, sep, rest = msg.partition(": ")
        if sep and head in names:
            ctx.fail(path + (head,), rest)
        ctx.fail(path, msg, at="key")


def _plain(value: Any) -> Any:
    """Typed values -> plain data (JSON-ready; sizes and budgets as strings that parse back)."""
    if isinstance(value, Budget):
        return str(value)
    if isinstance(value, Size):
        return format_size(value)
    if isinstance(value, PassSection):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ============================================================================================ YAML reading
# Every policy text (files, `extends:` parents, presets, `--set` values) is read with these limits: a policy is a few
# KB, and a hostile document (a "billion laughs" of nested aliases, nesting thousands deep, a huge file) is refused
# in milliseconds, before it is expanded, with a PolicyError naming the file and line.
MAX_POLICY_BYTES = 1 << 20
MAX_DEPTH = 64  # nested mappings and lists
MAX_ALIASES = 256  # `*name` uses in one document
MAX_VALUES = 10_000  # values in one document once its aliases and merge keys (`<<: *base`) are expanded
MAX_EXTENDS = 32  # files in one `extends:` chain
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-5 as a float (YAML 1.1 wants 1.0e-5), and holds the limits above: depth while
    scanning and composing, aliases while composing, the size of merged mappings before they are built (`_walk`
    counts the values)."""

    def __init__(self, text: str, display: str = "<policy>"):
        super().__init__(text)
        self.fxmem_display, self.fxmem_depth, self.fxmem_aliases, self.fxmem_values = display, 0, 0, 0
        self.fxmem_entries: dict[int, int] = {}  # merged size of each mapping node (`fxmem_merged_entries`)
        self.fxmem_top: tuple[str, int] | None = None  # the top-level key being read, and its line

    def fxmem_refuse(self, line: int, what: str) -> PolicyError:
        return PolicyError(f"{self.fxmem_display}:{line}: {what}; policies are read with limits (nesting "
                           f"{MAX_DEPTH}, aliases {MAX_ALIASES}, values {MAX_VALUES}, size {MAX_POLICY_BYTES} bytes)")

    def compose_node(self, parent, index):
        line = self.peek_event().start_mark.line + 1
        if self.check_event(yaml.AliasEvent):
            self.fxmem_aliases += 1
            if self.fxmem_aliases > MAX_ALIASES:
                raise self.fxmem_refuse(line, f"more than {MAX_ALIASES} YAML aliases")
            return super().compose_node(parent, index)
        self.fxmem_depth += 1
        try:
            if self.fxmem_depth > MAX_DEPTH:
                raise self.fxmem_refuse(line, f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self.fxmem_depth -= 1

    def fetch_flow_collection_start(self, token_class):
        # the scanner looks ahead up to 1024 characters with a cost per token that grows with the flow nesting
        # (`[[[[...`): refused here, before the composer sees the first of them
        if self.flow_level >= MAX_DEPTH:
            raise self.fxmem_refuse(self.get_mark().line + 1, f"nested more than {MAX_DEPTH} levels deep")
        super().fetch_flow_collection_start(token_class)

    def flatten_mapping(self, node):
        if self.fxmem_merged_entries(node) > MAX_VALUES:
            raise self.fxmem_refuse(node.start_mark.line + 1, f"its merge keys (<<) expand a mapping to more than "
                                                              f"{MAX_VALUES} entries")
        super().flatten_mapping(node)

    def fxmem_merged_entries(self, node) -> int:
        """Entries of the mapping `node` once its merge keys are expanded, counted without building them."""
        known = self.fxmem_entries.get(id(node))
        if known is not None:
            return known
        self.fxmem_entries[id(node)] = 0  # (a mapping merged into itself adds nothing more)
        count = 0
        for key, value in node.value:
            if key.tag != _MERGE_TAG:
                count += 1
                continue
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            count += sum(self.fxmem_merged_entries(m) for m in sources if isinstance(m, yaml.MappingNode))
            if count > MAX_VALUES:
                break
        self.fxmem_entries[id(node)] = count
        return count


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _check_size(text: str, display: str) -> None:
    size = len(text.encode("utf-8"))
    if size > MAX_POLICY_BYTES:
        raise PolicyError(f"{display}: {size} bytes; a policy is read only up to {MAX_POLICY_BYTES} bytes (1 MiB)")


def _parse_yaml(text: str, display: str) -> tuple[dict, dict[Path_, Loc]]:
    _check_size(text, display)
    loader = _Loader(text, display)
    try:
        try:
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            line = f":{mark.line + 1}" if mark else ""
            col = f" (column {mark.column + 1})" if mark else ""
            raise PolicyError(f"{display}{line}: invalid YAML{col}: {_yaml_problem(e)}") from None
        except yaml.YAMLError as e:
            raise PolicyError(f"{display}: invalid YAML: {' '.join(str(e).split())}") from None
        if root is None:
            raise PolicyError(f"{display}:1: expected a mapping of policy settings, got an empty file")
        if not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else f"{_node_value_show(loader, root)}"
            raise PolicyError(f"{display}:{root.start_mark.line + 1}: expected a mapping of policy settings "
                              f"(version: 1, passes: ...), got {kind}")
        locs: dict[Path_, Loc] = {(): Loc(display, root.start_mark.line + 1, root.start_mark.line + 1)}
        data = _walk(loader, root, (), locs, display, set())
        return data, locs
    finally:
        loader.dispose()


def _yaml_problem(e: yaml.MarkedYAMLError) -> str:
    what = e.problem or e.context or "syntax error"
    if e.context and e.problem:
        at = f" at line {e.context_mark.line + 1}" if e.context_mark else ""
        what += f" ({e.context}{at})"
    return " ".join(what.split())


def _node_value_show(loader, node) -> str:
    try:
        return _show(loader.construct_object(node, deep=True))
    except yaml.YAMLError:
        return "a scalar"


def _walk(loader, node, path: Path_, locs: dict, display: str, active: set) -> Any:
    if id(node) in active:
        raise PolicyError(f"{display}:{node.start_mark.line + 1} {_fmt_path(path)}: recursive YAML alias")
    loader.fxmem_values += 1
    if loader.fxmem_values > MAX_VALUES:  # aliases share nodes: this is where a document would grow
        key, line = loader.fxmem_top or (None, node.start_mark.line + 1)
        raise loader.fxmem_refuse(line, f"{'' if key is None else key + ': '}expands to more than {MAX_VALUES} "
                                        "values (nested YAML aliases)")
    if isinstance(node, yaml.MappingNode):
        active = active | {id(node)}
        flattened = loader.__dict__.setdefault("_fxmem_flattened", set())
        seen: dict[str, int] = {}
        for k, _ in ([] if id(node) in flattened else node.value):
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if k.value in seen:
                    raise PolicyError(f"{display}:{k.start_mark.line + 1} {_fmt_path(path + (k.value,))}: "
                                      f"duplicate key (first at line {seen[k.value]})")
                seen[k.value] = k.start_mark.line + 1
        flattened.add(id(node))
        try:
            loader.flatten_mapping(node)  # YAML merge keys (<<: *base)
        except yaml.MarkedYAMLError as e:
            raise PolicyError(f"{display}:{e.problem_mark.line + 1}: invalid YAML: {e.problem}") from None
        out: dict[str, Any] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise PolicyError(f"{display}:{k.start_mark.line + 1} {_fmt_path(path)}: "
                                  f"expected a string key, got a {'list' if isinstance(k, yaml.SequenceNode) else 'mapping'}")
            key = k.value  # keys are names: 'on', 'yes', '1' stay strings
            p = path + (key,)
            if not path:
                loader.fxmem_top = (key, k.start_mark.line + 1)  # where a document too large to read is said
            out[key] = _walk(loader, v, p, locs, display, active)
            locs[p] = Loc(display, k.start_mark.line + 1, v.start_mark.line + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        active = active | {id(node)}
        items = []
        for i, v in enumerate(node.value):
            p = path + (i,)
            items.append(_walk(loader, v, p, locs, display, active))
            locs[p] = Loc(display, v.start_mark.line + 1, v.start_mark.line + 1)
        return items
    try:
        return loader.construct_object(node, deep=True)
    except yaml.MarkedYAMLError as e:
        raise PolicyError(f"{display}:{node.start_mark.line + 1} {_fmt_path(path)}: {e.problem}") from None


# ============================================================================================ presets
def _builtin_preset_dir():
    """`fxmem.policies` package data when installed; else `<repo>/policies`."""
    try:
        if importlib.util.find_spec("fxmem.policies") is not None:
            return importlib.resources.files("fxmem.policies")
    except (ImportError, ValueError):
        pass
    return Path(__file__).resolve().parent.parent / "policies"


def _preset_dirs(search_dirs) -> list:
    dirs = [Path(d) for d in (search_dirs or ())]
    dirs.append(_builtin_preset_dir())
    return dirs


def list_presets(search_dirs=None) -> list[str]:
    """Names of the presets (builtin and in `search_dirs`), sorted."""
    names = set()
    for d in _preset_dirs(search_dirs):
        try:
            entries = list(d.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if e.is_file() and e.name.endswith((".yaml", ".yml")) and not e.name.startswith("."):
                names.add(e.name.rsplit(".", 1)[0])
    return sorted(names)


def _find_preset(name: str, search_dirs):
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", name):
        for d in _preset_dirs(search_dirs):
            for ext in (".yaml", ".yml"):
                p = d.joinpath(name + ext)
                if p.is_file():
                    return p
    return None


def _unknown_preset(name: str, search_dirs) -> str:
    presets = list_presets(search_dirs)
    text = f"unknown preset '{name}'{_suggest(name, presets)}; presets: {', '.join(presets) or 'none'}"
    if Path(name).is_file():
        text += f" (to load the file '{name}', write ./{name})"
    return text


def preset_path(name: str, search_dirs=None) -> Path:
    """Path of a preset's YAML file. Raises PolicyError for an unknown name."""
    p = _find_preset(name, search_dirs)
    if p is None:
        raise PolicyError(_unknown_preset(name, search_dirs))
    return p


# ============================================================================================ loading
@dataclass
class _Src:
    ident: str  # for cycle detection
    display: str  # in error messages
    source: str  # Policy.source
    stem: str
    base_dir: Path | None  # for relative `extends`
    read: Callable[[], str]


def _looks_like_path(s: str) -> bool:
    return ("/" in s or "\\" in s or s.endswith((".yaml", ".yml")) or s.startswith(".")
            or Path(s).is_absolute())


def _display_file(p: Path, given: str | None = None) -> str:
    if given is not None:
        return given
    try:
        rel = os.path.relpath(p)
        return rel if not rel.startswith("..") else str(p)
    except ValueError:
        return str(p)


def _file_src(p: Path, display: str) -> _Src:
    resolved = p.resolve()

    def read() -> str:
        try:
            with open(resolved, "rb") as f:
                data = f.read(MAX_POLICY_BYTES + 1)  # never more: a huge file is refused, not read into memory
                if len(data) > MAX_POLICY_BYTES:
                    size = os.fstat(f.fileno()).st_size
                    shown = f"{size} bytes" if size > MAX_POLICY_BYTES else f"more than {MAX_POLICY_BYTES} bytes"
                    raise PolicyError(f"{display}: {shown}; a policy is read only up to {MAX_POLICY_BYTES} bytes "
                                      "(1 MiB)")
            return data.decode("utf-8")
        except FileNotFoundError:
            raise PolicyError(f"{display}: no such policy file") from None
        except UnicodeDecodeError as e:
            raise PolicyError(f"{display}: not a UTF-8 text file ({e.reason})") from None
        except OSError as e:
            raise PolicyError(f"{display}: cannot read policy file: {e.strerror or e}") from None

    return _Src(ident=str(resolved), display=display, source=str(p), stem=p.name.rsplit(".", 1)[0],
                base_dir=resolved.parent, read=read)


def _preset_src(name: str, found) -> _Src:
    if isinstance(found, Path):
        src = _file_src(found, found.name)
        src.stem = name
        return src
    return _Src(ident=f"preset:{found}", display=found.name, source=str(found), stem=name, base_dir=None,
                read=lambda: found.read_text(encoding="utf-8"))


def _resolve_ref(ref: str, base_dir: Path | None, search_dirs, fail: Callable[[str], None]) -> _Src:
    """`extends:` value -> the parent's source. `fail(msg)` raises at the extends key."""
    if _looks_like_path(ref):
        p = Path(ref).expanduser()
        if not p.is_absolute():
            if base_dir is None:
                fail(f"cannot resolve the relative path '{ref}' from a packaged preset")
            p = base_dir / p
        if not p.is_file():
            fail(f"policy file not found: {ref} (looked at {p})")
        return _file_src(p, _display_file(p))
    found = _find_preset(ref, search_dirs)
    if found is None:
        fail(_unknown_preset(ref, search_dirs))
    return _preset_src(ref, found)


def _drop(data: dict, locs: dict, key: str) -> None:
    data.pop(key, None)
    for p in [p for p in locs if p[:1] == (key,)]:
        del locs[p]


def _normalize_passes(data: dict, locs: dict) -> None:
    """`passes.X: true/false` -> `{enabled: ...}`, `passes.X:` (null) -> `{}`; so that merging keeps options."""
    passes = data.get("passes")
    if not isinstance(passes, dict):
        return
    for name, sec in list(passes.items()):
        if isinstance(sec, bool):
            passes[name] = {"enabled": sec}
            loc = locs.get(("passes", name))
            if loc is not None:
                locs[("passes", name, "enabled")] = loc
        elif sec is None:
            passes[name] = {}


def _merge(dst: dict, dst_locs: dict, src: dict, src_locs: dict, path: Path_ = ()) -> None:
    """Deep merge `src` onto `dst` in place: mappings merge key by key, everything else replaces."""
    for k, v in src.items():
        p = path + (k,)
        if k in dst and isinstance(dst[k], dict) and isinstance(v, dict):
            if p in src_locs:
                dst_locs[p] = src_locs[p]
            _merge(dst[k], dst_locs, v, src_locs, p)
        else:
            dst[k] = copy.deepcopy(v)
            n = len(p)
            for q in [q for q in dst_locs if q[:n] == p]:
                del dst_locs[q]
            for q, loc in src_locs.items():
                if q[:n] == p:
                    dst_locs[q] = loc


def _check_file_basics(data: dict, locs: dict, display: str) -> None:
    ctx = _Ctx(locs, display)
    if "version" not in data:
        ctx.fail(("version",), f"missing; every policy file starts with 'version: {SCHEMA_VERSION}'", at="key")
    _parse_version(data["version"], ("version",), ctx)
    ext = data.get("extends")
    if ext is not None and (not isinstance(ext, str) or not ext.strip()):
        ctx.fail(("extends",), f"expected a preset name or a path to a .yaml file, got {_show(ext)}")


def _load_chain(src: _Src, search_dirs, stack: tuple[_Src, ...]) -> tuple[dict, dict]:
    data, locs = _parse_yaml(src.read(), src.display)
    _check_file_basics(data, locs, src.display)
    _normalize_passes(data, locs)
    data.setdefault("name", src.stem)
    ext = data.get("extends")
    if ext is None:
        return data, locs
    ctx = _Ctx(locs, src.display)

    def fail(msg: str):
        ctx.fail(("extends",), msg)

    parent = _resolve_ref(ext, src.base_dir, search_dirs, fail)
    chain = stack + (src,)
    if len(chain) >= MAX_EXTENDS:
        fail(f"the extends chain is longer than {MAX_EXTENDS} files")
    if any(s.ident == parent.ident for s in chain):
        start = next(i for i, s in enumerate(chain) if s.ident == parent.ident)
        names = [s.display for s in chain[start:]] + [parent.display]
        short = [Path(n).name for n in names]
        if len(set(short)) == len(set(names)):  # file names are unambiguous: keep the message short
            names = short
        cycle = " -> ".join(names)
        fail(f"extends cycle: {cycle}")
    pdata, plocs = _load_chain(parent, search_dirs, chain)
    for key in ("name", "description", "extends"):  # a file's identity is not inherited
        _drop(pdata, plocs, key)
    _merge(pdata, plocs, data, locs)
    plocs[()] = locs[()]
    return pdata, plocs


def _override_where(text: str) -> str:
    q = shlex.quote(text)
    return f"--set {q if q != text else repr(text)}"


def _key_parts(key: Any, where: str, *, refused: str) -> list[str]:
    """`passes.checkpoint.solver` -> its parts; `extends` and `source` are refused with `refused`."""
    if not isinstance(key, str):
        raise PolicyError(f"{where}: expected a key path like passes.checkpoint.solver, got {_show(key)}")
    parts = key.split(".")
    if not key or any(not p.strip() for p in parts):
        raise PolicyError(f"{where}: '{key}' is not a key path like passes.checkpoint.solver")
    parts = [p.strip() for p in parts]
    if parts[0] in ("extends", "source"):
        raise PolicyError(f"{where} {parts[0]}: {refused}")
    return parts


def _apply_override(data: dict, locs: dict, text: str) -> None:
    where = _override_where(text)
    if not isinstance(text, str) or "=" not in text:
        raise PolicyError(f"{where}: expected KEY=VALUE, e.g. passes.checkpoint.solver=greedy")
    key, _, raw = text.partition("=")
    parts = _key_parts(key.strip(), where, refused="cannot be set with --set; choose the policy file instead")
    try:
        value = _parse_value(raw, where) if raw.strip() else None
    except yaml.MarkedYAMLError as e:
        raise PolicyError(f"{where}: cannot read the value {raw!r}: {_yaml_problem(e)}") from None
    except yaml.YAMLError as e:
        raise PolicyError(f"{where}: cannot read the value {raw!r}: {' '.join(str(e).split())}") from None
    _set_value(data, locs, parts, value, where)


def _set_value(data: dict, locs: dict, parts: list[str], value: Any, where: str) -> None:
    """Set `value` at the key path `parts` of plain policy data (making mappings on the way), every location
    under it `where`; `passes.X: <bool>` is short for `passes.X.enabled`."""
    if len(parts) == 2 and parts[0] == "passes" and isinstance(value, bool):
        parts = parts + ["enabled"]
    loc = Loc(where)
    node = data
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
            locs[tuple(parts[: i + 1])] = loc
        elif not isinstance(nxt, dict):
            raise PolicyError(f"{where} {'.'.join(parts[: i + 1])}: is {_show(nxt)}, not a mapping, so "
                              f"'{'.'.join(parts[i + 1:])}' cannot be set inside it")
        node = nxt
    p = tuple(parts)
    n = len(p)
    for q in [q for q in locs if q[:n] == p]:
        del locs[q]
    node[parts[-1]] = value
    locs[p] = loc
    if isinstance(value, (dict, list)):
        def mark(v, q):
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, sub in items:
                locs[q + (k,)] = loc
                if isinstance(sub, (dict, list)):
                    mark(sub, q + (k,))
        mark(value, p)
    if p[:1] == ("passes",) and n == 2:
        _normalize_passes(data, locs)


def _parse_value(raw: str, where: str) -> Any:
    """A `--set` value, read as a policy file's values are (same limits; keys stay strings)."""
    _check_size(raw, where)
    loader = _Loader(raw, where)
    try:
        node = loader.get_single_node()
        return None if node is None else _walk(loader, node, (), {}, where, set())
    finally:
        loader.dispose()


def _override_field(policy: Policy, parts: list[str], value: Any, where: str) -> Policy:
    """`policy` with a top-level key (or a key inside one: `verify.atol`) set to `value`, validated."""
    fields = {f.name: f for f in dataclasses.fields(Policy) if f.init and not f.metadata.get("internal")}
    top = parts[0]
    if top not in fields:
        raise PolicyError(f"{where} {top}: unknown key{_suggest(top, list(fields))}; known keys: {', '.join(fields)}")
    data = {top: _plain(getattr(policy, top))}
    locs: dict = {}
    _set_value(data, locs, parts, value, where)
    ctx = _Ctx(locs, where)
    parse = fields[top].metadata.get("parse")
    typed = parse(data[top], (top,), ctx) if parse else _convert(data[top], _hints(Policy)[top], (top,), ctx)
    return dataclasses.replace(policy, **{top: typed})


def _override_passes(policy: Policy, parts: list[str], value: Any, where: str) -> Policy:
    """`policy` with `passes` (or one section, or a key inside one) set to `value`, validated. A section the policy
    did not write starts empty (so it is enabled, as a `--set` on it enables it); a written one keeps its keys."""
    if len(parts) == 1:
        data, locs = {"passes": None}, {}
        _set_value(data, locs, parts, value, where)
        return dataclasses.replace(policy, passes=_parse_passes(data["passes"], ("passes",), _Ctx(locs, where)))
    name = parts[1]
    old = policy.passes.get(name)
    written = old is not None and old.where is not None
    data = {"passes": {name: {"enabled": old.enabled, **copy.deepcopy(old.raw)} if written else {}}}
    locs = {("passes", name): Loc(old.where)} if written else {}
    _set_value(data, locs, parts, value, where)
    section = _parse_passes({name: data["passes"][name]}, ("passes",), _Ctx(locs, where))[name]
    if written and (len(parts) > 2 or isinstance(value, bool)):  # (a key inside it: where it was written stays)
        section = dataclasses.replace(section, line=old.line, where=old.where)
    passes = {**policy.passes, name: section}
    order = [n for n in _known_passes() if n in passes] + [n for n in passes if n not in _known_passes()]
    return dataclasses.replace(policy, passes={n: passes[n] for n in order})


def _dict_data(spec: Mapping) -> tuple[dict, dict]:
    def plain(v, path):
        if len(path) > MAX_DEPTH:  # the YAML reader's limit; a dict that holds itself reaches it too
            raise PolicyError(f"<dict> {_fmt_path(path[:3])}...: nested more than {MAX_DEPTH} levels deep "
                              "(a dict or list that contains itself?)")
        if isinstance(v, Mapping):
            out = {}
            for k, sub in v.items():
                if not isinstance(k, str):
                    raise PolicyError(f"<dict> {_fmt_path(path)}: expected string keys, got {_show(k)}"
                                      if path else f"<dict>: expected string keys, got {_show(k)}")
                out[k] = plain(sub, path + (k,))
            return out
        if isinstance(v, (list, tuple)):
            return [plain(x, path + (i,)) for i, x in enumerate(v)]
        return copy.deepcopy(v)
    return plain(spec, ()), {}


def load_policy(spec: Any, *, overrides: Sequence[str] = (), search_dirs=None) -> Policy:
    """Load and validate a policy.

    spec: a preset name ("high"), a path to a .yaml file (str or Path), a dict with the policy schema, or a
    Policy (returned as is when there are no overrides). overrides: `--set` strings like
    "passes.checkpoint.solver=greedy", "budget=40%". search_dirs: directories searched for preset names before
    the builtin presets (also for `extends`). Raises PolicyError with a one-line message naming file:line and key.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    if isinstance(spec, Policy):
        if not overrides:
            return spec
        data, locs, display, source, extends = spec.to_dict(), {}, _short(spec.source), spec.source, spec.extends
    elif isinstance(spec, Mapping):
        data, locs = _dict_data(spec)
        display = source = "<dict>"
        _check_file_basics(data, locs, display)
        _normalize_passes(data, locs)
        extends = data.get("extends")
        if extends is not None:
            src = _Src(ident="<dict>", display="<dict>", source="<dict>", stem="custom", base_dir=Path.cwd(),
                       read=lambda: "")
            ctx = _Ctx(locs, display)
            parent = _resolve_ref(extends, Path.cwd(), search_dirs, lambda m: ctx.fail(("extends",), m))
            pdata, plocs = _load_chain(parent, search_dirs, (src,))
            for key in ("name", "description", "extends"):
                _drop(pdata, plocs, key)
            _merge(pdata, plocs, data, locs)
            data, locs = pdata, plocs
    elif isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if isinstance(spec, os.PathLike) or _looks_like_path(text):
            p = Path(text).expanduser()
            if not p.is_file():
                hint = ""
                if not p.is_dir() and _find_preset(p.name.rsplit(".", 1)[0], search_dirs) is not None:
                    hint = f" (did you mean the preset '{p.name.rsplit('.', 1)[0]}'?)"
                raise PolicyError(f"{text}: no such policy file{hint}" if not p.is_dir()
                                  else f"{text}: is a directory, not a policy file")
            src = _file_src(p, text)
        else:
            found = _find_preset(text, search_dirs)
            if found is None:
                raise PolicyError(_unknown_preset(text, search_dirs))
            src = _preset_src(text, found)
        data, locs = _load_chain(src, search_dirs, ())
        display, source, extends = src.display, src.source, data.get("extends")
    else:
        raise PolicyError(f"expected a preset name, a .yaml path, a mapping or a Policy, got {type(spec).__name__}")
    for text in overrides:
        _apply_override(data, locs, text)
    ctx = _Ctx(locs, display)
    data = dict(data)
    data.pop("extends", None)
    policy = _build_dataclass(Policy, data, (), ctx)
    return dataclasses.replace(policy, source=source, extends=extends)


def _short(source: str) -> str:
    return source if source.startswith("<") else _display_file(Path(source))
