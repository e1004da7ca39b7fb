"""What an op's backward formula holds above the gradients it makes, measured by running the formula on fakes."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint as _example_size
except ImportError:  # torch 2.11-2.12 name it size_hint (earlier ones hint_int, deprecated by 2.11)
    try:
        from torch.fx.experimental.symbolic_shapes import size_hint as _example_size
    except ImportError:
        from torch.fx.experimental.symbolic_shapes import hint_int as _example_size

from ..kernel_layouts import CpuKernelLayouts
from ..measure import StorageTracker

_FORMULA_TEMPS: dict = {}
FORMULA_UNMEASURED: set = set()  # calls whose formula did not run on fake tensors


@dataclass(frozen=True)
class TensorMeta:
    """A tensor argument of a recorded call, by what its backward formula depends on."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: str
    requires_grad: bool


def call_signature(func, args, kwargs):
    """An op call as a hashable value, its tensors as `TensorMeta` (None: not reproducible on fresh tensors: a view
    or an in-place op, symbolic sizes, an argument of another kind)."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable or any(ret.alias_info is not None for ret in schema.returns):
        return None
    try:
        return func, _freeze(tuple(args)), tuple(sorted((key, _freeze(value)) for key, value in kwargs.items()))
    except TypeError:
        return None


def _freeze(arg):
    """An argument as a hashable value; TypeError when it has none."""
    if isinstance(arg, torch.Tensor):
        return TensorMeta(tuple(map(_freeze, arg.shape)), tuple(map(_freeze, arg.stride())), arg.dtype,
                          str(arg.device), bool(arg.requires_grad))
    if isinstance(arg, (list, tuple)):
        return tuple(_freeze(item) for item in arg)
    if isinstance(arg, torch.SymInt):  # (a dynamic batch size: its example value, without a guard)
        try:
            return _example_size(arg)
        except Exception as e:  # noqa: BLE001 - no example value (a data-dependent size)
            raise TypeError from e
    if isinstance(arg, (torch.SymFloat, torch.SymBool)):
        raise TypeError
    if arg is None or isinstance(arg, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
        return arg
    raise TypeError


def formula_temps(call, grad_mask: tuple) -> int:
    """Bytes an op's backward formula holds above the input gradients it makes, at its highest: `pow(x, c)` holds
    `x.pow(c - 1)` and `c * x.pow(c - 1)` while it makes `grad * (...)`; `a / b` holds `a / b` and `(a / b) / b`
    for b's gradient; `x * w` with a broadcast `w` makes w's gradient at x's size before it sums it down.

    Measured, not tabled: the op runs once more on fresh fake tensors with the recorded shapes, strides, dtypes and
    requires-grad flags, and its backward (the real formula) runs under the storage tracker, with gradients for the
    outputs in `grad_mask` (those with one in the step). Cached per call signature."""
    if call is None or not any(grad_mask):
        return 0
    key = (call, grad_mask)
    try:
        return _FORMULA_TEMPS[key]
    except KeyError:
        pass
    try:
        held = _measure_formula(*call, grad_mask)
    except Exception:  # noqa: BLE001 - an op whose backward cannot run on fresh fake tensors: none counted, and
        held = 0  # the estimate lists the op among its unknown ops
        FORMULA_UNMEASURED.add(call)
    if len(_FORMULA_TEMPS) > 65536:
        _FORMULA_TEMPS.clear()
    _FORMULA_TEMPS[key] = held
    return held


def formula_unmeasured(call) -> bool:
    """Whether `call`'s backward formula could not be run on fake tensors (its temporaries are not counted)."""
    return call is not None and call in FORMULA_UNMEASURED


def _measure_formula(func, args, kwargs, grad_mask: tuple) -> int:
    tracker = StorageTracker()
    try:
        with FakeTensorMode(), CpuKernelLayouts(), torch.enable_grad(), tracker:  # (forward storages tracked: views of them are not new)
            leaves: list = []

            def make(arg):
                if isinstance(arg, TensorMeta):
                    tensor = torch.empty_strided(arg.shape, arg.stride, dtype=arg.dtype, device=arg.device)
                    if arg.requires_grad:
                        tensor.requires_grad_(True)
                        leaves.append(tensor)
                    return tensor
                if isinstance(arg, tuple):
                    return [make(item) for item in arg]
                return arg
            out = func(*[make(arg) for arg in args], **{key: make(value) for key, value in kwargs})
            outs = out if isinstance(out, (tuple, list)) else (out,)
            outs = [o for o, wanted in zip(outs, grad_mask)
                    if wanted and isinstance(o, torch.Tensor) and o.requires_grad]
            if not outs or not leaves:
                return 0
            grads = [torch.empty_like(o) for o in outs]
            tracker.reset_peak()
            # (retain_graph: the saved tensors stay, as they do until the op's backward has run)
            made = torch.autograd.grad(outs, leaves, grads, allow_unused=True, retain_graph=True)
            held = tracker.peak - tracker.current  # (`made` still holds the gradients: what stays)
            del made
            return max(0, held)
    finally:
        tracker.close()


def covers_storage(meta, nbytes: int) -> bool:
    """Whether a tensor (`TensorMeta`) is the whole of a storage of `nbytes`: dense, no element twice, no gap."""
    if not isinstance(meta, TensorMeta) or math.prod(meta.shape) * meta.dtype.itemsize != nbytes:
        return False
    step = 1
    for stride, size in sorted((st, dim) for dim, st in zip(meta.shape, meta.stride) if dim != 1):
        if stride != step:
            return False
        step *= size
    return True
