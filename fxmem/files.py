"""Writing a result's files: a failure (a full disk, a quota, a read-only file system) is an OSError naming the file.

Python's own writes raise OSError without a file name once the file is open, torch.save reports a failed write as a
bare RuntimeError, and safetensors as a SafetensorError with the system's error number in its text: the helpers
here turn each into `OSError(errno, strerror, path)`, which the output directory reports as the user's error.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path
from typing import Iterator

_OS_ERROR = re.compile(r"os error (\d+)")


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Errors while the block writes `path` come out as OSError naming it (an OSError naming another file stays)."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            raise OSError(error.errno, error.strerror or str(error), os.fspath(path)) from error
        raise
    except Exception as error:
        if type(error).__name__ != "SafetensorError":
            raise
        text = " ".join(str(error).split())
        found = _OS_ERROR.search(text)
        if found is not None:
            code = int(found.group(1))
            raise OSError(code, os.strerror(code), os.fspath(path)) from error
        if "I/O error" in text:
            raise OSError(errno.EIO, text, os.fspath(path)) from error
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with writing(path):
        Path(path).write_text(text, encoding="utf-8")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with writing(path):
        Path(path).write_bytes(data)
