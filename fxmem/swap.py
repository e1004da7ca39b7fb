"""Replacing a directory by another without a moment where neither is in place, nor an interrupt in between.

`exchange` swaps two paths atomically where the system can (Linux renameat2); `signals_deferred` holds SIGINT and
SIGTERM back for the few renames where it cannot. `fxmem.output_dir.OutputDir` moves results into place with them.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import sys
import threading
from pathlib import Path


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT and SIGTERM back for a short critical section (renames, removing scratch files): a signal that
    arrives is noted and handled as usual when the section ends, so an interrupt never lands between two renames.
    Python handlers run in the main thread whichever thread the signal reached, so swapping the handlers (rather
    than masking the signal in this thread) holds with the worker threads torch starts. Elsewhere than the main
    thread a signal does not interrupt Python code anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old: dict = {}

    def note(signum, frame):
        pending.append(signum)

    try:
        for signal_number in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
            if signal_number is None:
                continue
            handler = signal.getsignal(signal_number)
            if handler is None:  # installed outside Python: cannot be put back, leave it
                continue
            old[signal_number] = handler
            signal.signal(signal_number, note)
        yield
    finally:
        for signal_number, handler in old.items():
            signal.signal(signal_number, handler)
        for signal_number in dict.fromkeys(pending):
            handler = old[signal_number]
            if callable(handler):
                handler(signal_number, None)  # e.g. raises KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signal_number)  # the default action (terminate), now that the section is done


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE): even a crash leaves one or the other in
    place. False where the system or the file system has no such call (then two renames, with signals held back)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(second))
