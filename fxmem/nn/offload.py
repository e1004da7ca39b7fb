"""Offload runtime: move saved activations, frozen weights, gradients and optimizer state to a slower tier.

Activations — `OffloadRegion`
    region = OffloadRegion(body, runtime, index=i, last=(i == n - 1), param_args=(2, 3))
    y = region(x, h, w, b)     # training with grad on: `body` runs under torch.autograd.graph.saved_tensors_hooks

    Every tensor autograd saves inside the region (created inside it, at least `min_bytes`, not a parameter) is
    written to the slow tier while the region still computes, and its device memory is released when the region
    ends. In backward the first unpack of region k loads region k's tensors and prefetches regions k-1 ..
    k-prefetch, so the next region's tensors arrive before backward needs them. Tiers:

    - "disk" (CPU hosts): one scratch file per training step in a directory of our own
      (`tempfile.mkdtemp(prefix="fxmem-offload-")`). Writes (`os.pwritev`) run on a writer thread and reads
      (`os.preadv`) on a reader thread, straight from and into tensor memory. By default the file is unlinked
      (and its directory removed) right after it is opened: nothing is visible on disk, and the kernel frees the
      space when the descriptor closes, even if the process is killed. With `unlink_early=False` the file stays
      visible during the step and is removed when the step's saved tensors are released (after backward, or
      when the graph of a failed/interrupted step is dropped), by `OffloadRuntime.close()`, or at exit.
    - "cpu" (CUDA hosts): pinned host buffers, copies on a side stream (device -> host while the region runs,
      host -> device one region ahead in backward), ordered with CUDA events.

    Values are copied bit for bit and restored with the original dtype, shape, strides and storage offset
    (tensors that share a storage share one copy), so gradients are exact.

    What "device memory" means on a CPU host: fxmem.measure counts tensor storages created by aten ops. An
    offloaded activation's storage is freed after its bytes are written (pwrite from the tensor's memory; no
    tensor storage is created for the file), and the reload buffer is a tensor allocated when backward needs
    it. So the measured saving is resident tensor memory. We deliberately do not memory-map the scratch file: a
    mapped page is resident memory until the kernel writes it back and evicts it, which would move the bytes
    from tensor storage to page cache rather than off the machine's RAM. The OS page cache may still hold the
    written bytes for a while (kernel-managed, reclaimable, not counted by fxmem.measure or by the cost model).

Frozen weights — `WeightStreamer`
    Frozen (or inference-time) parameters of a block live on a slow tier (CPU for CUDA models, or a
    safetensors file on disk) and are streamed in just before the block runs, one block ahead, then released.

Gradients and optimizer — `OffloadedOptimizer`
    Each gradient moves to the host as soon as it is accumulated (post-accumulate-grad hooks) and the optimizer
    steps on host copies of the parameters (ZeRO-Offload style); optionally only when the device's live memory is
    above a threshold.

The static cost model reads `fxmem_region = RegionInfo(kind="offload", body=..., tier=...)`: a region's saved
tensors are off the device from the end of its forward until the backward of the region after it (prefetch
one region ahead).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import recast
from .regions import RegionInfo

__all__ = ["OffloadRuntime", "OffloadRegion", "WeightStreamer", "OffloadedOptimizer", "probe_bandwidth",
           "SCRATCH_PREFIX", "live_scratch_dirs"]

SCRATCH_PREFIX = "fxmem-offload-"
TIERS = ("cpu", "disk")

# one writer and one reader thread for the whole process (I/O releases the GIL)
_EXECUTORS: dict[str, ThreadPoolExecutor] = {}
_EXEC_LOCK = threading.Lock()


def _executor(kind: str) -> ThreadPoolExecutor:
    with _EXEC_LOCK:
        ex = _EXECUTORS.get(kind)
        if ex is None:
            ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fxmem-offload-{kind}")
            _EXECUTORS[kind] = ex
        return ex


# ============================================================================================ scratch files

_LIVE_STORES: "weakref.WeakSet[_Store]" = weakref.WeakSet()


def live_scratch_dirs() -> list[str]:
    """Scratch directories of steps whose saved tensors are still alive (for tests and diagnostics)."""
    return sorted(s.dir for s in list(_LIVE_STORES) if s.dir and os.path.isdir(s.dir))


def _cleanup_files(fd_box: list, path: str | None, dir_: str | None) -> None:
    """Close the scratch file and remove it and its directory (idempotent; runs from finalizers)."""
    fd = fd_box[0] if fd_box else None
    if fd is not None:
        fd_box[0] = None
        try:
            os.close(fd)
        except OSError:
            pass
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            pass
    if dir_:
        shutil.rmtree(dir_, ignore_errors=True)


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    mv = mv.cast("B")
    done = 0
    while done < len(mv):
        n = os.pwritev(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(f"fxmem offload: short write to scratch file ({done} of {len(mv)} bytes)")
        done += n


def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
    mv = mv.cast("B")
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(f"fxmem offload: short read from scratch file ({done} of {len(mv)} bytes)")
        done += n


def _u8_view(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of `t` as a flat uint8 tensor (no copy, no new storage)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _Entry:
    """One offloaded storage: where its bytes are, and (in backward) the buffer they came back into."""
    __slots__ = ("store", "slot", "nbytes", "offset", "device", "src", "write", "host", "event", "buf", "read",
                 "__weakref__")

    def __init__(self, store: "_Store", slot: int, nbytes: int, device: torch.device):
        self.store, self.slot, self.nbytes, self.device = store, slot, nbytes, device
        self.offset = 0
        self.src = None  # the source storage (uint8 view) until its copy is done
        self.write: Future | None = None
        self.host = None  # "cpu" tier: pinned host copy
        self.event = None  # "cpu" tier: CUDA event of the pending reload
        self.buf = None  # the reloaded storage (uint8)
        self.read: Future | None = None

    # ------------------------------------------------------------------------------------------- forward
    def start_write(self, u8: torch.Tensor) -> None:
        self.src = u8
        st = self.store
        if st.tier == "disk":
            src = u8 if u8.device.type == "cpu" else u8.cpu()
            self.offset = st.alloc(self.nbytes)
            self.write = _executor("write").submit(_pwrite_all, st.fd, memoryview(src.numpy()), self.offset)
        else:
            side = st.side_stream(u8.device)
            side.wait_stream(torch.cuda.current_stream(u8.device))
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(side):
                self.host.copy_(u8, non_blocking=True)
            # the allocator reuses the device block only once the side stream has passed the copy, so the region's
            # end drops it without a host-side wait (which would hold back the next region's kernel launches)
            u8.record_stream(side)

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
        st = self.store
        if st.tier == "disk":
            buf = torch.empty(self.nbytes, dtype=torch.uint8)  # allocated here: counted as live tensor memory
            if st.fd_box[0] is None:
                raise RuntimeError("fxmem offload: the scratch file of this step was already closed "
                                   "(OffloadRuntime.close() ran before backward)")
            self.read = _executor("read").submit(_pread_all, st.fd, memoryview(buf.numpy()), self.offset)
            if self.device.type != "cpu":
                self.read.result()
                self.read = None
                buf = buf.to(self.device)
            self.buf = buf
        else:
            side = st.side_stream(self.device)
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


class _Packed:
    """What autograd holds instead of an offloaded tensor."""
    __slots__ = ("entry", "dtype", "size", "stride", "offset")

    def __init__(self, entry: _Entry, t: torch.Tensor):
        self.entry = entry
        self.dtype, self.size, self.stride, self.offset = t.dtype, tuple(t.shape), tuple(t.stride()), \
            t.storage_offset()

    def unpack(self) -> torch.Tensor:
        e = self.entry
        e.store.on_unpack(e.slot)
        buf = e.get()
        return torch.empty(0, dtype=self.dtype, device=buf.device).set_(buf.untyped_storage(), self.offset,
                                                                         self.size, self.stride)


class _Store:
    """The offloaded tensors of one training step: one scratch file (disk) or pinned buffers (cpu)."""

    def __init__(self, runtime: "OffloadRuntime"):
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
                _cleanup_files(self.fd_box, self.path, self.dir)
                raise
        self._finalizer = weakref.finalize(self, _cleanup_files, self.fd_box, self.path, self.dir)
        _LIVE_STORES.add(self)

    @property
    def fd(self) -> int:
        return self.fd_box[0]

    def alloc(self, nbytes: int) -> int:
        with self._lock:
            off = self._next
            self._next += (nbytes + 4095) // 4096 * 4096  # page-aligned records
            return off

    def side_stream(self, device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def new_slot(self) -> int:
        self.slots.append([])
        return len(self.slots) - 1

    def on_unpack(self, slot: int) -> None:
        if slot in self.triggered:
            return
        self.triggered.add(slot)  # backward reached this region: load it and the `prefetch` regions before it
        for s in range(slot, max(-1, slot - self.prefetch - 1), -1):
            if s in self.fetched:
                continue
            self.fetched.add(s)
            for ref in self.slots[s]:
                e = ref()
                if e is not None:
                    e.start_read()

    def close(self) -> None:
        self._finalizer()


class _RegionScope:
    """Pack/unpack hooks of one region call."""

    def __init__(self, store: _Store, slot: int, skip: set, min_bytes: int):
        self.store, self.slot, self.skip, self.min_bytes = store, slot, skip, min_bytes
        self.entries: dict[tuple, _Entry] = {}

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.layout != torch.strided or t.device.type == "meta":
            return t
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        n = int(st.nbytes())
        key = (st.data_ptr(), n)
        if n == 0 or n < self.min_bytes or key[0] in self.skip:
            return t
        if self.store.tier == "cpu" and t.device.type != "cuda":
            return t  # the host tier only moves device tensors
        e = self.entries.get(key)
        if e is None:
            e = _Entry(self.store, self.slot, n, t.device)
            e.start_write(_u8_view(t))
            self.entries[key] = e
            self.store.slots[self.slot].append(weakref.ref(e))
            self.store.bytes_offloaded += n
            self.store.count += 1
        return _Packed(e, t)

    @staticmethod
    def unpack(p):
        return p.unpack() if isinstance(p, _Packed) else p

    def flush(self) -> None:
        for e in self.entries.values():
            e.finish_write()
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
        self._store: _Store | None = None
        self._stores: "weakref.WeakSet[_Store]" = weakref.WeakSet()
        self.last_step_bytes = 0  # bytes offloaded by the most recent step (for reports/benchmarks)
        self.last_step_count = 0

    def __deepcopy__(self, memo):
        return OffloadRuntime(self.tier, self.prefetch, self.min_bytes, self.scratch_root, self.unlink_early)

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_store"], d["_stores"] = None, None
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._stores = weakref.WeakSet()

    def begin(self, first: bool) -> _Store:
        if first or self._store is None:
            self._store = _Store(self)
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
        for s in list(self._stores):
            s.close()


@atexit.register
def _close_all() -> None:
    for s in list(_LIVE_STORES):
        s.close()


def _is_fake(args) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return any(isinstance(a, FakeTensor) or (isinstance(a, torch.Tensor) and a.device.type == "meta")
               for a in pytree.tree_leaves(args))  # (an argument can be a tuple: a multi-output region's result)


class OffloadRegion(nn.Module):
    """Runs `body` with saved tensors offloaded to the runtime's tier (see the module docstring).

    index: position of this region among the model's offload regions (0 starts a new step's store).
    last: the last region of the forward (drops the runtime's reference to the step's store).
    param_args: positions of arguments that are parameters/buffers (never offloaded).
    inputs_too: also offload saved tensors that are region inputs (used around checkpoint regions, whose
    inputs are the only thing they save); otherwise only tensors created inside the region are offloaded.
    """

    def __init__(self, body: nn.Module, runtime: OffloadRuntime, index: int = 0, last: bool = True,
                 param_args: Iterable[int] = (), inputs_too: bool = False, label: str = "",
                 model_body: Callable | None = None, keep_ops: frozenset = frozenset()):
        super().__init__()
        self.body = body
        self.runtime = runtime
        self.index, self.last = int(index), bool(last)
        self.param_args = tuple(param_args)
        self.inputs_too = bool(inputs_too)
        self.label = label
        # what the cost model runs: the body, or (around a checkpoint region) the checkpoint's own body
        kind = "recompute" if model_body is not None else "offload"
        self.fxmem_region = RegionInfo(kind=kind, body=model_body if model_body is not None else self.body,
                                       keep_ops=frozenset(keep_ops), tier=runtime.tier,
                                       offload_inputs=model_body is not None)

    def forward(self, *args):
        if not (self.training and torch.is_grad_enabled()) or torch.compiler.is_compiling() or _is_fake(args):
            return self.body(*args)
        rt = self.runtime
        if self.inputs_too:
            skip_idx = self.param_args
        else:
            skip_idx = range(len(args))
        skip = set()
        for i in skip_idx:
            for a in pytree.tree_leaves(args[i]):
                if isinstance(a, torch.Tensor):
                    try:
                        skip.add(a.untyped_storage().data_ptr())
                    except (RuntimeError, NotImplementedError):
                        pass
        store = rt.begin(self.index == 0)
        scope = _RegionScope(store, store.new_slot(), skip, rt.min_bytes)
        try:
            with torch.autograd.graph.saved_tensors_hooks(scope.pack, scope.unpack), recast.aside():
                out = self.body(*args)
            scope.flush()
        except BaseException:
            rt.abort()  # the step is abandoned: remove its scratch file now
            raise
        if self.last:
            rt.end()
        return out

    def extra_repr(self) -> str:
        return (f"label={self.label!r}, tier={self.runtime.tier!r}, index={self.index}, "
                f"prefetch={self.runtime.prefetch}, inputs_too={self.inputs_too}")


# ============================================================================================ bandwidth

def probe_bandwidth(tier: str, nbytes: int = 32 << 20, scratch_root: str | None = None) -> float:
    """Bytes per second of a write + read round trip to the tier (a quick probe, ~0.1 s)."""
    if tier == "disk":
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        d = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=scratch_root)
        path = os.path.join(d, "probe.bin")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        try:
            t0 = time.perf_counter()
            _pwrite_all(fd, memoryview(src.numpy()), 0)
            _pread_all(fd, memoryview(dst.numpy()), 0)
            dt = time.perf_counter() - t0
        finally:
            _cleanup_files([fd], path, d)
        return 2 * nbytes / max(dt, 1e-9)
    if tier == "cpu":
        if not torch.cuda.is_available():
            raise ValueError("the 'cpu' offload tier moves CUDA tensors to host memory; this host has no CUDA")
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h.copy_(a, non_blocking=True)
        a.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        return 2 * nbytes / max(time.perf_counter() - t0, 1e-9)
    raise ValueError(f"offload tier must be one of {TIERS}, got {tier!r}")


# ============================================================================================ weights

class WeightStreamer(nn.Module):
    """Frozen weights of blocks kept on a slow tier; `streamer(i)` returns block i's weights, loaded just in time.

        ws = WeightStreamer({"teacher.convs.0": [("teacher.convs.0.lin.weight", w), ...], ...}, tier="disk")
        w0, b0 = ws(0)      # block 0's tensors (fresh tensors on `device`); starts loading block 1 (prefetch)

    The graph calls `ws(i)` right before block i's first use and reads the tensors with getitem; they are freed
    after their last use, like any intermediate value. Tiers: "disk" — one safetensors file in a scratch
    directory of our own, opened memory-mapped, copied into fresh tensors when fetched; "cpu" — host tensors
    (pinned when CUDA is available) copied to `device`. Prefetch: fetching block i allocates block i+1 ..
    i+prefetch (on the calling thread, so fxmem.measure counts them) and fills them on a background thread.

    Only frozen tensors (requires_grad False: a distillation teacher, or any weight at inference) are accepted:
    the fetched copies do not carry gradients. Under FakeTensorMode (the cost model, shape propagation) the
    call returns empty tensors of the right shapes, so the static estimate sees each block's weights created at
    its fetch (and the next block's at the same point, for the prefetch) and freed after their last use.
    `state_dict_entries()` gives the original names and values (used by the owning module's state_dict hook).
    """

    def __init__(self, blocks: dict[str, list[tuple[str, torch.Tensor]]], tier: str = "disk", prefetch: int = 1,
                 device: torch.device | str | None = None, scratch_root: str | None = None, unlink_early: bool = True):
        super().__init__()
        # disk: the scratch file is removed as soon as it is mapped (the mapping keeps the data), so no copy of the
        # weights is left on disk, even after a hard exit; False keeps it visible until the streamer goes
        self.unlink_early = bool(unlink_early)
        if tier not in TIERS:
            raise ValueError(f"weight offload tier must be one of {TIERS}, got {tier!r}")
        self.tier, self.prefetch = tier, int(prefetch)
        self.names = list(blocks)
        self.spec: list[list[tuple[str, tuple, torch.dtype]]] = []
        flat: dict[str, torch.Tensor] = {}
        for bname in self.names:
            row = []
            for qn, t in blocks[bname]:
                if t.requires_grad:
                    raise ValueError(f"weight offload: parameter {qn!r} of block {bname!r} requires grad; only "
                                     f"frozen (requires_grad=False) or inference-time weights can be streamed")
                row.append((qn, tuple(t.shape), t.dtype))
                flat[qn] = t.detach()
            self.spec.append(row)
        first = next(iter(flat.values()), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None
                                                                         else torch.device("cpu"))
        self.bytes_offloaded = sum(t.numel() * t.element_size() for t in flat.values())
        self.scratch_root = scratch_root
        self._dir: str | None = None
        self._path: str | None = None
        self._file = None
        self._host: dict[str, torch.Tensor] = {}
        self._pending: dict[int, tuple[list, Future | None]] = {}
        self._fake_next: dict[int, tuple] = {}
        self._finalizer = None
        self._stash(flat)

    def _stash(self, flat: dict[str, torch.Tensor]) -> None:
        if self.tier == "disk":
            from safetensors.torch import save_file
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix=SCRATCH_PREFIX + "weights-", dir=self.scratch_root)
                self._path = os.path.join(self._dir, "weights.safetensors")
                self._finalizer = weakref.finalize(self, _cleanup_files, [None], self._path, self._dir)
            self._file = None
            save_file({k: v.detach().cpu().contiguous() for k, v in flat.items()}, self._path)
            self._open()
            if self.unlink_early:
                try:
                    os.unlink(self._path)
                    os.rmdir(self._dir)
                    self._dir = None  # (a later stash, load_state_dict's, makes a new one and unlinks it again)
                except OSError:  # platforms that cannot unlink a mapped file: removed when the streamer goes
                    pass
        else:
            pin = torch.cuda.is_available()
            for k, v in flat.items():
                h = v.detach().to("cpu", copy=True)
                self._host[k] = h.pin_memory() if pin else h

    def _open(self):
        from safetensors import safe_open
        self._file = safe_open(self._path, framework="pt", device="cpu")  # memory-mapped

    def __deepcopy__(self, memo):
        vals = self.state_dict_entries()
        blocks = {b: [(qn, vals[qn]) for qn, _, _ in row] for b, row in zip(self.names, self.spec)}
        new = WeightStreamer(blocks, tier=self.tier, prefetch=self.prefetch, device=self.device,
                             scratch_root=self.scratch_root, unlink_early=self.unlink_early)
        new.train(self.training)
        memo[id(self)] = new
        return new

    def __getstate__(self):
        raise TypeError("a WeightStreamer (fxmem weight offload) cannot be pickled: its weights live in a scratch "
                        "file; save the model's state_dict instead")

    def _source(self, qn: str) -> torch.Tensor:
        return self._file.get_tensor(qn) if self.tier == "disk" else self._host[qn]

    def _alloc(self, i: int) -> list:
        return [torch.empty(shape, dtype=dt, device=self.device) for _, shape, dt in self.spec[i]]

    def _fill(self, i: int, dst: list) -> list:
        with torch.no_grad():
            for (qn, _, _), d in zip(self.spec[i], dst):
                d.copy_(self._source(qn), non_blocking=self.device.type == "cuda")
        return dst

    def fetch(self, i: int) -> tuple:
        if not 0 <= i < len(self.spec):
            raise IndexError(f"WeightStreamer: block {i} out of range (have {len(self.spec)})")
        got = self._pending.pop(i, None)
        if got is None:
            out = self._fill(i, self._alloc(i))
        else:
            out, fut = got
            if fut is not None:
                fut.result()
        for j in range(i + 1, min(len(self.spec), i + 1 + self.prefetch)):
            if j not in self._pending:
                dst = self._alloc(j)  # allocated here, on the calling thread: counted by fxmem.measure
                self._pending[j] = (dst, _executor("weights").submit(self._fill, j, dst))
        if i == 0:
            # a new step: drop prefetches the last step left behind for blocks before this one
            pass
        return tuple(out)

    def forward(self, i: int) -> tuple:
        from torch._guards import detect_fake_mode
        if detect_fake_mode() is not None or torch.compiler.is_compiling():
            if i == 0:
                self._fake_next.clear()
            out = self._fake_next.pop(i, None) or tuple(self._alloc(i))
            for j in range(i + 1, min(len(self.spec), i + 1 + self.prefetch)):
                if j not in self._fake_next:
                    self._fake_next[j] = tuple(self._alloc(j))
            if i == len(self.spec) - 1:
                self._fake_next.clear()
            return out
        return self.fetch(i)

    def state_dict_entries(self) -> dict[str, torch.Tensor]:
        return {qn: self._source(qn).clone() for row in self.spec for qn, _, _ in row}

    def update(self, values: dict[str, torch.Tensor]) -> None:
        """Replace stored weights (load_state_dict)."""
        known = {qn: (shape, dt) for row in self.spec for qn, shape, dt in row}
        for k, v in values.items():
            if k not in known:
                raise KeyError(f"WeightStreamer: no streamed weight named {k!r}")
            if tuple(v.shape) != known[k][0]:
                raise ValueError(f"WeightStreamer: {k!r} has shape {tuple(v.shape)}, expected {known[k][0]}")
        flat = {qn: (values[qn] if qn in values else self._source(qn)).detach().to(known[qn][1]).cpu().clone()
                for qn in known}
        self._pending.clear()
        self._stash(flat)

    def install_state_dict_hooks(self, owner: nn.Module, attr: str) -> None:
        """Make `owner.state_dict()` / `load_state_dict()` see the streamed weights under their original names."""
        # the hooks find the streamer by attribute on the module they run for, so deep copies use their own
        def save_hook(module, state_dict, prefix, local_metadata):
            ws = getattr(module, attr, None)
            if isinstance(ws, WeightStreamer):
                for k, v in ws.state_dict_entries().items():
                    state_dict[prefix + k] = v
            return state_dict

        def load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs):
            ws = getattr(module, attr, None)
            if not isinstance(ws, WeightStreamer):
                return
            names = [qn for row in ws.spec for qn, _, _ in row]
            vals = {qn: state_dict.pop(prefix + qn) for qn in names if prefix + qn in state_dict}
            if vals:
                ws.update(vals)
            if strict:
                missing_keys.extend(prefix + qn for qn in names if qn not in vals)

        owner._register_state_dict_hook(save_hook)
        owner._register_load_state_dict_pre_hook(load_hook, with_module=True)

    def close(self) -> None:
        self._file = None
        self._pending.clear()
        if self._finalizer is not None:
            self._finalizer()

    def extra_repr(self) -> str:
        return f"tier={self.tier!r}, blocks={self.names}, prefetch={self.prefetch}"


# ============================================================================================ grads/optimizer

class OffloadedOptimizer:
    """ZeRO-Offload style: gradients leave the device as soon as they are accumulated, the optimizer steps on
    host copies of the parameters, and the updated values are copied back.

        opt = OffloadedOptimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        loss.backward(); opt.step(); opt.zero_grad()

    threshold: bytes; a gradient is moved only if the device's allocated memory is above it when the
    gradient is ready (memory pressure), otherwise it stays and is moved at `step()`. `memory_fn` measures the
    device's allocated bytes (default: torch.cuda.memory_allocated on CUDA, and on CPU the sum of live
    parameter and gradient bytes). Parameters end a step bit-identical to the wrapped optimizer run on the
    device, because the same optimizer code runs on the same values (fp32 or the parameter's dtype).
    """

    def __init__(self, params, make_optimizer: Callable[[list], torch.optim.Optimizer], threshold: int | None = None,
                 memory_fn: Callable[[], int] | None = None, host: str = "cpu"):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("OffloadedOptimizer: no parameters require grad")
        self.threshold = threshold
        pin = torch.cuda.is_available()
        self.host = torch.device(host)
        self.master = []
        for p in self.params:
            m = p.detach().to(self.host, copy=True)
            if pin and m.device.type == "cpu":
                m = m.pin_memory()
            self.master.append(nn.Parameter(m, requires_grad=True))
        self.optimizer = make_optimizer(self.master)
        self.memory_fn = memory_fn or self._default_memory
        self.moved = 0  # gradients moved early (in backward) in the last step
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    def _default_memory(self) -> int:
        dev = self.params[0].device
        if dev.type == "cuda":
            return int(torch.cuda.memory_allocated(dev))
        return sum(p.numel() * p.element_size() + (p.grad.numel() * p.grad.element_size() if p.grad is not None
                                                   else 0) for p in self.params)

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if self.threshold is not None and self.memory_fn() <= self.threshold:
                return
            self._move(i)
            self.moved += 1
        return hook

    def _move(self, i: int) -> None:
        p, m = self.params[i], self.master[i]
        if p.grad is None:
            return
        # a copy to the host that returns before it is done (non_blocking) is safe only where nothing reads it before
        # step() synchronizes; a gradient accumulated into one already moved is added on the host at once, so that
        # copy blocks (and, on the same stream, waits for the earlier one too)
        g = p.grad.detach().to(self.host, non_blocking=p.grad.is_cuda and m.grad is None)
        m.grad = g if m.grad is None else m.grad.add_(g)
        p.grad = None  # the device gradient is freed now

    def step(self) -> None:
        for i in range(len(self.params)):
            self._move(i)  # anything kept on the device (below the threshold)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m, non_blocking=p.is_cuda)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.moved = 0
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None

    @property
    def state(self):
        return self.optimizer.state

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
