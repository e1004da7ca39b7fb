"""Loading a policy: a preset name, a YAML file, a dict or a Policy, with its `extends:` chain and `--set`
overrides, validated into a typed `fxmem.policy.Policy`.

Inheritance (`extends`) deep-merges: mappings merge key by key, scalars and lists replace. `overrides` (the CLI's
`--set KEY=VALUE`) merge the same way on top, values read with YAML scalar rules; `Policy.with_overrides` sets
typed values (the Python API's keyword arguments) and validates them the same way.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from .errors import PolicyError
from .policy import SCHEMA_VERSION, Policy, parse_version
from .policy_check import ErrorContext, build_dataclass, display_file, format_key_path, short_source, show_value
from .policy_data import drop_key, key_parts, merge, normalize_passes, set_value
from .policy_presets import find_preset, unknown_preset
from .policy_yaml import MAX_DEPTH, MAX_EXTENDS, MAX_POLICY_BYTES, parse_value, parse_yaml, yaml_problem


@dataclass
class _Src:
    ident: str  # for cycle detection
    display: str  # in error messages
    source: str  # Policy.source
    stem: str
    base_dir: Path | None  # for relative `extends`
    read: Callable[[], str]


def _looks_like_path(text: str) -> bool:
    return ("/" in text or "\\" in text or text.endswith((".yaml", ".yml")) or text.startswith(".")
            or Path(text).is_absolute())


def _file_src(path: Path, display: str) -> _Src:
    resolved = path.resolve()

    def read() -> str:
        try:
            with open(resolved, "rb") as file:
                data = file.read(MAX_POLICY_BYTES + 1)  # never more: a huge file is refused, not read into memory
                if len(data) > MAX_POLICY_BYTES:
                    size = os.fstat(file.fileno()).st_size
                    shown = f"{size} bytes" if size > MAX_POLICY_BYTES else f"more than {MAX_POLICY_BYTES} bytes"
                    raise PolicyError(f"{display}: {shown}; a policy is read only up to {MAX_POLICY_BYTES} bytes "
                                      "(1 MiB)")
            return data.decode("utf-8")
        except FileNotFoundError:
            raise PolicyError(f"{display}: no such policy file") from None
        except UnicodeDecodeError as error:
            raise PolicyError(f"{display}: not a UTF-8 text file ({error.reason})") from None
        except OSError as error:
            raise PolicyError(f"{display}: cannot read policy file: {error.strerror or error}") from None

    return _Src(ident=str(resolved), display=display, source=str(path), stem=path.name.rsplit(".", 1)[0],
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
        path = Path(ref).expanduser()
        if not path.is_absolute():
            if base_dir is None:
                fail(f"cannot resolve the relative path '{ref}' from a packaged preset")
            path = base_dir / path
        if not path.is_file():
            fail(f"policy file not found: {ref} (looked at {path})")
        return _file_src(path, display_file(path))
    found = find_preset(ref, search_dirs)
    if found is None:
        fail(unknown_preset(ref, search_dirs))
    return _preset_src(ref, found)


def _check_file_basics(data: dict, locs: dict, display: str) -> None:
    ctx = ErrorContext(locs, display)
    if "version" not in data:
        ctx.fail(("version",), f"missing; every policy file starts with 'version: {SCHEMA_VERSION}'", at="key")
    parse_version(data["version"], ("version",), ctx)
    ext = data.get("extends")
    if ext is not None and (not isinstance(ext, str) or not ext.strip()):
        ctx.fail(("extends",), f"expected a preset name or a path to a .yaml file, got {show_value(ext)}")


def _load_chain(src: _Src, search_dirs, stack: tuple[_Src, ...]) -> tuple[dict, dict]:
    data, locs = parse_yaml(src.read(), src.display)
    _check_file_basics(data, locs, src.display)
    normalize_passes(data, locs)
    data.setdefault("name", src.stem)
    ext = data.get("extends")
    if ext is None:
        return data, locs
    ctx = ErrorContext(locs, src.display)

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
        drop_key(pdata, plocs, key)
    merge(pdata, plocs, data, locs)
    plocs[()] = locs[()]
    return pdata, plocs


def _override_where(text: str) -> str:
    quoted = shlex.quote(text)
    return f"--set {quoted if quoted != text else repr(text)}"


def _apply_override(data: dict, locs: dict, text: str) -> None:
    where = _override_where(text)
    if not isinstance(text, str) or "=" not in text:
        raise PolicyError(f"{where}: expected KEY=VALUE, e.g. passes.checkpoint.solver=greedy")
    key, _, raw = text.partition("=")
    parts = key_parts(key.strip(), where, refused="cannot be set with --set; choose the policy file instead")
    try:
        value = parse_value(raw, where) if raw.strip() else None
    except yaml.MarkedYAMLError as error:
        raise PolicyError(f"{where}: cannot read the value {raw!r}: {yaml_problem(error)}") from None
    except yaml.YAMLError as error:
        raise PolicyError(f"{where}: cannot read the value {raw!r}: {' '.join(str(error).split())}") from None
    set_value(data, locs, parts, value, where)


def _dict_data(spec: Mapping) -> tuple[dict, dict]:
    def plain(value, path):
        if len(path) > MAX_DEPTH:  # the YAML reader's limit; a dict that holds itself reaches it too
            raise PolicyError(f"<dict> {format_key_path(path[:3])}...: nested more than {MAX_DEPTH} levels deep "
                              "(a dict or list that contains itself?)")
        if isinstance(value, Mapping):
            out = {}
            for key, sub in value.items():
                if not isinstance(key, str):
                    raise PolicyError(f"<dict> {format_key_path(path)}: expected string keys, got {show_value(key)}"
                                      if path else f"<dict>: expected string keys, got {show_value(key)}")
                out[key] = plain(sub, path + (key,))
            return out
        if isinstance(value, (list, tuple)):
            return [plain(x, path + (i,)) for i, x in enumerate(value)]
        return copy.deepcopy(value)
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
        data, locs, display, source, extends = spec.to_dict(), {}, short_source(spec.source), spec.source, spec.extends
    elif isinstance(spec, Mapping):
        data, locs = _dict_data(spec)
        display = source = "<dict>"
        _check_file_basics(data, locs, display)
        normalize_passes(data, locs)
        extends = data.get("extends")
        if extends is not None:
            src = _Src(ident="<dict>", display="<dict>", source="<dict>", stem="custom", base_dir=Path.cwd(),
                       read=lambda: "")
            ctx = ErrorContext(locs, display)
            parent = _resolve_ref(extends, Path.cwd(), search_dirs, lambda m: ctx.fail(("extends",), m))
            pdata, plocs = _load_chain(parent, search_dirs, (src,))
            for key in ("name", "description", "extends"):
                drop_key(pdata, plocs, key)
            merge(pdata, plocs, data, locs)
            data, locs = pdata, plocs
    elif isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if isinstance(spec, os.PathLike) or _looks_like_path(text):
            path = Path(text).expanduser()
            if not path.is_file():
                hint = ""
                if not path.is_dir() and find_preset(path.name.rsplit(".", 1)[0], search_dirs) is not None:
                    hint = f" (did you mean the preset '{path.name.rsplit('.', 1)[0]}'?)"
                raise PolicyError(f"{text}: no such policy file{hint}" if not path.is_dir()
                                  else f"{text}: is a directory, not a policy file")
            src = _file_src(path, text)
        else:
            found = find_preset(text, search_dirs)
            if found is None:
                raise PolicyError(unknown_preset(text, search_dirs))
            src = _preset_src(text, found)
        data, locs = _load_chain(src, search_dirs, ())
        display, source, extends = src.display, src.source, data.get("extends")
    else:
        raise PolicyError(f"expected a preset name, a .yaml path, a mapping or a Policy, got {type(spec).__name__}")
    for text in overrides:
        _apply_override(data, locs, text)
    ctx = ErrorContext(locs, display)
    data = dict(data)
    data.pop("extends", None)
    policy = build_dataclass(Policy, data, (), ctx)
    return dataclasses.replace(policy, source=source, extends=extends)
