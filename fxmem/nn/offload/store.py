"""Where one training step's offloaded activations go: a store per step (one scratch file on disk, or pinned host
buffers), an entry per offloaded storage that writes while forward runs and reads back one region ahead in
backward, and what autograd holds instead of the tensor."""
from __future__ import annotations

import atexit
import os
import tempfile
import threading
import weakref
from concurrent.futures import Future

import torch

from .scratch import SCRATCH_PREFIX, cleanup_files, pread_all, pwrite_all, submit_io


_LIVE_STORES: "weakref.WeakSet[StepStore]" = weakref.WeakSet()


def live_scratch_dirs() -> list[str]:
    """Scratch directories of steps whose saved tensors are still alive (for tests and diagnostics)."""
    return sorted(s.dir for s in list(_LIVE_STORES) if s.dir and os.path.isdir(s.dir))



def u8_view(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of `tensor` as a flat uint8 tensor (no copy, no new storage)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class OffloadEntry:
    """One offloaded storage: where its bytes are, and (in backward) the buffer they came back into."""
    __slots__ = ("store", "slot", "nbytes", "offset", "device", "src", "write", "host", "event", "buf", "read",
                 "__weakref__")

    def __init__(self, store: "StepStore", slot: int, nbytes: int, device: torch.device):
        self.store, self.slot, self.nbytes, self.device = store, slot, nbytes, device
        self.offset = 0
        self.src = None  # the source storage (uint8 view) until its copy is done
        self.write: Future | None = None
        self.host = None  # "cpu" tier: pinned host copy
        self.event = None  # "cpu" tier: CUDA event of the pending reload
        self.buf = None  # the reloaded storage (uint8)
        self.read: Future | None = None

    # ------------------------------------------------------------------------------------------- forward
    def start_write(self, storage_bytes: torch.Tensor) -> None:
        self.src = storage_bytes
        store = self.store
        if store.tier == "disk":
            src = storage_bytes if storage_bytes.device.type == "cpu" else storage_bytes.cpu()
            self.offset = store.alloc(self.nbytes)
            self.write = submit_io("write", pwrite_all, store.fd, src, self.offset)
        else:
            side = store.side_stream(storage_bytes.device)
            side.wait_stream(torch.cuda.current_stream(storage_bytes.device))
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(side):
                self.host.copy_(storage_bytes, non_blocking=True)
            # the allocator reuses the device block only once the side stream has passed the copy, so the region's
            # end drops it without a host-side wait (which would hold back the next region's kernel launches)
            storage_bytes.record_stream(side)

    def finish_write(self) -> None:
        if self.write is not None:
            self.write.result()
            self.write = None
        self.src = None  # the device copy may now be freed (on CUDA: once the side stream has copied it)

    # ------------------------------------------------------------------------------------------- backward
    def start_read(self) -> None:
        if self.buf is not None:
            return
        self.finish_write()
        store = self.store
        if store.tier == "disk":
            buf = torch.empty(self.nbytes, dtype=torch.uint8)  # allocated here: counted as live tensor memory
            if store.fd_box[0] is None:
                raise RuntimeError("fxmem offload: the scratch file of this step was already closed "
                                   "(OffloadRuntime.close() ran before backward)")
            self.read = submit_io("read", pread_all, store.fd, buf, self.offset)
            if self.device.type != "cpu":
                self.read.result()
                self.read = None
                buf = buf.to(self.device)
            self.buf = buf
        else:
            side = store.side_stream(self.device)
            with torch.cuda.stream(side):
                buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                buf.copy_(self.host, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(side)
            self.buf = buf

    def get(self) -> torch.Tensor:
        if self.buf is None:
            self.start_read()
        if self.read is not None:
            self.read.result()
            self.read = None
        if self.event is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(self.event)
            self.buf.record_stream(cur)
            self.event = None
        return self.buf


class PackedTensor:
    """What autograd holds instead of an offloaded tensor."""
    __slots__ = ("entry", "dtype", "size", "stride", "offset")

    def __init__(self, entry: OffloadEntry, tensor: torch.Tensor):
        self.entry = entry
        self.dtype, self.size, self.stride, self.offset = tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), \
            tensor.storage_offset()

    def unpack(self) -> torch.Tensor:
        entry = self.entry
        entry.store.on_unpack(entry.slot)
        buf = entry.get()
        return torch.empty(0, dtype=self.dtype, device=buf.device).set_(buf.untyped_storage(), self.offset,
                                                                         self.size, self.stride)


class StepStore:
    """The offloaded tensors of one training step: one scratch file (disk) or pinned buffers (cpu)."""

    def __init__(self, runtime):  # the OffloadRuntime (region.py) of the model: tier, prefetch, scratch settings
        self.tier = runtime.tier
        self.prefetch = runtime.prefetch
        self.slots: list[list[weakref.ref]] = []
        self.fetched: set[int] = set()  # slots whose reads have started
        self.triggered: set[int] = set()  # slots whose backward has started
        self.fd_box: list = [None]
        self.path: str | None = None
        self.dir: str | None = None
        self._next = 0
        self._lock = threading.Lock()
        self._streams: dict = {}
        self.bytes_offloaded = 0
        self.count = 0
        self._written: dict[int, tuple] = {}  # storage _cdata -> (weakref to it, weakref to its entry, version)
        if self.tier == "disk":
            self.dir = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=runtime.scratch_root)
            self.path = os.path.join(self.dir, "activations.bin")
            try:
                self.fd_box[0] = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                if runtime.unlink_early:
                    try:
                        os.unlink(self.path)
                        os.rmdir(self.dir)
                        self.path, self.dir = None, None
                    except OSError:  # platforms that cannot unlink an open file: remove at finalization
                        pass
            except BaseException:  # an interrupt (SIGINT/SIGTERM) or an OS error before the finalizer exists
                cleanup_files(self.fd_box, self.path, self.dir)
                raise
        self._finalizer = weakref.finalize(self, cleanup_files, self.fd_box, self.path, self.dir)
        _LIVE_STORES.add(self)

    @property
    def fd(self) -> int:
        return self.fd_box[0]

    def alloc(self, nbytes: int) -> int:
        with self._lock:
            off = self._next
            self._next += (nbytes + 4095) // 4096 * 4096  # page-aligned records
            return off

    def written_entry(self, tensor: torch.Tensor) -> "OffloadEntry | None":
        """The entry a region of this step wrote `tensor`'s storage to, unchanged since (None: none, it is gone, or
        `tensor` was written in place after): a later region saving the same tensor (its input, say) keeps that
        entry."""
        storage = tensor.untyped_storage()
        found = self._written.get(storage._cdata)
        if found is None or found[0]() is not storage or found[2] != tensor._version:
            return None
        return found[1]()

    def remember(self, tensor: torch.Tensor, entry: OffloadEntry) -> None:
        """`tensor`'s storage was written to `entry` (see `written_entry`); forgotten when the storage dies."""
        storage = tensor.untyped_storage()
        key, table = storage._cdata, self._written
        table[key] = (weakref.ref(storage, lambda _ref, key=key: table.pop(key, None)), weakref.ref(entry),
                      tensor._version)

    def side_stream(self, device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def new_slot(self) -> int:
        self.slots.append([])
        return len(self.slots) - 1

    def on_unpack(self, slot: int) -> None:
        if slot in self.triggered:
            return
        self.triggered.add(slot)  # backward reached this region: load it and the `prefetch` regions before it
        for fetch_slot in range(slot, max(-1, slot - self.prefetch - 1), -1):
            if fetch_slot in self.fetched:
                continue
            self.fetched.add(fetch_slot)
            for ref in self.slots[fetch_slot]:
                entry = ref()
                if entry is not None:
                    entry.start_read()

    def close(self) -> None:
        self._finalizer()



@atexit.register
def _close_all() -> None:
    for store in list(_LIVE_STORES):
        store.close()
