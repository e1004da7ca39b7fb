"""Lookups over one forward trace that planners ask again and again, built once per trace."""
from __future__ import annotations

from .liveness import creators
from .trace import DispatchRecorder, cached_per_trace


class TraceIndex:
    """Per trace: which record created each storage, which records save it (as a tensor, or as a recipe), the
    records of each graph node, which recipes hold which nested, and the records that write storages in place."""

    def __init__(self, recorder: DispatchRecorder):
        records = self.records = recorder.records
        self.created_in: dict[int, int] = creators(records)
        self.savers: dict[int, list[int]] = {}  # storage key -> records saving it for backward
        for record in records:
            if record.out_rg:
                for key in record.saved:
                    self.savers.setdefault(key, []).append(record.idx)
        self.by_node: dict[str, list] = {}
        for record in records:
            self.by_node.setdefault(record.node, []).append(record)
        self.recast_savers: dict[int, list[int]] = {}  # recipe output -> records that save it as the recipe
        for record in records:
            for key in record.recast:
                if key in recorder.recipe_at:
                    self.recast_savers.setdefault(key, []).append(record.idx)
        # recipe output -> recipe outputs holding it nested (a cat, its upsampling)
        self.holders = recorder.recipe_holders()
        # records that write storages in place, with those storages (few: relu_, add_, dropout's scaling)
        self.writes: list[tuple[int, list]] = []
        for record in records:
            written = record.written_keys()
            if written:
                self.writes.append((record.idx, written))

    @classmethod
    def of(cls, recorder: DispatchRecorder) -> "TraceIndex":
        return cached_per_trace(recorder, "_fxmem_trace_index", lambda: cls(recorder))
