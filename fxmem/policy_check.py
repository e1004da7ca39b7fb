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
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


class ErrorContext:
    """Where values came from, for error messages."""

    def __init__(self, locs: dict[KeyPath, Loc], default_file: str):
        self.locs = locs
        self.default = Loc(default_file)

    def loc(self, path: KeyPath) -> Loc:
        prefix = tuple(path)
        while True:
            if prefix in self.locs:
                return self.locs[prefix]
            if not prefix:
                return self.default
            prefix = prefix[:-1]

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


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def _describe(annotation) -> str:
    """'a bool', "one of 'a', 'b'", 'a list of strings' ... for error messages."""
    if annotation is Any:
        return "anything"
    if annotation is bool:
        return "a bool"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is str:
        return "a string"
    if annotation is Budget:
        return BUDGET_EXAMPLE
    if annotation is Size:
        return SIZE_EXAMPLE
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(_lit(arg) for arg in args)
    if _is_union(annotation):
        parts = [_describe(arg) for arg in args if arg is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " or ".join(parts)
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        inner = args[0] if args else Any
        return "a list" if inner is Any else f"a list of {_plural(inner)}"
    if origin in (dict, Mapping) or annotation is dict:
        return "a mapping"
    if dataclasses.is_dataclass(annotation):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _plural(annotation) -> str:
    plurals = {bool: "bools", int: "integers", float: "numbers", str: "strings"}
    return plurals.get(annotation, f"({_describe(annotation)})")


def _lit(value) -> str:
    return f"'{value}'" if isinstance(value, str) else show_value(value)


def check_dataclass_fields(cls: type, where: str, *, top: bool = True) -> None:
    """Fail at registration, not at load time, if a field cannot be read from YAML."""
    try:
        hints = field_types(cls)
    except Exception as error:  # an annotation that does not resolve
        raise TypeError(f"{where}: cannot resolve field types: {error}") from None
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if top and field.name == "enabled":
            raise TypeError(f"{where}: 'enabled' is reserved for the pass section; remove that field")
        if top and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise TypeError(f"{where}.{field.name}: every option needs a default")
        _check_type(hints[field.name], f"{where}.{field.name}")


def _check_type(annotation, where: str) -> None:
    if annotation in (Any, bool, int, float, str, Budget, Size, list, dict, type(None)):
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if not all(isinstance(arg, (str, int, float, bool)) for arg in args):
            raise TypeError(f"{where}: Literal values must be str, int, float or bool")
        return
    if _is_union(annotation):
        for arg in args:
            _check_type(arg, where)
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
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        check_dataclass_fields(annotation, where, top=False)
        return
    raise TypeError(f"{where}: unsupported option type {annotation!r}")


def convert(value: Any, annotation: Any, path: KeyPath, ctx: ErrorContext) -> Any:
    """Check `value` (plain YAML data) against the type `tp`; return the typed value or raise PolicyError."""
    if annotation is Any:
        return copy.deepcopy(value)
    if annotation is type(None):
        if value is not None:
            ctx.fail(path, f"expected null, got {show_value(value)}")
        return None
    if annotation is bool:
        if not isinstance(value, bool):
            ctx.fail(path, f"expected a bool, got {show_value(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            ctx.fail(path, f"expected an integer, got {show_value(value)}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            ctx.fail(path, f"expected a number, got {show_value(value)}")
        if isinstance(value, float) and math.isnan(value):
            ctx.fail(path, "expected a number, got nan")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            ctx.fail(path, f"expected a string, got {show_value(value)}")
        return value
    if annotation is Budget:
        try:
            return parse_budget(value)
        except ValueError as error:
            ctx.fail(path, str(error))
    if annotation is Size:
        try:
            return Size(parse_size(value))
        except ValueError as error:
            ctx.fail(path, str(error))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        for arg in args:
            if value == arg and type(value) is type(arg):
                return arg
        choices = ", ".join(_lit(arg) for arg in args)
        ctx.fail(path, f"expected one of {choices}, got {show_value(value)}{suggest(value, args)}")
    if _is_union(annotation):
        if value is None:
            if type(None) in args:
                return None
            ctx.fail(path, f"expected {_describe(annotation)}, got null")
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:
            return convert(value, options[0], path, ctx)
        for arg in options:
            try:
                return convert(value, arg, path, ctx)
            except PolicyError:
                continue
        ctx.fail(path, f"expected {_describe(annotation)}, got {show_value(value)}")
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            ctx.fail(path, f"expected {_describe(annotation)}, got {show_value(value)}")
        inner = args[0] if args else Any
        items = [convert(item_value, inner, path + (i,), ctx) for i, item_value in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or annotation is dict:
        if not isinstance(value, Mapping):
            ctx.fail(path, f"expected a mapping, got {show_value(value)}")
        inner = args[1] if args else Any
        out = {}
        for key, item_value in value.items():
            if not isinstance(key, str):
                ctx.fail(path, f"expected string keys, got {show_value(key)}")
            out[key] = convert(item_value, inner, path + (key,), ctx)
        return out
    if dataclasses.is_dataclass(annotation):
        return build_dataclass(annotation, value, path, ctx)
    raise TypeError(f"{format_key_path(path)}: unsupported option type {annotation!r}")


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
    fields = [field for field in dataclasses.fields(cls) if field.init and not field.metadata.get("internal")]
    names = [field.name for field in fields]
    for key in data:
        if key not in names:
            known = list(extra_known) + names
            plural = "options" if noun.startswith("option") else "keys"
            ctx.fail(path + (key,), f"unknown {noun}{suggest(key, known)}; known {plural}: {', '.join(known)}",
                     at="key")
    kwargs = {}
    for field in fields:
        field_path = path + (field.name,)
        if field.name in data:
            parse: Callable | None = field.metadata.get("parse")
            kwargs[field.name] = (parse(data[field.name], field_path, ctx) if parse
                                  else convert(data[field.name], hints[field.name], field_path, ctx))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            ctx.fail(path, f"missing required key '{field.name}'", at="key")
        elif field.metadata.get("parse") and field.default_factory is not dataclasses.MISSING:
            kwargs[field.name] = field.metadata["parse"](field.default_factory(), field_path, ctx)
    try:
        return cls(**kwargs)
    except ValueError as error:
        msg = str(error)
        head, sep, rest = msg.partition(": ")
        if sep and head in names:
            ctx.fail(path + (head,), rest)
        ctx.fail(path, msg, at="key")


def display_file(path: Path, given: str | None = None) -> str:
    if given is not None:
        return given
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else str(path)
    except ValueError:
        return str(path)


def short_source(source: str) -> str:
    return source if source.startswith("<") else display_file(Path(source))
