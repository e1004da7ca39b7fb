"""Scratch files of the offload tiers and the threads that write and read them: a directory of our own per file,
removed on success, failure and exit; whole-buffer positional I/O that releases the GIL."""
from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch


SCRATCH_PREFIX = "fxmem-offload-"
TIERS = ("cpu", "disk")

# one writer and one reader thread for the whole process (I/O releases the GIL)
_EXECUTORS: dict[str, ThreadPoolExecutor] = {}
_EXEC_LOCK = threading.Lock()


def executor(kind: str) -> ThreadPoolExecutor:
    with _EXEC_LOCK:
        pool = _EXECUTORS.get(kind)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fxmem-offload-{kind}")
            _EXECUTORS[kind] = pool
        return pool


def submit_io(kind: str, io, descriptor: int, buffer: torch.Tensor, offset: int) -> Future:
    """`io(descriptor, memoryview of buffer, offset)` on the `kind` thread. The thread lets go of `buffer` before
    the future completes: ThreadPoolExecutor's worker keeps a task's arguments until after it has set the result, so
    a caller that waited and then dropped its tensor would otherwise free it only when that thread next runs."""
    return executor(kind).submit(_io_from_box, io, descriptor, [buffer], offset)


def _io_from_box(io, descriptor: int, box: list, offset: int) -> None:
    io(descriptor, memoryview(box.pop().numpy()), offset)


def cleanup_files(fd_box: list, path: str | None, dir_: str | None) -> None:
    """Close the scratch file and remove it and its directory (idempotent; runs from finalizers)."""
    descriptor = fd_box[0] if fd_box else None
    if descriptor is not None:
        fd_box[0] = None
        try:
            os.close(descriptor)
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


def pwrite_all(descriptor: int, buffer_view: memoryview, offset: int) -> None:
    """Write all of `buffer_view` at `offset` (os.pwritev may write less than asked)."""
    _transfer_all(os.pwritev, descriptor, buffer_view, offset, "short write to")


def pread_all(descriptor: int, buffer_view: memoryview, offset: int) -> None:
    """Read all of `buffer_view` from `offset` (os.preadv may read less than asked)."""
    _transfer_all(os.preadv, descriptor, buffer_view, offset, "short read from")


def _transfer_all(transfer, descriptor: int, buffer_view: memoryview, offset: int, shortfall: str) -> None:
    buffer_view = buffer_view.cast("B")
    done = 0
    while done < len(buffer_view):
        count = transfer(descriptor, [buffer_view[done:]], offset + done)
        if count <= 0:
            raise OSError(f"fxmem offload: {shortfall} scratch file ({done} of {len(buffer_view)} bytes)")
        done += count
