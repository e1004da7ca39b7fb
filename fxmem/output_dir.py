"""Where a result goes: `OutputDir` checks and reserves it before any work and moves the written result into
place atomically; `save_result` is `TransformResult.save`."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import FxmemError
from .result_write import unsaveable, write_result_files
from .resultdir import not_an_fxmem_result
from .staging import claim_scratch, release_scratch, remove_abandoned, remove_path
from .swap import exchange, signals_deferred


def save_result(result, path, *, overwrite: bool = False) -> Path:
    """Directory layout: module.json (the module structure and graphs as data, `fxmem.structure`),
    weights.safetensors (every parameter and buffer), transformed.py (the code module.json generates), original.py,
    the report files, and manifest.json (written last: it lists the files with their sha256 and marks the directory as
    a result fxmem wrote). Written to a temp dir beside `path` and renamed into place. Quantized linears
    (`fxmem.nn.lowbit.QuantLinear`) keep their bitsandbytes weights and quantization state as tensors in
    weights.safetensors and JSON fields in module.json ("quantized"). `fxmem.load` reads it without running pickles.

    An existing `path` is replaced only when it is an empty directory, or a result fxmem wrote and `overwrite=True`;
    never a file, a link, a directory holding anything else, or the current working directory. See `OutputDir`.
    A result that cannot be saved (weight offload) is an FxmemError before anything is written."""
    why = unsaveable(result.module)
    if why is not None:
        raise FxmemError(f"{os.fspath(path)}: {why}; nothing was written")
    with OutputDir(path, overwrite=overwrite) as out:
        return out.write(result)


class OutputDir:
    """Where a result goes, checked and reserved before any work, so a run that cannot write its result fails in a
    second rather than after the transform.

    The target must be a new path, an empty directory, or (with `overwrite`) a result written by fxmem that holds
    only files fxmem wrote; it must not be a file or a symbolic link, be or contain the current working directory,
    or contain one of `protect` (`(label, path)` pairs: the model file, the policy file). Missing parent directories
    are created, and a hidden scratch directory `.NAME.fxmem-tmp-*` beside the target (same file system, so the
    final move is a rename) proves the place writable; the ones earlier runs to the same target left behind (killed
    by SIGKILL, a crash) are removed first, never a live run's (`fxmem.staging`). `write` fills it and moves the
    result into place: the swap with a previous result is atomic (an exchange where the system has one), and
    SIGINT/SIGTERM are held back during it, so the target is always the old result or the new one. `discard` (also
    on leaving a `with` block) removes the scratch directory and the parents this object created unless the result
    was written. Errors are `FxmemError`s naming the path, one line each (a failed write names the file)."""

    def __init__(self, path, *, overwrite: bool = False, protect=()):
        self.given = os.fspath(path)
        self.overwrite = bool(overwrite)
        self.protect = [(label, os.fspath(p)) for label, p in protect]
        self.committed = False  # the result is in place
        self.staging: Path | None = None
        self._created: list[Path] = []  # parent directories made here (removed again if nothing is written)
        self._keep_staging = False  # it holds the previous result (a failed swap could not put it back)
        self._claim: int | None = None  # the locked marker file of the scratch directory (see fxmem.staging)
        self.shown = self.given
        if not self.given.strip():
            raise FxmemError("--out: the output path is empty; nothing was written")
        if os.path.islink(self.given):
            raise self._error(f"is a symbolic link (to {os.readlink(self.given)}); fxmem writes a new directory or "
                              "replaces one it wrote, never a link: give a new path")
        self.dest = Path(os.path.realpath(self.given))
        if os.path.abspath(self.given) != str(self.dest):
            self.shown = f"{self.given} (= {self.dest})"
        try:
            self._check_name()
            self._check()
            self._was_new = not (self.dest.is_dir() and os.listdir(self.dest))  # absent or empty now
        except OSError as error:  # a path the system cannot look at (too long, a loop of links, no permission)
            raise self._error(f"cannot use it: {error.strerror or error}") from None
        self._reserve()

    # ------------------------------------------------------------------------------------------- checks
    def _error(self, why: str, *, nothing: bool = True) -> FxmemError:
        return FxmemError(f"{self.shown}: {why}" + ("; nothing was written" if nothing else ""))

    def _check(self) -> None:
        """The target as it is now (run again just before the result is moved into place)."""
        dest = self.dest
        if dest.parent == dest:
            raise self._error("is the root of the file system")
        if os.path.islink(dest):  # appeared since
            raise self._error("is a symbolic link; fxmem writes a new directory or replaces one it wrote, never a link")
        if os.path.lexists(dest) and not dest.is_dir():
            raise self._error("is a file, not a directory; fxmem writes a result directory, and replaces only one it "
                              "wrote (choose another --out)")
        try:
            cwd = Path(os.getcwd()).resolve()
        except OSError:  # the working directory was removed
            cwd = None
        if cwd is not None and dest == cwd:
            raise self._error("is the current working directory; fxmem never replaces it (choose a new directory)")
        if cwd is not None and dest in cwd.parents:
            raise self._error(f"contains the current working directory ({cwd}); fxmem never replaces it "
                              "(choose a new directory)")
        for label, path in self.protect:
            real_path = Path(os.path.realpath(path))
            if dest == real_path or dest in real_path.parents:
                raise self._error(f"contains {label} {path}; fxmem never replaces it (choose a new directory)")
        if not dest.is_dir():
            return
        try:
            entries = sorted(os.listdir(dest))
        except OSError as error:
            raise self._error(f"cannot read it: {error.strerror or error}") from None
        if not entries:
            return  # an empty directory is taken as it is
        foreign = not_an_fxmem_result(dest, entries)
        if not self.overwrite:
            if foreign is None:
                raise self._error("already exists (a result written by fxmem); nothing was written (choose another "
                                  "--out, or pass --overwrite to replace it atomically)", nothing=False)
            raise self._error(f"already exists and is not empty, and {foreign}; nothing was written (choose another "
                              "--out: --overwrite replaces only a result written by fxmem)", nothing=False)
        if foreign is not None:
            raise self._error(f"{foreign}; --overwrite replaces only a result written by fxmem or an empty "
                              "directory (choose another --out)")

    def _check_name(self) -> None:
        """The parent's nearest existing directory, and a name that file system takes."""
        existing = self.dest.parent
        while not os.path.lexists(existing):
            existing = existing.parent
        if not existing.is_dir():
            raise self._error(f"{existing} is not a directory")
        try:
            name_max = os.pathconf(existing, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):
            name_max = 255
        name_bytes = len(os.fsencode(self.dest.name))
        if name_max and name_max > 0 and name_bytes > name_max:
            raise self._error(f"the name is too long ({name_bytes} bytes; this file system allows {name_max})")

    def _reserve(self) -> None:
        parent, name = self.dest.parent, self.dest.name
        missing = []
        ancestor = parent
        while not os.path.lexists(ancestor):
            missing.append(ancestor)
            ancestor = ancestor.parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if directory.is_dir():
                    continue  # made by someone else meanwhile
                self.discard()
                raise self._error(f"{directory} is not a directory") from None
            except OSError as error:
                self.discard()
                raise self._error(f"cannot create the directory {directory}: {error.strerror or error}") from None
            self._created.append(directory)
        remove_abandoned(parent, name)  # what earlier runs to this output left (killed by SIGKILL, ...)
        try:
            self.staging, self._claim = claim_scratch(parent, name)
        except OSError as error:
            self.discard()
            raise self._error(f"cannot write in {parent}: {error.strerror or error}") from None

    # ------------------------------------------------------------------------------------------- writing
    def write(self, result) -> Path:
        """Write `result` into the scratch directory and move it into place; return the target."""
        if self.staging is None or self.committed:
            raise RuntimeError("OutputDir.write: this output was already written or discarded")
        new = self.staging / "result"
        try:
            new.mkdir()
            write_result_files(result, new)
        except OSError as error:  # a full disk, a quota, a read-only file system (`files.writing` names the file)
            where = written_file(error, new)
            raise self._error(f"writing the result failed{where}: {error.strerror or error}") from error
        with signals_deferred():  # a signal during the swap is handled once the scratch directory is gone too
            self._commit(new)
            self.discard()
        return self.dest

    def _commit(self, new: Path) -> None:
        with signals_deferred():
            try:
                self._check()  # the target may have changed during the run (another run, the user)
            except FxmemError:
                if self._was_new and os.path.lexists(self.dest):
                    raise self._error("was created by another process while fxmem ran (another fxmem run with the "
                                      "same --out?)") from None
                raise
            except OSError as error:
                raise self._error(f"cannot use it: {error.strerror or error}") from None
            dest = self.dest
            if dest.is_dir() and os.listdir(dest):
                self._swap(new, dest)  # a result fxmem wrote, with --overwrite (else _check raised)
            else:
                try:
                    os.replace(new, dest)  # a new path, or an empty directory (replaced by the rename)
                except OSError as error:
                    if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                        raise self._error("was created by another process while fxmem ran (another fxmem run "
                                          "with the same --out?)") from None
                    raise self._error(f"cannot move the result into place: {error.strerror or error}") from None
            self.committed = True

    def _swap(self, new: Path, dest: Path) -> None:
        """Replace the result at `dest` by `new`; the previous one ends up in the scratch directory (removed next)."""
        try:
            if exchange(new, dest):
                return  # atomic: `new` now holds the previous result
        except OSError as error:
            raise self._error(f"cannot replace it: {error.strerror or error}") from None
        old = self.staging / "previous"
        try:
            os.replace(dest, old)
        except OSError as error:
            raise self._error(f"cannot move the previous result aside: {error.strerror or error}") from None
        try:
            os.replace(new, dest)
        except BaseException as error:
            try:
                os.replace(old, dest)  # put the previous result back
            except OSError as restore_error:
                self._keep_staging = True
                raise self._error(f"cannot move the result into place ({error}), nor the previous result back "
                                  f"({restore_error.strerror or restore_error}): the previous result is in {old}",
                                  nothing=False) from None
            if isinstance(error, OSError):
                raise self._error(f"cannot move the result into place: {error.strerror or error}") from None
            raise

    def discard(self) -> None:
        """Remove the scratch directory (and, unless the result was written, the parents created for it)."""
        with signals_deferred():
            if self.staging is not None and not self._keep_staging:
                remove_path(self.staging)
                self.staging = None
            if self._claim is not None:
                release_scratch(self._claim, self.staging if self._keep_staging else None)
                self._claim = None
            if not self.committed:
                for directory in reversed(self._created):
                    try:
                        os.rmdir(directory)
                    except OSError:
                        break
            self._created = []

    def __enter__(self) -> "OutputDir":
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


def written_file(error: OSError, result_dir: Path) -> str:
    """" at NAME" for the file of the result that `error` names (its path inside the result), "" when it names none."""
    if not isinstance(error.filename, str):
        return ""
    try:
        return f" at {Path(error.filename).relative_to(result_dir)}"
    except ValueError:
        return f" at {error.filename}"
