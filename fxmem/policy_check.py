"""The policy's one validator: plain YAML data checked against a dataclass's fields and types, with errors that
name the file, line and key path the value came from."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple, Union

from .errors import PolicyError
from .units import BUDGET_EXAMPLE, SIZE_EXAMPLE, Budget, Size, parse_budget, parse_size


class Loc(NamedTuple):
    file: str
    line: int | None = None  # line of the key
    vline: int | None = None  # line of the value

    def where(self, value: bool = False) -> str:
        line = self.vline if value and self.vline is not None else self.line
        return f"{self.file}:{line}" if line else self.file


KeyPath = tuple  # a key path: ("passes", "checkpoint", "budget") or with list indices


def format_key_path(path: KeyPath) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


class ErrorContext:
    """Where values came from, for error messages."""

    def __init__(self, locs: dict[KeyPath, Loc], default_file: str):
        self.locs = locs
        self.default = Loc(default_file)

    def loc(self, path: KeyPath) -> Loc:
        p = tuple(path)
        while True:
            if p in self.locs:
                return self.locs[p]
            if not p:
                return self.default
            p = p[:-1]

    def fail(self, path: KeyPath, what: str, *, at: str = "value"):
        loc = self.loc(path)
        where = loc.where(value=(at == "value" and tuple(path) in self.locs))
        key = format_key_path(path)
        raise PolicyError(f"{where} {key}: {what}" if key else f"{where}: {what}")


def show_value(value: Any) -> str:
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


def suggest(word: Any, choices: Sequence[str]) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [c for c in choices if isinstance(c, str)], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def field_types(cls: type) -> dict[str, Any]:
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
    return f"'{v}'" if isinstance(v, str) else show_value(v)


def check_dataclass_fields(cls: type, where: str, *, top: bool = True) -> None:
    """Fail at registration, not at load time, if a field cannot be read from YAML."""
    try:
        hints = field_types(cls)
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
        check_dataclass_fields(tp, where, top=False)
        return
    raise TypeError(f"{where}: unsupported option type {tp!r}")


def convert(value: Any, tp: Any, path: KeyPath, ctx: ErrorContext) -> Any:
    """Check `value` (plain YAML data) against the type `tp`; return the typed value or raise PolicyError."""
    if tp is Any:
        return copy.deepcopy(value)
    if tp is type(None):
        if value is not None:
            ctx.fail(path, f"expected null, got {show_value(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            ctx.fail(path, f"expected a bool, got {show_value(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            ctx.fail(path, f"expected an integer, got {show_value(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            ctx.fail(path, f"expected a number, got {show_value(value)}")
        if isinstance(value, float) and math.isnan(value):
            ctx.fail(path, "expected a number, got nan")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            ctx.fail(path, f"expected a string, got {show_value(value)}")
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
        ctx.fail(path, f"expected one of {choices}, got {show_value(value)}{suggest(value, args)}")
    if _is_union(tp):
        if value is None:
            if type(None) in args:
                return None
            ctx.fail(path, f"expected {_describe(tp)}, got null")
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return convert(value, options[0], path, ctx)
        for a in options:
            try:
                return convert(value, a, path, ctx)
            except PolicyError:
                continue
        ctx.fail(path, f"expected {_describe(tp)}, got {show_value(value)}")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            ctx.fail(path, f"expected {_describe(tp)}, got {show_value(value)}")
        inner = args[0] if args else Any
        items = [convert(v, inner, path + (i,), ctx) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            ctx.fail(path, f"expected a mapping, got {show_value(value)}")
        inner = args[1] if args else Any
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                ctx.fail(path, f"expected string keys, got {show_value(k)}")
            out[k] = convert(v, inner, path + (k,), ctx)
        return out
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path, ctx)
    raise TypeError(f"{format_key_path(path)}: unsupported option type {tp!r}")


def build_dataclass(cls: type, data: Any, path: KeyPath, ctx: ErrorContext, *, noun: str = "key",
                     extra_known: tuple[str, ...] = ()) -> Any:
    """The one validator: check a mapping against a dataclass's fields (unknown keys, types, required keys),
    fill defaults, build the instance. Fields with metadata {"parse": fn} use fn(value, path, ctx);
    {"internal": True} fields are not user keys. A ValueError from the class (__post_init__) is reported at
    `path`, or at `path.FIELD` when its message reads "FIELD: what was expected"."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        ctx.fail(path, f"expected a mapping, got {show_value(data)}")
    hints = field_types(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")]
    names = [f.name for f in fields]
    for key in data:
        if key not in names:
            known = list(extra_known) + names
            plural = "options" if noun.startswith("option") else "keys"
            ctx.fail(path + (key,), f"unknown {noun}{suggest(key, known)}; known {plural}: {', '.join(known)}",
                     at="key")
    kwargs = {}
    for f in fields:
        p = path + (f.name,)
        if f.name in data:
            parse: Callable | None = f.metadata.get("parse")
            kwargs[f.name] = parse(data[f.name], p, ctx) if parse else convert(data[f.name], hints[f.name], p, ctx)
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


def display_file(p: Path, given: str | None = None) -> str:
    if given is not None:
        return given
    try:
        rel = os.path.relpath(p)
        return rel if not rel.startswith("..") else str(p)
    except ValueError:
        return str(p)


def short_source(source: str) -> str:
    return source if source.startswith("<") else display_file(Path(source))
