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

from .errors import FxmemError, LossFnError, ModelFileError
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
        fn = self.evaluate
        return Evaluator(lambda module: call_user(self.path, "evaluate(module)", fn, module),
                         self.evaluate_mode or "max")

    @property
    def name(self) -> str:
        return self.path.stem

    def calibration(self, limit: int | None = None) -> list | None:
        if self.calibration_data is None:
            return None

        def take() -> list:
            out = []
            for i, item in enumerate(self.calibration_data()):
                if limit is not None and i >= limit:
                    break
                out.append(item)
            return out
        return call_user(self.path, "calibration_data()", take)


def call_user(path: Path, what: str, fn: Callable, *args, **kwargs) -> Any:
    """Run model-file code (`what`, e.g. "build_model()"): an exception it raises is the user's error, one line naming
    the file, its line and `what`. So is SystemExit (`sys.exit()`, `exit()`, `quit()`), which would otherwise end
    fxmem silently with the model's exit status. KeyboardInterrupt passes through (130/143 stay interruptions)."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        raise ModelFileError(f"{_user_path_line(e, path)}: {what} raised SystemExit({e.code!r}) (sys.exit(), exit() "
                             "or quit()), which would end fxmem's run; fxmem imports the model file and calls its "
                             "functions, so script code belongs under `if __name__ == \"__main__\":`") from None
    except FxmemError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code
        raise ModelFileError(f"{_user_path_line(e, path)}: {what} failed: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


class UserLossFn:
    """The model file's `loss_fn(output, inputs)`, called as the protocol says; a failure inside it, or a result that
    is not a scalar tensor, raises `LossFnError` naming the file, its line and `loss_fn`, with the original error
    (chained). Exceptions fxmem uses for control flow while tracing (a size that depends on tensor values) pass
    through unchanged, so the cost model can retry with real values."""

    def __init__(self, fn: Callable, path: Path):
        self.fn, self.path = fn, Path(path)
        self.__name__ = getattr(fn, "__name__", "loss_fn")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __call__(self, output, inputs):
        try:
            loss = self.fn(output, inputs)
        except SystemExit as e:
            raise LossFnError(f"{_user_path_line(e, self.path)}: loss_fn(output, inputs) raised "
                              f"SystemExit({e.code!r}) (sys.exit(), exit() or quit()), which would end fxmem's run"
                              ) from None
        except FxmemError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code
            if _is_trace_control_flow(e):
                raise
            raise LossFnError(f"{_user_path_line(e, self.path)}: loss_fn(output, inputs) failed: "
                              f"{type(e).__name__}: {_first_line(e)}") from e
        if not isinstance(loss, torch.Tensor):
            raise LossFnError(f"{self.path}: loss_fn(output, inputs) must return a scalar tensor, got "
                              f"{type(loss).__name__}")
        if loss.numel() != 1:
            raise LossFnError(f"{self.path}: loss_fn(output, inputs) must return a scalar tensor (one element), got "
                              f"shape {tuple(loss.shape)}")
        return loss


def _is_trace_control_flow(e: BaseException) -> bool:
    """A size that depends on tensor values, met while tracing under fake tensors (the cost model then retries with
    the example's real values): not the user's error."""
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    except ImportError:  # pragma: no cover - other torch versions
        return False
    return isinstance(e, GuardOnDataDependentSymNode)


def _check_loss_signature(fn: Callable, path: Path) -> None:
    """loss_fn must accept (output, inputs): a wrong signature is reported now, before minutes of work."""
    if not callable(fn):
        raise LossFnError(f"{path}: loss_fn must be a function loss_fn(output, inputs), got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some callables have no inspectable signature: checked at call
        return
    try:
        sig.bind(None, None)
    except TypeError as e:
        raise LossFnError(f"{path}: loss_fn{sig} cannot be called as loss_fn(output, inputs): {e}") from None


def _user_path_line(exc: BaseException, path: Path) -> str:
    """`path:line` of the innermost frame of the model file in the traceback, else `path`."""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        try:
            if Path(fr.filename).resolve() == path.resolve():
                return f"{path}:{fr.lineno}"
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
        call_user(p, "importing the model file", spec.loader.exec_module, mod)
    finally:
        try:
            sys.path.remove(str(p.resolve().parent))
        except ValueError:
            pass
    for fn in ("build_model", "example_inputs"):
        if not callable(getattr(mod, fn, None)):
            raise ModelFileError(f"{p}: the model file must define {fn}() (see examples/ for the protocol)")
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = call_user(p, "build_model()", mod.build_model, **build_kwargs)
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{p}: build_model() must return a torch.nn.Module, got {type(model).__name__}")
    inputs = call_user(p, "example_inputs()", mod.example_inputs)
    args, kwargs = split_inputs(inputs, p)
    loss_fn = getattr(mod, "loss_fn", None)
    if loss_fn is not None:
        _check_loss_signature(loss_fn, p)
        loss_fn = UserLossFn(loss_fn, p)
    evaluate = getattr(mod, "evaluate", None)
    if evaluate is not None and not callable(evaluate):
        raise ModelFileError(f"{p}: evaluate must be a function evaluate(module) -> number, got "
                             f"{type(evaluate).__name__}")
    evaluate_mode = getattr(mod, "evaluate_mode", None)
    if evaluate_mode is not None and evaluate_mode not in ("max", "min"):
        raise ModelFileError(f"{p}: evaluate_mode must be 'max' (higher is better) or 'min' (lower is better), got "
                             f"{evaluate_mode!r}")
    return ModelFile(p, mod, model, args, kwargs, loss_fn, getattr(mod, "calibration_data", None), evaluate,
                     evaluate_mode)


def check_inputs(mf: ModelFile, mode: str | None = None) -> None:
    """Run the model once on its example inputs (eval mode), so a rejection is reported as the user's error. With
    mode="train" the run has autograd on, and its loss must be one a training step can take back to the parameters
    (`step.require_trainable_loss`). Buffers, the RNG state and the mode are left as they were."""
    train = mode == "train"
    with model_state_kept(mf.model), mode_set(mf.model, False), torch.set_grad_enabled(train):
        try:
            out = mf.model(*mf.args, **mf.kwargs)
        except Exception as e:  # noqa: BLE001
            raise ModelFileError(f"{mf.path}: the model rejects example_inputs(): {type(e).__name__}: "
                                 f"{_first_line(e)}") from e
        if train:
            require_trainable_loss(mf.model, out, mf.args, mf.kwargs, mf.loss_fn, str(mf.path))
