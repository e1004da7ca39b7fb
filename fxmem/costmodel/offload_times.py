"""When offloaded activations leave the device and come back, as the offload runtime (`fxmem.nn.offload`) moves them.

An offload region writes what it saves to its tier and drops the device copy at its end (`SavePlan.offloaded`: per
region, the storages it owns). A later offload region that saves the same storage unchanged (its input, say) keeps
the same entry (`StepStore.written_entry`), so backward reads that entry when either region first unpacks it. An op
outside every offload region that saves the storage holds the tensor itself: it stays on the device until that op's
backward, and the entry's reload is a second copy, freed at the backward of the entry's earliest saver. Backward
reads all of a region's entries when it first unpacks one of them, and the region before it with them (prefetch).
"""
from __future__ import annotations

from collections import defaultdict


class OffloadTimes:
    """drop_at: forward record -> the storages off the device after it; reload_at: record -> the storages read back
    before its backward; copy_free_at: record -> the reloaded copies its backward frees (storages a plain saver
    kept on the device); kept_until: those storages -> the record whose backward frees the device copy."""

    def __init__(self, plan):  # a SavePlan
        self.plan = plan
        self.owner = {key: name for name, keys in plan.offloaded.items() for key in keys}
        self.trigger = {name: plan.region_last[name] for name in plan.offloaded}
        self.entry_first: dict[int, int] = {}  # storage -> earliest record holding its entry
        self.kept_until: dict[int, int] = {}
        for record_idx, region, key in self._saves():
            self._see(record_idx, region, key)
        self.drop_at: dict[int, list[int]] = defaultdict(list)
        for key, name in self.owner.items():
            if key not in self.kept_until:
                self.drop_at[max(plan.region_last[name], plan.last_use.get(key, 0))].append(key)
        self.copy_free_at: dict[int, list[int]] = defaultdict(list)
        for key in self.kept_until:
            self.copy_free_at[self.entry_first[key]].append(key)
        self.reload_at = self._reloads()

    def _saves(self):
        """(record index, region or None, storage) for each save of an offloaded storage: an op's own saves, and a
        recompute region's inputs (what non-reentrant checkpoint saves, at the region's first record)."""
        plan = self.plan
        for record in plan.records:
            info = plan.regions.get(record.region) if record.region else None
            if info is not None and info.kind == "recompute":
                continue  # the body's saves are recomputed; the region's inputs are below
            if record.out_rg:
                for key in record.saved:
                    if key in self.owner:
                        yield record.idx, record.region, key
        for name, info in plan.regions.items():
            if info is None or info.kind != "recompute":
                continue
            first, last = plan.region_first[name], plan.region_last[name]
            inputs = {key for record in plan.records[first:last + 1] for key in record.in_keys + record.list_keys
                      if key in self.owner and plan.created_in.get(key, -1) < first}
            for key in inputs:
                yield first, name, key

    def _see(self, record_idx: int, region: str | None, key: int) -> None:
        """One save of an offloaded storage: its owner's, another offload region's (the same entry, whose unpack
        reads the owner's region), or a plain saver's (the tensor stays on the device)."""
        plan = self.plan
        info = plan.regions.get(region) if region else None
        owner = self.owner[key]
        offloads = info is not None and (info.kind == "offload" or getattr(info, "offload_inputs", False))
        shares = region == owner or offloads
        if not shares:
            self.kept_until[key] = min(self.kept_until.get(key, record_idx), record_idx)
            return
        self.entry_first[key] = min(self.entry_first.get(key, record_idx), record_idx)
        if region != owner:
            unpacks_at = plan.region_last[region] if info.kind == "recompute" else record_idx
            self.trigger[owner] = max(self.trigger[owner], unpacks_at)

    def _reloads(self) -> dict[int, list[int]]:
        """A region's entries come back when backward first unpacks one of its entries or the next region's."""
        plan = self.plan
        reload_at: dict[int, list[int]] = defaultdict(list)
        order = sorted(plan.offloaded, key=lambda name: plan.region_first[name])
        for position, name in enumerate(order):
            reload_point = self.trigger[name]
            if position + 1 < len(order):
                reload_point = max(reload_point, self.trigger[order[position + 1]])
            reload_at[reload_point].extend(plan.offloaded[name])
        return reload_at
