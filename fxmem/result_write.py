"""Writing a result directory's files: the module as data (module.json), its weights, its code, the report.

`write_result_files` fills a directory (the scratch directory `fxmem.output_dir.OutputDir` moves into place);
`unsaveable` says, before anything is written, why a module cannot be saved. Reading them back: `fxmem.resultdir`.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import fx, nn

from . import __version__
from .errors import FxmemError
from .files import write_text, writing
from .nn.lowbit import QuantLinear
from .nn.offload import WeightStreamer
from .resultdir import STRUCTURE, WEIGHTS, write_manifest
from .structure import describe, format_code, generated_code


def full_code(graph_module: nn.Module) -> str:
    """The generated code of a GraphModule and of every GraphModule inside it, readable."""
    modules = [("", graph_module)] + list(graph_module.named_modules())[1:]
    return format_code(type(graph_module).__name__, [(name, mod.code) for name, mod in modules
                                                     if isinstance(mod, fx.GraphModule)])


def _quantized_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) for every bitsandbytes layer wrapper (`fxmem.nn.lowbit.QuantLinear`): their weights
    are bitsandbytes parameters with state outside the tensor, saved by `quantized_state()`, not as plain tensors."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, QuantLinear)]


def unsaveable(module: nn.Module) -> str | None:
    """Why `module` cannot be saved (a one-line reason for an FxmemError), or None. Checked before anything is
    written: a module holding a WeightStreamer (weight offload: its weights live in a scratch file, and the hooks
    that make its owner's state_dict see them are local functions), or any module whose `__getstate__` refuses."""
    for name, mod in module.named_modules():
        where = f"{name or '<root>'} ({type(mod).__name__})"
        if isinstance(mod, WeightStreamer):
            return (f"results with weight offload (passes.offload.weights) cannot be saved: {where} streams "
                    "frozen weights from a scratch file that exists only while this process runs; run the "
                    "transform where the model is used (fxmem.transform), or save the weights with "
                    "torch.save(result.module.state_dict(), ...) (it holds the streamed weights under their "
                    "original names)")
        getstate = getattr(type(mod), "__getstate__", None)
        if getstate is not None and getstate is not nn.Module.__getstate__:
            try:
                getstate(mod)
            except Exception as error:  # noqa: BLE001  (the module's own refusal: say it)
                return f"{where} cannot be saved: {error}"
    return None


def write_result_files(result, directory: Path) -> None:
    """The files of `result` (a TransformResult) in `directory`, the manifest last."""
    from safetensors.torch import save_file
    graph_module = result.module
    why = unsaveable(graph_module)  # (OutputDir.write comes here directly: the CLI; it removes its scratch directory)
    if why is not None:
        raise FxmemError(f"{why}; nothing was written")
    # quantized linears: their bitsandbytes weight and state as tensors + JSON fields; taken out of the modules
    # while the structure and its plain tensors are described
    quant_weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    quant_mods = _quantized_modules(graph_module)
    for qual, mod in quant_mods:
        try:
            tensors, fields = mod.quantized_state()
        except ValueError as error:
            raise FxmemError(f"cannot save the quantized layer {qual}: {error}; nothing was written") from None
        for key, tensor in tensors.items():
            quant_weights[f"{qual}.{key}"] = tensor.detach().contiguous().cpu()
        quantized[qual] = fields
    with contextlib.ExitStack() as stack:
        for _, mod in quant_mods:
            stack.enter_context(mod.without_quantized_state())
        try:
            doc, weights = describe(graph_module, mode=result.policy.mode, quantized=quantized)
            code = generated_code(doc)  # what loading will generate: checks the description as loading does
        except ValueError as error:
            raise FxmemError(f"cannot save the result: {error}; nothing was written") from None
    expected = full_code(graph_module)
    if code != expected:  # the description would load as another module: a bug, never written
        line = next((f"{a!r} != {b!r}" for a, b in zip(code.splitlines(), expected.splitlines()) if a != b), "")
        raise RuntimeError(f"the saved description of the module does not generate the module's code ({line})")
    clash = sorted(set(weights) & set(quant_weights))
    if clash:
        raise FxmemError(f"cannot save: {clash[0]} names both a tensor and a quantized layer's state")
    weights.update(quant_weights)
    with writing(directory / WEIGHTS):
        save_file(weights, str(directory / WEIGHTS))
    write_text(directory / STRUCTURE, json.dumps(doc, indent=1) + "\n")
    write_text(directory / "transformed.py", code)
    write_text(directory / "original.py", full_code(result.original.module))
    if result.report is not None:
        result.report.save(directory)
    write_manifest(directory, {"fxmem": __version__, "torch": torch.__version__, "model": result.program.model_name,
                       "mode": result.policy.mode, "inputs": list(result.program.input_names)})
