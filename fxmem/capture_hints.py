"""The hint a CaptureError ends with: what the user can change so that the model captures.

Known libraries get hints of their own, found from the traceback: PyG (torch_geometric) computes sizes from tensor
values (`int(batch.max()) + 1`) where the caller did not pass them, which torch.export cannot keep symbolic; the
hint names the PyG function the model called and the argument that takes the size (`size=` for global pooling).
"""
from __future__ import annotations

import os
import traceback

_SIZE_PARAMETERS = ("size", "dim_size", "batch_size", "num_graphs", "max_num_nodes")
_PYG = "torch_geometric"


def hint_for(error: BaseException) -> str:
    """One line of advice for a failed export (a known library's hint first, else one from the message)."""
    message = str(error).lower()
    if _is_data_dependent(message):
        library = _pyg_hint(error)
        if library is not None:
            return library
    return _message_hint(message)


def _is_data_dependent(message: str) -> bool:
    return any(word in message for word in ("data-dependent", "datadependent", "guardondatadependent", ".item()"))


def _message_hint(message: str) -> str:
    if "cache" in message:
        return "pass use_cache=False (Hugging Face models) so the model does not return a cache object"
    if _is_data_dependent(message):
        return ("the model branches on a tensor's value; make the branch static (python values), use "
                "torch.cond, or move it out of forward")
    if "constraint" in message or "specializ" in message or "dynamic" in message:
        return "a dynamic dim conflicts with the model; pass dynamic=False to capture static shapes"
    if "unsupported" in message or "not supported" in message:
        return "an operation torch.export cannot trace; rewrite it with torch ops"
    return "torch's full error and traceback are in the file this message names"


def _frames(error: BaseException) -> list:
    """(frame, line number) of every traceback in the exception's chain, outermost first."""
    frames, seen = [], set()
    current: BaseException | None = error
    chain = []
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    for exc in reversed(chain):
        frames.extend(traceback.walk_tb(exc.__traceback__))
    return frames


def _in_pyg(filename: str) -> bool:
    return f"{os.sep}{_PYG}{os.sep}" in os.path.abspath(filename)


def _pyg_hint(error: BaseException) -> str | None:
    """The PyG function the model called (the outermost PyG frame) and where PyG read a tensor's value (the
    innermost one), with the argument that takes the size when the function has one."""
    pyg = [(frame, line) for frame, line in _frames(error) if _in_pyg(frame.f_code.co_filename)]
    if not pyg:
        return None
    entry, inner = pyg[0][0], pyg[-1]
    code = entry.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    owner = entry.f_locals.get("self") if "self" in names else None
    function = type(owner).__name__ if owner is not None else code.co_name
    filename = inner[0].f_code.co_filename
    where = f"{_PYG}{os.path.abspath(filename).split(os.sep + _PYG, 1)[-1]}:{inner[1]}"
    said = (f"torch_geometric's {function} computes a size from a tensor's values ({where}), which torch.export "
            "cannot keep symbolic")
    parameter = next((name for name in _SIZE_PARAMETERS if name in names), None)
    if parameter is None:
        return f"{said}; compute that size outside this call and pass it, or avoid the call in forward"
    call = f"call {function} with {parameter}=" if owner is not None else f"call {function}(..., {parameter}=)"
    return (f"{said}: {call} the number of graphs (groups) it reduces over, read from a tensor's shape to keep it "
            "dynamic (e.g. ptr.numel() - 1 with PyG's Batch.ptr, or the length of a per-graph target); a python int "
            "fixes it at capture")
