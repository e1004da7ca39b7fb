"""Plain policy data (before validation) edited by key path: merging a file onto its parent, setting a value at
`passes.checkpoint.solver`, the short forms of a pass section."""
from __future__ import annotations

import copy
from typing import Any

from .errors import PolicyError
from .policy_check import KeyPath, Loc, show_value


def drop_key(data: dict, locs: dict, key: str) -> None:
    data.pop(key, None)
    for key_path in [p for p in locs if p[:1] == (key,)]:
        del locs[key_path]


def normalize_passes(data: dict, locs: dict) -> None:
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


def merge(dst: dict, dst_locs: dict, src: dict, src_locs: dict, path: KeyPath = ()) -> None:
    """Deep merge `src` onto `dst` in place: mappings merge key by key, everything else replaces."""
    for key, value in src.items():
        key_path = path + (key,)
        if key in dst and isinstance(dst[key], dict) and isinstance(value, dict):
            if key_path in src_locs:
                dst_locs[key_path] = src_locs[key_path]
            merge(dst[key], dst_locs, value, src_locs, key_path)
        else:
            dst[key] = copy.deepcopy(value)
            depth = len(key_path)
            for loc_path in [q for q in dst_locs if q[:depth] == key_path]:
                del dst_locs[loc_path]
            for loc_path, loc in src_locs.items():
                if loc_path[:depth] == key_path:
                    dst_locs[loc_path] = loc


def key_parts(key: Any, where: str, *, refused: str) -> list[str]:
    """`passes.checkpoint.solver` -> its parts; `extends` and `source` are refused with `refused`."""
    if not isinstance(key, str):
        raise PolicyError(f"{where}: expected a key path like passes.checkpoint.solver, got {show_value(key)}")
    parts = key.split(".")
    if not key or any(not p.strip() for p in parts):
        raise PolicyError(f"{where}: '{key}' is not a key path like passes.checkpoint.solver")
    parts = [p.strip() for p in parts]
    if parts[0] in ("extends", "source"):
        raise PolicyError(f"{where} {parts[0]}: {refused}")
    return parts


def set_value(data: dict, locs: dict, parts: list[str], value: Any, where: str) -> None:
    """Set `value` at the key path `parts` of plain policy data (making mappings on the way), every location
    under it `where`; `passes.X: <bool>` is short for `passes.X.enabled`."""
    if len(parts) == 2 and parts[0] == "passes" and isinstance(value, bool):
        parts = parts + ["enabled"]
    loc = Loc(where)
    node = data
    for index, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
            locs[tuple(parts[: index + 1])] = loc
        elif not isinstance(nxt, dict):
            raise PolicyError(f"{where} {'.'.join(parts[: index + 1])}: is {show_value(nxt)}, not a mapping, so "
                              f"'{'.'.join(parts[index + 1:])}' cannot be set inside it")
        node = nxt
    key_path = tuple(parts)
    depth = len(key_path)
    for loc_path in [q for q in locs if q[:depth] == key_path]:
        del locs[loc_path]
    node[parts[-1]] = value
    locs[key_path] = loc
    if isinstance(value, (dict, list)):
        def mark(subtree, prefix):
            items = subtree.items() if isinstance(subtree, dict) else enumerate(subtree)
            for key, sub in items:
                locs[prefix + (key,)] = loc
                if isinstance(sub, (dict, list)):
                    mark(sub, prefix + (key,))
        mark(value, key_path)
    if key_path[:1] == ("passes",) and depth == 2:
        normalize_passes(data, locs)
