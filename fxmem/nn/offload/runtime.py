"""What the offload regions of one model share and what each call installs: `OffloadRuntime` (the tier, the prefetch
depth, the current step's store) and `RegionScope` (the saved-tensor hooks of one region call)."""
from __future__ import annotations

import weakref

import torch

from .scratch import TIERS
from .store import OffloadEntry, PackedTensor, StepStore, u8_view


class RegionScope:
    """Pack/unpack hooks of one region call."""

    def __init__(self, store: StepStore, slot: int, skip: set, min_bytes: int):
        self.store, self.slot, self.skip, self.min_bytes = store, slot, skip, min_bytes
        self.entries: dict[tuple, OffloadEntry] = {}

    def pack(self, tensor: torch.Tensor):
        # parameters, and subclasses that hold no bytes of their own to write (the cost model's fake tensors, when
        # a region's only inputs are parameters and nothing tells it apart as fake), are kept as they are
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return tensor
        nbytes = int(storage.nbytes())
        key = (storage.data_ptr(), nbytes)
        earlier = self.store.written_entry(tensor)
        if earlier is not None:
            return PackedTensor(earlier, tensor)  # an earlier region of this step wrote it (this region's input, say)
        if nbytes == 0 or nbytes < self.min_bytes or key[0] in self.skip:
            return tensor
        if self.store.tier == "cpu" and tensor.device.type != "cuda":
            return tensor  # the host tier only moves device tensors
        entry = self.entries.get(key)
        if entry is None:
            entry = OffloadEntry(self.store, self.slot, nbytes, tensor.device)
            entry.start_write(u8_view(tensor))
            self.entries[key] = entry
            self.store.remember(tensor, entry)
            self.store.slots[self.slot].append(weakref.ref(entry))
            self.store.bytes_offloaded += nbytes
            self.store.count += 1
        return PackedTensor(entry, tensor)

    @staticmethod
    def unpack(packed):
        return packed.unpack() if isinstance(packed, PackedTensor) else packed

    def flush(self) -> None:
        for entry in self.entries.values():
            entry.finish_write()
        self.entries.clear()


class OffloadRuntime:
    """Shared by the OffloadRegions of one model: tier, prefetch depth, the current step's store."""

    def __init__(self, tier: str = "disk", prefetch: int = 1, min_bytes: int = 0, scratch_root: str | None = None,
                 unlink_early: bool = True):
        if tier not in TIERS:
            raise ValueError(f"offload tier must be one of {TIERS}, got {tier!r}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.tier, self.prefetch, self.min_bytes = tier, int(prefetch), int(min_bytes)
        self.scratch_root, self.unlink_early = scratch_root, unlink_early
        self._store: StepStore | None = None
        self._stores: "weakref.WeakSet[StepStore]" = weakref.WeakSet()
        self.last_step_bytes = 0  # bytes offloaded by the most recent step (for reports/benchmarks)
        self.last_step_count = 0

    def __deepcopy__(self, memo):
        return OffloadRuntime(self.tier, self.prefetch, self.min_bytes, self.scratch_root, self.unlink_early)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_store"], state["_stores"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._stores = weakref.WeakSet()

    def begin(self, first: bool) -> StepStore:
        if first or self._store is None:
            self._store = StepStore(self)
            self._stores.add(self._store)
        return self._store

    def end(self) -> None:
        if self._store is not None:
            self.last_step_bytes, self.last_step_count = self._store.bytes_offloaded, self._store.count
        self._store = None  # the step's saved tensors keep the store alive until backward releases them

    def abort(self) -> None:
        """The current step failed in forward: close its store (its saved tensors become unusable)."""
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def close(self) -> None:
        """Remove every scratch file of this runtime now (saved tensors not yet used by backward become
        unusable)."""
        self._store = None
        for store in list(self._stores):
            store.close()
