"""Model files for the CLI: a Python file defining `build_model()` and `example_inputs()`.

Optional: `loss_fn(output, inputs)`, `calibration_data()`, `evaluate(module)`. A model file is user code and
runs as such, exactly like `python model.py` would run it.
"""
from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from .errors import ModelFileError


@dataclass
class ModelFile:
    path: Path
    module: ModuleType
    model: nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable | None
    calibration_data: Callable | None
    evaluate: Callable | None

    @property
    def name(self) -> str:
        return self.path.stem

    def calibration(self, limit: int | None = None) -> list | None:
        if self.calibration_data is None:
            return None
        try:
            data = self.calibration_data()
            out = []
            for i, item in enumerate(data):
                if limit is not None and i >= limit:
                    break
                out.append(item)
            return out
        except Exception as e:  # noqa: BLE001
            raise ModelFileError(f"{self.path}: calibration_data() failed: {type(e).__name__}: {e}") from e


def _user_line(exc: BaseException, path: Path) -> str:
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if Path(fr.filename).resolve() == path.resolve():
            return f"{path.name}:{fr.lineno}"
    return str(path.name)


def split_inputs(inputs: Any, path: Path | str = "model file") -> tuple[tuple, dict]:
    """example_inputs() may return a tuple/list of args, a dict of kwargs, or a single tensor."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    raise ModelFileError(f"{path}: example_inputs() must return a tuple of arguments, a dict of keyword "
                         f"arguments or a tensor, got {type(inputs).__name__}")


def load_model_file(path: str | Path, **build_kwargs) -> ModelFile:
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file")
    if p.is_dir() or p.suffix != ".py":
        raise ModelFileError(f"{p}: expected a Python model file (.py) defining build_model() and example_inputs()")
    name = f"fxmem_model_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, p)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(p.resolve().parent))
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001
        raise ModelFileError(f"{_user_line(e, p)}: importing the model file failed: {type(e).__name__}: {e}") from e
    finally:
        try:
            sys.path.remove(str(p.resolve().parent))
        except ValueError:
            pass
    for fn in ("build_model", "example_inputs"):
        if not callable(getattr(mod, fn, None)):
            raise ModelFileError(f"{p}: the model file must define {fn}() (see examples/ for the protocol)")
    try:
        model = mod.build_model(**build_kwargs)
    except Exception as e:  # noqa: BLE001
        raise ModelFileError(f"{_user_line(e, p)}: build_model() failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{p}: build_model() must return a torch.nn.Module, got {type(model).__name__}")
    try:
        inputs = mod.example_inputs()
    except Exception as e:  # noqa: BLE001
        raise ModelFileError(f"{_user_line(e, p)}: example_inputs() failed: {type(e).__name__}: {e}") from e
    args, kwargs = split_inputs(inputs, p)
    return ModelFile(p, mod, model, args, kwargs, getattr(mod, "loss_fn", None),
                     getattr(mod, "calibration_data", None), getattr(mod, "evaluate", None))


def check_inputs(mf: ModelFile) -> None:
    """Run the model once on its example inputs, so a rejection is reported as the user's error."""
    try:
        with torch.no_grad():
            was = mf.model.training
            mf.model.eval()
            try:
                mf.model(*mf.args, **mf.kwargs)
            finally:
                mf.model.train(was)
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelFileError(f"{mf.path}: the model rejects example_inputs(): {type(e).__name__}: {first}") from e
