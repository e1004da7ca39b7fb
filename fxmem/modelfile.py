"""Model files for the CLI: a Python file defining `build_model()` and `example_inputs()`.

Optional: `loss_fn(output, inputs)`, `calibration_data()`, `evaluate(module)` with `evaluate_mode = "max"` (higher
is better, the default) or `"min"` (lower is better). A model file is user code and runs as such, exactly like
`python model.py` would run it.
"""
from __future__ import annotations

import contextlib

import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from .errors import FxmemError, LossFnError, ModelFileError, first_line
from .lossguard import Evaluator
from .step import require_trainable_loss
from .userstate import mode_set, model_state_kept


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
    evaluate_mode: str | None = None

    def evaluator(self):
        """The model file's task metric for the guard of lossy changes (`fxmem.lossguard.Evaluator`), or None;
        a failure inside evaluate() is the user's error naming the file."""
        if self.evaluate is None:
            return None
        evaluate = self.evaluate
        return Evaluator(lambda module: call_user(self.path, "evaluate(module)", evaluate, module),
                         self.evaluate_mode or "max")

    @property
    def name(self) -> str:
        return self.path.stem

    def calibration(self, limit: int | None = None) -> list | None:
        if self.calibration_data is None:
            return None

        def take() -> list:
            out = []
            for index, item in enumerate(self.calibration_data()):
                if limit is not None and index >= limit:
                    break
                out.append(item)
            return out
        return call_user(self.path, "calibration_data()", take)


def call_user(path: Path, what: str, function: Callable, *args, **kwargs) -> Any:
    """Run model-file code (`what`, e.g. "build_model()"): an exception it raises is the user's error, one line naming
    the file, its line and `what`. So is SystemExit (`sys.exit()`, `exit()`, `quit()`), which would otherwise end
    fxmem silently with the model's exit status. KeyboardInterrupt passes through (130/143 stay interruptions)."""
    try:
        return function(*args, **kwargs)
    except SystemExit as error:
        raise ModelFileError(f"{_user_path_line(error, path)}: {what} raised SystemExit({error.code!r}) (sys.exit(), "
                             "exit() or quit()), which would end fxmem's run; fxmem imports the model file and calls "
                             "its functions, so script code belongs under `if __name__ == \"__main__\":`") from None
    except FxmemError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's code
        raise ModelFileError(f"{_user_path_line(error, path)}: {what} failed: {type(error).__name__}: "
                             f"{first_line(str(error))}") from error


class UserLossFn:
    """The model file's `loss_fn(output, inputs)`, called as the protocol says; a failure inside it, or a result that
    is not a scalar tensor, raises `LossFnError` naming the file, its line and `loss_fn`, with the original error
    (chained). Exceptions fxmem uses for control flow while tracing (a size that depends on tensor values) pass
    through unchanged, so the cost model can retry with real values."""

    def __init__(self, loss_fn: Callable, path: Path):
        self.fn, self.path = loss_fn, Path(path)
        self.__name__ = getattr(loss_fn, "__name__", "loss_fn")
        self.__doc__ = getattr(loss_fn, "__doc__", None)
        self.__wrapped__ = loss_fn

    def __call__(self, output, inputs):
        try:
            loss = self.fn(output, inputs)
        except SystemExit as error:
            raise LossFnError(f"{_user_path_line(error, self.path)}: loss_fn(output, inputs) raised "
                              f"SystemExit({error.code!r}) (sys.exit(), exit() or quit()), which would end fxmem's run"
                              ) from None
        except FxmemError:
            raise
        except Exception as error:  # noqa: BLE001 - the user's code
            if _is_trace_control_flow(error):
                raise
            raise LossFnError(f"{_user_path_line(error, self.path)}: loss_fn(output, inputs) failed: "
                              f"{type(error).__name__}: {first_line(str(error))}") from error
        if not isinstance(loss, torch.Tensor):
            raise LossFnError(f"{self.path}: loss_fn(output, inputs) must return a scalar tensor, got "
                              f"{type(loss).__name__}")
        if loss.numel() != 1:
            raise LossFnError(f"{self.path}: loss_fn(output, inputs) must return a scalar tensor (one element), got "
                              f"shape {tuple(loss.shape)}")
        return loss


