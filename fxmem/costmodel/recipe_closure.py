"""What a recompute region run as recipes (`fxmem.nn.region_recipe`) recomputes, and what it holds while it does.

Such a region's backward runs its *needed closure*: the ops that make the storages its saves hold, and transitively
the ops making what those read, plus every op writing in place into a storage the closure makes; under no_grad, as
graph code (a value is dropped after the last node of the closure that reads it). Its dropout masks are kept, or
(redraw) all drawn again before the closure runs. Found op by op on a forward trace here, node by node on the graph
there (`fxmem.nn.region_graph.needed_nodes`): the same set where every saved storage is a graph value, which is
what `recipe_compatible` admits.
"""
from __future__ import annotations

from collections import defaultdict

from .. import ops as optable
from ..nn.dropout import DRAW_OPS



def needed_records(records: list, first: int, last: int, wanted) -> set[int]:
    """Indices of the records first..last a closure making the storages `wanted` runs (see the module docstring);
    draws are never run (their masks are kept or drawn again beforehand)."""
    span = records[first:last + 1]
    made_by = {key: record.idx for record in span if not _draw(record) for key in record.new_keys}
    in_place = [(record.idx, written) for record in span for written in [_written_keys(record)] if written]
    needed: set[int] = set()
    stack = [made_by[key] for key in wanted if key in made_by]
    while True:
        while stack:
            index = stack.pop()
            if index in needed:
                continue
            needed.add(index)
            record = records[index]
            stack.extend(made_by[key] for key in _read_keys(record) if made_by.get(key, index) < index)
        made = {key for key, index in made_by.items() if index in needed}
        writers = [index for index, written in in_place if index not in needed and any(key in made for key in written)]
        if not writers:
            return needed
        stack.extend(writers)


def recipe_high(liveness, first: int, last: int, saved: dict, made_again: dict, draws_again: bool) -> int:
    """The most bytes a recipe region's recomputation (records first..last) holds at once: its inputs made again
    (`made_again`) and the saved storages it did not make, the masks it draws again (`draws_again`: all of them, at
    once, before the closure; `saved` holds those a save keeps), and the needed closure's values, each dropped
    after its last use in the closure unless a save keeps it."""
    records, storage_bytes, base = liveness.records, liveness.storage_bytes, liveness.base_keys
    masks = {key for record in records[first:last + 1] if draws_again and _draw(record)
             for key in record.new_keys if base.get(key) is None}
    wanted = {key for key in saved if key not in masks}
    needed = needed_records(records, first, last, wanted)
    made = {key: index for index in needed for key in records[index].new_keys if base.get(key) is None}
    live = sum(made_again.values()) + sum(storage_bytes[key] for key in saved if key not in made and key not in masks)
    live += sum(storage_bytes[key] for key in masks)
    high = live
    uses = _last_uses(records, needed)
    drop_at: dict[int, list[int]] = defaultdict(list)
    for index in range(first, last + 1):
        if index in needed:
            for key in records[index].new_keys:
                if base.get(key) is None:
                    live += storage_bytes[key]
                    if key not in saved:
                        drop_at[_dies(liveness, key, index, uses.get(key, index))].append(key)
        high = max(high, live)
        for key in drop_at.pop(index, ()):
            live -= storage_bytes[key]
    return high


def _dies(liveness, key: int, made: int, last: int) -> int:
    """Where the closure drops `key` (made at record `made`, last read by a closure record at `last`): a temporary
    of one node where the forward freed it; else after its last reader's node."""
    records = liveness.records
    released = liveness.released.get(key)
    if released is not None and records[released].step == records[made].step:
        return max(released, last)
    if records[made].step == records[last].step:
        return last
    return liveness.step_end.get(records[last].step, last)


def _last_uses(records: list, needed: set[int]) -> dict[int, int]:
    uses: dict[int, int] = {}
    for index in sorted(needed):
        record = records[index]
        for key in _read_keys(record) + [k for k in record.out_keys if k is not None]:
            uses[key] = index
    return uses


def _read_keys(record) -> list:
    return [key for key in record.in_keys + record.list_keys if key is not None]


def _written_keys(record) -> list:
    return [record.in_keys[i] for i in optable.written_positions(record.func)
            if i < len(record.in_keys) and record.in_keys[i] is not None]


def _draw(record) -> bool:
    return optable.packet(record.func) in DRAW_OPS
