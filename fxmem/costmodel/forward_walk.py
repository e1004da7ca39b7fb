"""The static estimate's forward walk: each op's new storages go live, a value dies where the traced code let it go
unless something saved it (`SavePlan`), offloaded storages leave at their region's end; the peak and the timeline
it starts and the backward walk (`backward_walk`) continues."""
from __future__ import annotations

from collections import defaultdict

from ..measure import TimelinePoint
from .liveness import SavePlan


class Peak:
    """The highest live bytes seen so far, with where (node or node's backward), in which phase and module."""

    def __init__(self, live: int):
        self.bytes, self.at, self.phase, self.module = live, "start", "forward", ""

    def see(self, live: int, where: str, phase: str, module: str) -> None:
        if live > self.bytes:
            self.bytes, self.at, self.phase, self.module = live, where, phase, module

def timeline_add(timeline: list, phase: str, label: str, live: int, peak: int) -> None:
    """Append a point to `timeline`, or update the last one when it is the same node in the same phase."""
    if timeline and timeline[-1].phase == phase and timeline[-1].label == label:
        timeline[-1].live = live
        timeline[-1].peak = max(timeline[-1].peak, peak)
    else:
        timeline.append(TimelinePoint(phase, label, live, peak))

class ForwardWalk:
    """Forward: each op's new storages go live; a value dies after its last use (as the graph frees it) unless
    saved for backward or handed back; offloaded storages leave at their region's end."""

    def __init__(self, plan: SavePlan, baseline: int):
        self.plan = plan
        self.live_bytes = baseline
        self.peak = Peak(baseline)
        self.timeline: list[TimelinePoint] = []
        self.live: set[int] = set()

    def run(self) -> None:
        plan = self.plan
        storage_bytes, base_keys = plan.storage_bytes, plan.base_keys
        frees_at = self._frees_at()
        offload_free_at = plan.offload_times.drop_at
        for record in plan.records:
            for key in record.new_keys:
                if key not in base_keys:
                    self.live.add(key)
                    self.live_bytes += storage_bytes[key]
            node_peak = self.live_bytes
            self.peak.see(self.live_bytes, record.node, "forward", record.module)
            for key in frees_at.get(record.idx, ()):
                self._drop(key)
            for key in offload_free_at.get(record.idx, ()):
                self._drop(key)
            timeline_add(self.timeline, "forward", record.node, self.live_bytes, node_peak)

    def _frees_at(self) -> dict[int, list[int]]:
        """Record index -> the storages freed after it (values nobody saves or hands back)."""
        plan = self.plan
        frees_at: dict[int, list[int]] = defaultdict(list)
        for key, last in plan.last_use.items():
            if key in plan.base_keys or key in plan.out_keys or key in plan.saved_until:
                continue
            made = plan.created_in.get(key, last)
            frees_at[plan.liveness.dies_at(key, max(last, made), made)].append(key)
        return frees_at

    def _drop(self, key: int) -> None:
        if key in self.live:
            self.live.discard(key)
            self.live_bytes -= self.plan.storage_bytes[key]