def _is_trace_control_flow(error: BaseException) -> bool:
    """A size that depends on tensor values, met while tracing under fake tensors (the cost model then retries with
    the example's real values): not the user's error."""
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    except ImportError:  # pragma: no cover - other torch versions
        return False
    return isinstance(error, GuardOnDataDependentSymNode)


def _check_loss_signature(loss_fn: Callable, path: Path) -> None:
    """loss_fn must accept (output, inputs): a wrong signature is reported now, before minutes of work."""
    if not callable(loss_fn):
        raise LossFnError(f"{path}: loss_fn must be a function loss_fn(output, inputs), got {type(loss_fn).__name__}")
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some callables have no inspectable signature: checked at call
        return
    try:
        sig.bind(None, None)
    except TypeError as error:
        raise LossFnError(f"{path}: loss_fn{sig} cannot be called as loss_fn(output, inputs): {error}") from None


def _user_path_line(exc: BaseException, path: Path) -> str:
    """`path:line` of the innermost frame of the model file in the traceback, else `path`."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        try:
            if Path(frame.filename).resolve() == path.resolve():
                return f"{path}:{frame.lineno}"
        except OSError:
            continue
    return str(path)


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


def load_model_file(path: str | Path, *, on_meta: bool = False, **build_kwargs) -> ModelFile:
    """The model file at `path`, its model built (`on_meta`: on the meta device, no weights allocated; its example
    inputs are made as usual)."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir() or path.suffix != ".py":
        raise ModelFileError(f"{path}: expected a Python model file (.py) defining build_model() and example_inputs()")
    name = f"fxmem_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))
    try:
        call_user(path, "importing the model file", spec.loader.exec_module, mod)
    finally:
        try:
            sys.path.remove(str(path.resolve().parent))
        except ValueError:
            pass
    for required in ("build_model", "example_inputs"):
        if not callable(getattr(mod, required, None)):
            raise ModelFileError(f"{path}: the model file must define {required}() (see examples/ for the protocol)")
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = call_user(path, "build_model()", mod.build_model, **build_kwargs)
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{path}: build_model() must return a torch.nn.Module, got {type(model).__name__}")
    inputs = call_user(path, "example_inputs()", mod.example_inputs)
    args, kwargs = split_inputs(inputs, path)
    loss_fn = getattr(mod, "loss_fn", None)
    if loss_fn is not None:
        _check_loss_signature(loss_fn, path)
        loss_fn = UserLossFn(loss_fn, path)
    evaluate = getattr(mod, "evaluate", None)
    if evaluate is not None and not callable(evaluate):
        raise ModelFileError(f"{path}: evaluate must be a function evaluate(module) -> number, got "
                             f"{type(evaluate).__name__}")
    evaluate_mode = getattr(mod, "evaluate_mode", None)
    if evaluate_mode is not None and evaluate_mode not in ("max", "min"):
        raise ModelFileError(f"{path}: evaluate_mode must be 'max' (higher is better) or 'min' (lower is better), got "
                             f"{evaluate_mode!r}")
    return ModelFile(path, mod, model, args, kwargs, loss_fn, getattr(mod, "calibration_data", None), evaluate,
                     evaluate_mode)


def check_inputs(model_file: ModelFile, mode: str | None = None) -> None:
    """Run the model once on its example inputs (eval mode), so a rejection is reported as the user's error. With
    mode="train" the run has autograd on, and its loss must be one a training step can take back to the parameters
    (`step.require_trainable_loss`). Buffers, the RNG state and the mode are left as they were."""
    train = mode == "train"
    with model_state_kept(model_file.model), mode_set(model_file.model, False), torch.set_grad_enabled(train):
        try:
            out = model_file.model(*model_file.args, **model_file.kwargs)
        except Exception as error:  # noqa: BLE001
            raise ModelFileError(f"{model_file.path}: the model rejects example_inputs(): {type(error).__name__}: "
                                 f"{first_line(str(error))}") from error
        if train:
            require_trainable_loss(model_file.model, out, model_file.args, model_file.kwargs, model_file.loss_fn,
                                   str(model_file.path))
