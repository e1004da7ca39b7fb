"""Plain policy data (before validation) edited by key path: merging a file onto its parent, setting a value at
`passes.checkpoint.solver`, the short forms of a pass section."""
from __future__ import annotations

import copy
from typing import Any

from .errors import PolicyError
from .policy_check import KeyPath, Loc, show_value


def drop_key(data: dict, locs: dict, key: str) -> None:
    data.pop(key, None)
    for p in [p for p in locs if p[:1] == (key,)]:
        del locs[p]


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
    for k, v in src.items():
        p = path + (k,)
        if k in dst and isinstance(dst[k], dict) and isinstance(v, dict):
            if p in src_locs:
                dst_locs[p] = src_locs[p]
            merge(dst[k], dst_locs, v, src_locs, p)
        else:
            dst[k] = copy.deepcopy(v)
            n = len(p)
            for q in [q for q in dst_locs if q[:n] == p]:
                del dst_locs[q]
            for q, loc in src_locs.items():
                if q[:n] == p:
                    dst_locs[q] = loc


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
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
            locs[tuple(parts[: i + 1])] = loc
        elif not isinstance(nxt, dict):
            raise PolicyError(f"{where} {'.'.join(parts[: i + 1])}: is {show_value(nxt)}, not a mapping, so "
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
        normalize_passes(data, locs)
