"""The preset policies: the builtin `policies/*.yaml` (package data when installed) and user search directories."""
from __future__ import annotations

import importlib.resources
import importlib.util
import re
from pathlib import Path

from .errors import PolicyError
from .policy_check import suggest


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


def find_preset(name: str, search_dirs):
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", name):
        for d in _preset_dirs(search_dirs):
            for ext in (".yaml", ".yml"):
                p = d.joinpath(name + ext)
                if p.is_file():
                    return p
    return None


def unknown_preset(name: str, search_dirs) -> str:
    presets = list_presets(search_dirs)
    text = f"unknown preset '{name}'{suggest(name, presets)}; presets: {', '.join(presets) or 'none'}"
    if Path(name).is_file():
        text += f" (to load the file '{name}', write ./{name})"
    return text


def preset_path(name: str, search_dirs=None) -> Path:
    """Path of a preset's YAML file. Raises PolicyError for an unknown name."""
    p = find_preset(name, search_dirs)
    if p is None:
        raise PolicyError(unknown_preset(name, search_dirs))
    return p
