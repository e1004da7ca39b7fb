"""Policies: YAML -> a typed, validated `Policy` (what the user wants: budget, mode, optimizer, which passes with
which options). The schema, the pass sections' rules and the errors: docs/design/policy.md. Reading and validating
a policy: `fxmem.policy_loader.load_policy`.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import yaml

from . import registry
from .errors import PolicyError
from .policy_check import (ErrorContext, Loc, build_dataclass, check_dataclass_fields, convert, field_types,
                           short_source, show_value, suggest)
from .policy_data import key_parts, set_value
from .units import Budget, Size, format_size

__all__ = [
    "Policy", "PassSection", "VerifyOptions", "PolicyError", "Budget", "Size", "KNOWN_PASSES", "register_options",
    "unregister_options", "options_class", "registered_options", "check_options_class", "check_pass_name",
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
    check_dataclass_fields(options_cls, f"{options_cls.__qualname__}")


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
            value = getattr(self, name)
            if value is not None and not value >= 0:  # also rejects nan
                raise ValueError(f"{name}: expected a number >= 0, got {value!r}")
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


def parse_version(value, path, ctx):
    if isinstance(value, bool) or not isinstance(value, int):
        ctx.fail(path, f"expected the integer {SCHEMA_VERSION}, got {show_value(value)}")
    if value != SCHEMA_VERSION:
        ctx.fail(path, f"unsupported policy version {value}; this fxmem reads version {SCHEMA_VERSION}")
    return value


def _parse_passes(value, path, ctx) -> dict[str, PassSection]:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        ctx.fail(path, f"expected a mapping of pass names to sections, got {show_value(value)}")
    known = _known_passes()
    for name in value:
        if name not in known:
            ctx.fail(path + (name,), f"unknown pass{suggest(name, known)}; known passes: {', '.join(known)}",
                     at="key")
    out: dict[str, PassSection] = {}
    for name in known:
        cls = options_class(name)
        section_path = path + (name,)
        if name not in value:
            opts = None
            if cls is not None:
                try:
                    opts = cls()
                except (TypeError, ValueError) as error:
                    ctx.fail(section_path, f"options class {cls.__qualname__} has no valid defaults: {error}")
            if name in KNOWN_PASSES:
                out[name] = PassSection(enabled=False, options=opts, raw={}, line=None, where=None)
            continue
        sec = value[name]
        if sec is None:
            sec = {}
        if isinstance(sec, bool):
            sec = {"enabled": sec}
        if not isinstance(sec, Mapping):
            ctx.fail(section_path,
                     f"expected a mapping like {{enabled: true, ...}} or true/false, got {show_value(sec)}")
        enabled = sec.get("enabled", True)
        if not isinstance(enabled, bool):
            ctx.fail(section_path + ("enabled",), f"expected a bool, got {show_value(enabled)}")
        raw = {k: copy.deepcopy(v) for k, v in sec.items() if k != "enabled"}
        opts = None
        if cls is not None:
            opts = build_dataclass(cls, raw, section_path, ctx, noun=f"option for pass '{name}'",
                                    extra_known=("enabled",))
        loc = ctx.loc(section_path)
        out[name] = PassSection(enabled=enabled, options=opts, raw=raw, line=loc.line, where=loc.where())
    return out


def _internal(default=None):
    return field(default=default, metadata={"internal": True})


@dataclass(frozen=True)
class Policy:
    """A validated policy. Build it with `load_policy`."""

    version: int = field(metadata={"parse": parse_version})
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
        where = section.where if section is not None and section.where else short_source(self.source)
        return build_dataclass(options_cls, section.raw if section is not None else {}, ("passes", name),
                                ErrorContext({}, where), noun=f"option for pass '{name}'", extra_known=("enabled",))

    def with_overrides(self, overrides: Mapping[str, Any], *, where: str = "override") -> "Policy":
        """A copy with typed values set at key paths, in order (`{"budget": "40%", "passes.checkpoint.solver":
        "greedy"}`), merged and validated as `--set` values are (`passes.X: False` is short for
        `passes.X.enabled`). A bad key or value is a PolicyError: `WHERE KEY.PATH: what was expected`."""
        policy = self
        for key, value in overrides.items():
            parts = key_parts(key, where, refused="cannot be overridden; choose the policy file instead")
            policy = _override_passes(policy, parts, value, where) if parts[0] == "passes" else \
                _override_field(policy, parts, value, where)
        return policy

    def to_dict(self) -> dict:
        """The resolved policy as plain data (JSON-ready, fixed key order); `load_policy(p.to_dict())`
        gives an equal policy. `extends` and `source` are left out: the result is already resolved."""
        out: dict[str, Any] = {}
        for field_info in dataclasses.fields(self):
            if field_info.metadata.get("internal") or field_info.name == "extends":
                continue
            value = getattr(self, field_info.name)
            if field_info.name == "passes":
                out["passes"] = {n: s.to_dict() for n, s in value.items()}
            else:
                out[field_info.name] = _plain(value)
        return out

    def dump_yaml(self) -> str:
        """The resolved policy as YAML (for `fxmem policies show`), with a header naming where it came from."""
        head = f"# resolved policy '{self.name}' from {self.source}"
        if self.extends:
            head += f" (extends {self.extends})"
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True,
                              width=100)
        return head + "\n" + body


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


def _override_field(policy: Policy, parts: list[str], value: Any, where: str) -> Policy:
    """`policy` with a top-level key (or a key inside one: `verify.atol`) set to `value`, validated."""
    fields = {f.name: f for f in dataclasses.fields(Policy) if f.init and not f.metadata.get("internal")}
    top = parts[0]
    if top not in fields:
        raise PolicyError(f"{where} {top}: unknown key{suggest(top, list(fields))}; known keys: {', '.join(fields)}")
    data = {top: _plain(getattr(policy, top))}
    locs: dict = {}
    set_value(data, locs, parts, value, where)
    ctx = ErrorContext(locs, where)
    parse = fields[top].metadata.get("parse")
    typed = parse(data[top], (top,), ctx) if parse else convert(data[top], field_types(Policy)[top], (top,), ctx)
    return dataclasses.replace(policy, **{top: typed})


def _override_passes(policy: Policy, parts: list[str], value: Any, where: str) -> Policy:
    """`policy` with `passes` (or one section, or a key inside one) set to `value`, validated. A section the policy
    did not write starts empty (so it is enabled, as a `--set` on it enables it); a written one keeps its keys."""
    if len(parts) == 1:
        data, locs = {"passes": None}, {}
        set_value(data, locs, parts, value, where)
        return dataclasses.replace(policy, passes=_parse_passes(data["passes"], ("passes",), ErrorContext(locs, where)))
    name = parts[1]
    old = policy.passes.get(name)
    written = old is not None and old.where is not None
    data = {"passes": {name: {"enabled": old.enabled, **copy.deepcopy(old.raw)} if written else {}}}
    locs = {("passes", name): Loc(old.where)} if written else {}
    set_value(data, locs, parts, value, where)
    section = _parse_passes({name: data["passes"][name]}, ("passes",), ErrorContext(locs, where))[name]
    if written and (len(parts) > 2 or isinstance(value, bool)):  # (a key inside it: where it was written stays)
        section = dataclasses.replace(section, line=old.line, where=old.where)
    passes = {**policy.passes, name: section}
    order = [n for n in _known_passes() if n in passes] + [n for n in passes if n not in _known_passes()]
    return dataclasses.replace(policy, passes={n: passes[n] for n in order})
