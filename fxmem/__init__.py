"""fxmem: a model-surgery compiler that makes PyTorch models fit in memory.

    import fxmem
    program = fxmem.capture(model, (x,))
    est = fxmem.estimate(model, (x,), optimizer="adamw")
    prof = fxmem.measure(model, (x,), optimizer="adamw")
"""
from .errors import (BudgetError, CaptureError, FxmemError, InputShapeError, ModelFileError, PassError,
                     PolicyError)
from .program import Program
from .capture import capture
from .measure import MemoryProfile, measure  # noqa: E402  (rebinds fxmem.measure to the function)

__version__ = "0.1.0"


def __getattr__(name):
    # the cost model loads on first use
    if name in ("estimate", "MemoryEstimate", "plan_batch"):
        import importlib
        return getattr(importlib.import_module(".costmodel", __name__), name)
    raise AttributeError(f"module 'fxmem' has no attribute {name!r}")
