"""fxmem: a model-surgery compiler that makes PyTorch models fit in memory.

    import fxmem
    result = fxmem.transform(model, (x,), policy="low", budget="50%")
    result.module          # a trainable torch.fx.GraphModule, called like the model
    result.report          # what changed, where, why, and memory before/after
    fxmem.estimate(model, (x,), optimizer="adamw")   # static memory estimate, no real tensors
    fxmem.measure(model, (x,), optimizer="adamw")    # ground truth from a real step
"""
import importlib as _importlib

from .errors import (BudgetError, CaptureError, FxmemError, InputShapeError, ModelFileError, PassError,
                     PolicyError, StrictError)
from .program import Program
from .capture import capture
from .measure import MemoryProfile, measure  # noqa: E402  (rebinds fxmem.measure to the function)

__version__ = "0.1.0"

# name -> (module, attribute), loaded on first use so `import fxmem` stays light
_LAZY = {
    "estimate": ("sizing", "estimate"),
    "MemoryEstimate": ("costmodel", "MemoryEstimate"),
    "plan_batch": ("sizing", "plan_batch"),
    "fit_batch": ("fit", "fit_batch"),
    "fit_length": ("fit", "fit_length"),
    "FitResult": ("fit", "FitResult"),
    "transform": ("api", "transform"),
    "TransformResult": ("api", "TransformResult"),
    "load": ("api", "load"),
    "load_policy": ("policy_loader", "load_policy"),
    "Policy": ("policy", "Policy"),
    "Report": ("report", "Report"),
    "calibrate": ("calibrate", "calibrate"),
    "gating_loss": ("nn.gating", "gating_loss"),
    "make_optimizer": ("optim", "make_optimizer"),
    "ShortfallError": ("intent", "ShortfallError"),
    "distribute": ("distributed", "distribute"),
    "compile": ("compiled_budget", "compile"),
    "compile_options": ("compiled_budget", "compile_options"),
}

__all__ = ["BudgetError", "CaptureError", "FxmemError", "InputShapeError", "ModelFileError", "PassError",
           "PolicyError", "StrictError", "Program", "capture", "MemoryProfile", "measure", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(_importlib.import_module(f".{mod}", __name__), attr)
    raise AttributeError(f"module 'fxmem' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
