"""Scratch directories beside an output (`.NAME.fxmem-tmp-XXXX`), where a result is written before it is moved into
place, and the clean-up of those that runs killed on the way left behind.

Each scratch directory holds a marker file (`.fxmem-staging`: the output's name, the process id) that its run keeps
locked (`flock`) for as long as it holds the directory; the system drops the lock when the process ends, however it
ends (SIGKILL, a crash). A later run to the same output removes the earlier runs' leftovers: only directories named
like fxmem's scratch directories for that output, holding a marker that names it, whose lock nobody holds (a live run,
this one or another, keeps its own). A leftover holding the previous result of an interrupted replacement while the
output is missing is kept (it is the only copy) and said. Without `flock` (not POSIX) nothing is removed.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

TMP_TAG = ".fxmem-tmp-"
MARKER = ".fxmem-staging"
_KIND = "fxmem-staging"


def scratch_prefix(name: str) -> str:
    """The name of the scratch directories for an output named `name` starts with this (a short prefix, so the name
    fits however long the output's is: NAME_MAX is 255 bytes on most systems)."""
    return "." + name[:48] + TMP_TAG


def claim_scratch(parent: Path, name: str) -> tuple[Path, int]:
    """A new scratch directory in `parent` for the output `parent/name`, claimed by this process: (its path, the
    descriptor of its locked marker file; `release_scratch` closes it). OSError when `parent` is not writable."""
    directory = Path(tempfile.mkdtemp(prefix=scratch_prefix(name), dir=parent))
    descriptor = None
    try:
        descriptor = os.open(directory / MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if fcntl is not None:
            fcntl.flock(descriptor, fcntl.LOCK_EX)  # a later run's check may hold it for a moment
        # written under the lock: a check that sees no complete marker keeps the directory
        os.write(descriptor, json.dumps({"kind": _KIND, "output": name, "pid": os.getpid()}).encode())
    except BaseException:
        if descriptor is not None:
            os.close(descriptor)
        remove_path(directory)
        raise
    return directory, descriptor


def release_scratch(descriptor: int, directory: Path | None = None) -> None:
    """Give up the claim. With `directory` (a scratch directory kept because it holds a previous result), its
    marker is removed first, so that no later run takes the directory for a leftover."""
    if directory is not None:
        try:
            os.unlink(directory / MARKER)
        except OSError:
            pass
    os.close(descriptor)


def remove_abandoned(parent: Path, name: str) -> list[Path]:
    """Remove the scratch directories for `parent/name` that runs no longer alive left behind; returns them."""
    prefix = scratch_prefix(name)
    try:
        entries = [e for e in os.listdir(parent) if e.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for entry in entries:
        directory = parent / entry
        if not _abandoned(directory, name):
            continue
        if os.path.lexists(directory / "previous") and not os.path.lexists(parent / name):
            warnings.warn(f"fxmem: {directory / 'previous'} holds the previous result of {parent / name}, left by "
                          "a run killed while it replaced it; kept (move it back, or remove it)", RuntimeWarning,
                          stacklevel=2)
            continue
        remove_path(directory)
        removed.append(directory)
    return removed


def _abandoned(directory: Path, name: str) -> bool:
    """`directory` is a scratch directory fxmem made for the output `name` and its run is over (nobody holds the
    lock on its marker)."""
    marker = directory / MARKER
    if fcntl is None or os.path.islink(directory) or not directory.is_dir() or os.path.islink(marker):
        return False
    try:
        descriptor = os.open(marker, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        info = json.loads(os.read(descriptor, 4096).decode("utf-8"))
    except (OSError, ValueError):  # held by a live run, or not (yet) a marker fxmem wrote
        return False
    finally:
        os.close(descriptor)
    return isinstance(info, dict) and info.get("kind") == _KIND and info.get("output") == name


def remove_path(path: Path) -> None:
    """Remove a file, a link (not what it points to) or a directory tree; a leftover is said, never silent."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        warnings.warn(f"fxmem: could not remove the scratch directory {path}: {error.strerror or error}",
                      RuntimeWarning, stacklevel=2)
