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
    for preset_dir in _preset_dirs(search_dirs):
        try:
            entries = list(preset_dir.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_file() and entry.name.endswith((".yaml", ".yml")) and not entry.name.startswith("."):
                names.add(entry.name.rsplit(".", 1)[0])
    return sorted(names)


def find_preset(name: str, search_dirs):
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", name):
        for preset_dir in _preset_dirs(search_dirs):
            for ext in (".yaml", ".yml"):
                path = preset_dir.joinpath(name + ext)
                if path.is_file():
                    return path
    return None


def unknown_preset(name: str, search_dirs) -> str:
    presets = list_presets(search_dirs)
    text = f"unknown preset '{name}'{suggest(name, presets)}; presets: {', '.join(presets) or 'none'}"
    if Path(name).is_file():
        text += f" (to load the file '{name}', write ./{name})"
    return text


def preset_path(name: str, search_dirs=None) -> Path:
    """Path of a preset's YAML file. Raises PolicyError for an unknown name."""
    path = find_preset(name, search_dirs)
    if path is None:
        raise PolicyError(unknown_preset(name, search_dirs))
    return path
