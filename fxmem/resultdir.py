"""Reading a saved result directory: the manifest, the hash of every file read, and the module.

    gm = load_result(path)                      # module.json (data, checked) + weights.safetensors: runs no pickle
    gm = load_result(path, trust_code=True)     # also results of fxmem's formats 1-2, whose module.pt is a pickle
    code = transformed_code(path)               # the code the loaded module runs (what `fxmem diff` shows)

manifest.json lists the result's files with their sha256 (`sha256`) and carries the sha256 of its own other fields
(`manifest_sha256`); a file is checked against it before it is parsed. A damaged or changed result is an FxmemError
naming the file, never a raw decoding error.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from torch import fx, nn

from .errors import FxmemError
from .files import write_text
from .structure import StructureError, build, generated_code, load_quantized, plain_tensors

RESULT_KIND = "fxmem-result"  # manifest.json's "kind": how fxmem recognises a directory it wrote
SAVE_FORMAT = 3  # module.json (the structure as data) + weights.safetensors, every file hashed in the manifest
LEGACY_FORMATS = (1, 2)  # module.pt, a pickle (2: with quantized linears); read only with trust_code=True
MANIFEST, STRUCTURE, WEIGHTS = "manifest.json", "module.json", "weights.safetensors"
LEGACY_MODULE, ORIGINAL_CODE = "module.pt", "original.py"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


# ============================================================================================ hashes

def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_sha256(manifest: dict) -> str:
    """The sha256 of a manifest's fields other than `manifest_sha256` (canonical JSON)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def write_manifest(directory: Path, fields: dict) -> None:
    """manifest.json for the files now in `directory` (written last: it marks the directory as a complete result)."""
    files = sorted(set(os.listdir(directory)) | {MANIFEST})
    manifest = {"kind": RESULT_KIND, "format": SAVE_FORMAT, **fields, "files": files,
                "sha256": {f: file_sha256(directory / f) for f in files if f != MANIFEST}}
    manifest["manifest_sha256"] = manifest_sha256(manifest)
    write_text(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


# ============================================================================================ reading

def read_manifest(directory: Path) -> dict:
    manifest_path = directory / MANIFEST
    if not directory.is_dir():
        raise FxmemError(f"{directory}: {'not a directory' if directory.exists() else 'no such directory'} "
                         "(a result fxmem wrote is a directory)")
    try:
        data = manifest_path.read_bytes()
    except FileNotFoundError:
        raise FxmemError(f"{directory}: not an fxmem result (no {MANIFEST})") from None
    except OSError as error:
        raise FxmemError(f"{manifest_path}: cannot read it: {error.strerror or error}") from None
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FxmemError(f"{manifest_path}: not valid JSON; the result is damaged") from None
    if not isinstance(manifest, dict):
        raise FxmemError(f"{manifest_path}: not an fxmem manifest (a JSON object)")
    return manifest


def _check_manifest(directory: Path, manifest: dict) -> None:
    """A format-3 manifest: fxmem's kind, its own hash, a sha256 per file."""
    manifest_path = directory / MANIFEST
    if manifest.get("kind") != RESULT_KIND:
        raise FxmemError(f"{manifest_path}: not a result manifest written by fxmem (kind {manifest.get('kind')!r})")
    if manifest.get("manifest_sha256") != manifest_sha256(manifest):
        raise FxmemError(f"{manifest_path}: does not match its own sha256 (manifest_sha256): it was changed after "
                         "saving; refusing to load the result")
    hashes = manifest.get("sha256")
    if not isinstance(hashes, dict) or not all(isinstance(k, str) and isinstance(v, str) and _HEX64.match(v)
                                               for k, v in hashes.items()):
        raise FxmemError(f"{manifest_path}: sha256 must map each file to its hex digest")


def _verified_path(directory: Path, manifest: dict, name: str) -> Path:
    """`d/name`, after checking its sha256 against the manifest."""
    path = directory / name
    expected = manifest["sha256"].get(name)
    if expected is None:
        raise FxmemError(f"{path}: the manifest has no sha256 for it; the result is incomplete")
    try:
        actual = file_sha256(path)
    except FileNotFoundError:
        raise FxmemError(f"{path}: missing; the result is incomplete") from None
    except OSError as error:
        raise FxmemError(f"{path}: cannot read it: {error.strerror or error}") from None
    if actual != expected:
        raise FxmemError(f"{path}: does not match the manifest's sha256 (changed or damaged since it was saved); "
                         "refusing to load it")
    return path


def _read_verified_json(directory: Path, manifest: dict, name: str):
    path = _verified_path(directory, manifest, name)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FxmemError(f"{path}: not valid JSON") from None
    except OSError as error:
        raise FxmemError(f"{path}: cannot read it: {error.strerror or error}") from None


def _read_weights(path: Path, map_location) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    try:
        return load_file(str(path), device=str(map_location))
    except Exception as error:  # noqa: BLE001  (SafetensorError, OSError, a bad device: all say the file)
        raise FxmemError(f"{path}: cannot read the weights: {type(error).__name__}: {error}") from None


def _format(directory: Path, manifest: dict, trust_code: bool, what: str) -> int:
    fmt = manifest.get("format")
    if fmt == SAVE_FORMAT:
        return fmt
    if fmt in LEGACY_FORMATS and isinstance(fmt, int):
        if trust_code:
            return fmt
        raise FxmemError(f"{directory}: saved by an older fxmem (format {fmt}), whose module structure "
                         f"({LEGACY_MODULE}) is a pickle: {what} runs code. Load it with fxmem.load(path, "
                         "trust_code=True) only if you trust where it came from; saving the loaded result again writes "
                         f"format {SAVE_FORMAT}, which loads without running code")
    raise FxmemError(f"{directory / MANIFEST}: format {fmt!r}; this fxmem reads format {SAVE_FORMAT} (and, with "
                     f"trust_code=True, {' and '.join(map(str, LEGACY_FORMATS))})")


def load_result(path, *, map_location="cpu", trust_code: bool = False) -> fx.GraphModule:
    """The module of the result at `path` (see the module docstring)."""
    directory = Path(path)
    manifest = read_manifest(directory)
    if _format(directory, manifest, trust_code, "loading it") != SAVE_FORMAT:
        return _load_legacy(directory, manifest, map_location)
    _check_manifest(directory, manifest)
    doc = _read_verified_json(directory, manifest, STRUCTURE)
    tensors = _read_weights(_verified_path(directory, manifest, WEIGHTS), map_location)
    try:
        graph_module = build(doc, tensors)
    except StructureError as error:
        raise FxmemError(f"{directory / STRUCTURE}: {error}") from None
    if manifest.get("mode") != doc["mode"]:
        raise FxmemError(f"{directory / MANIFEST}: mode {manifest.get('mode')!r} differs from "
                         f"{STRUCTURE}'s {doc['mode']!r}")
    return graph_module


def transformed_code(path) -> str:
    """The code of the module `load_result(path)` gives, generated from the checked module.json (not read from
    transformed.py, which is a readable copy)."""
    directory = Path(path)
    manifest = read_manifest(directory)
    _format(directory, manifest, False, "showing its module would mean unpickling it, which")
    _check_manifest(directory, manifest)
    try:
        return generated_code(_read_verified_json(directory, manifest, STRUCTURE))
    except StructureError as error:
        raise FxmemError(f"{directory / STRUCTURE}: {error}") from None


def original_code(path) -> str:
    """The captured model's code (original.py), checked against the manifest."""
    directory = Path(path)
    manifest = read_manifest(directory)
    _format(directory, manifest, False, "showing its module would mean unpickling it, which")
    _check_manifest(directory, manifest)
    code_path = _verified_path(directory, manifest, ORIGINAL_CODE)
    try:
        return code_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise FxmemError(f"{code_path}: cannot read it: {getattr(error, 'strerror', None) or error}") from None


# ============================================================================================ formats 1-2

def _load_legacy(directory: Path, manifest: dict, map_location) -> fx.GraphModule:
    """A result of fxmem's formats 1-2 (trust_code=True): the pickled structure, then the weights."""
    module_path = directory / LEGACY_MODULE
    for name, key in ((LEGACY_MODULE, "module_sha256"), (WEIGHTS, "weights_sha256")):
        try:
            ok = file_sha256(directory / name) == manifest.get(key)
        except OSError as error:
            raise FxmemError(f"{directory / name}: cannot read it: {error.strerror or error}") from None
        if not ok:
            raise FxmemError(f"{directory / name}: does not match the manifest's {key}; refusing to load it")
    try:
        graph_module = torch.load(module_path, weights_only=False, map_location="cpu")
    except ModuleNotFoundError as error:
        package = (error.name or "").split(".")[0] or "a module"
        raise FxmemError(f"{module_path}: needs the package {package}, which is not installed ({error})") from None
    except Exception as error:  # noqa: BLE001  (a damaged pickle raises anything)
        raise FxmemError(f"{module_path}: cannot unpickle it: {type(error).__name__}: {error}") from None
    if not isinstance(graph_module, fx.GraphModule):
        raise FxmemError(f"{module_path}: holds a {type(graph_module).__name__}, not a GraphModule")
    ties, quantized = manifest.get("ties", {}), manifest.get("quantized", {})
    if not isinstance(ties, dict) or not isinstance(quantized, dict):
        raise FxmemError(f"{directory / MANIFEST}: ties and quantized must be objects")
    tensors = _read_weights(directory / WEIGHTS, map_location)
    _place_legacy_tensors(graph_module, tensors, ties, directory)
    try:
        load_quantized(graph_module, quantized, tensors)
    except StructureError as error:
        raise FxmemError(f"{directory}: {error}") from None
    graph_module.train(manifest.get("mode") == "train")
    return graph_module


def _place_legacy_tensors(graph_module: fx.GraphModule, tensors: dict, ties: dict, directory: Path) -> None:
    by_name = {qual: (mod, kind, name, tensor) for mod, kind, name, qual, tensor in plain_tensors(graph_module)
               if type(tensor) in (torch.Tensor, nn.Parameter)}
    for qual, (mod, kind, name, tensor) in by_name.items():
        src = tensors.get(ties.get(qual, qual))
        if src is None:
            raise FxmemError(f"{directory / WEIGHTS}: no tensor for {qual}")
        val = src.to(tensor.dtype)
        if isinstance(tensor, nn.Parameter):
            val = nn.Parameter(val, requires_grad=tensor.requires_grad)
        (mod._parameters if kind == "parameter" else mod._buffers)[name] = val
    for qual, first in ties.items():  # tied names share one tensor
        if qual not in by_name or first not in by_name:
            raise FxmemError(f"{directory / MANIFEST}: ties names {qual} -> {first}, which the module does not have")
        mod, kind, name, _ = by_name[qual]
        first_module, first_kind, first_name, _ = by_name[first]
        (mod._parameters if kind == "parameter" else mod._buffers)[name] = \
            (first_module._parameters if first_kind == "parameter" else first_module._buffers)[first_name]


# what a result held before its manifest listed its files ("files"); such results are recognised by their keys
LEGACY_RESULT_FILES = frozenset({"module.pt", "weights.safetensors", "transformed.py", "original.py", "manifest.json",
                                  "report.md", "report.html", "report.json", "memory_timeline.png",
                                  "memory_timeline.svg"})


def not_an_fxmem_result(directory: Path, entries: list[str]) -> str | None:
    """None when `directory` is a result fxmem wrote holding only the files it wrote; else why not (for a message)."""
    if "manifest.json" not in entries:
        return "it is not a result written by fxmem (no manifest.json)"
    try:
        man = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        man = None
    if not isinstance(man, dict):
        return "its manifest.json was not written by fxmem"
    if man.get("kind") == RESULT_KIND and isinstance(man.get("files"), list):
        files = {str(f) for f in man["files"]}
    elif isinstance(man.get("fxmem"), str) and "format" in man and "module_sha256" in man:
        files = set(LEGACY_RESULT_FILES)  # written before manifests listed their files
    else:
        return "its manifest.json was not written by fxmem"
    files.add("manifest.json")
    extra = [e for e in entries if e not in files or os.path.islink(directory / e) or not (directory / e).is_file()]
    if extra:
        shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
        return f"it holds {len(extra)} entr{'y' if len(extra) == 1 else 'ies'} fxmem did not write ({shown})"
    return None
