"""What an op's backward formula does, measured by running it on fakes: what it holds above the gradients it
makes, and how it lays them out (a view of an output's gradient, or a new storage, with their strides)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ..fake import first_sized_device
from ..kernel_layouts import CpuKernelLayouts
from ..measure import StorageTracker
from ..ops import returns_alias
from .example_size import example_size as _example_size

_FORMULA_RUNS: dict = {}
FORMULA_UNMEASURED: set = set()  # calls whose formula did not run on fake tensors
# how an estimate's unknown ops name one whose saves are known but whose backward formula did not run on fakes
UNMEASURED_FORMULA = " (backward temporaries not measured)"


@dataclass(frozen=True)
class TensorMeta:
    """A tensor argument of a recorded call, by what its backward formula depends on."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: str
    requires_grad: bool


def call_signature(func, args, kwargs):
    """An op call as a hashable value, its tensors as `TensorMeta` (None: not reproducible on fresh tensors: an
    in-place op, symbolic sizes, an argument of another kind). A view is reproduced on a fresh input of its
    input's shape and strides."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable:
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


@dataclass(frozen=True)
class InputGrad:
    """The gradient a backward formula makes for one input: its strides, and whether it is a new storage (`fresh`)
    or a view of an output's gradient (a transpose's, add's)."""
    strides: tuple
    fresh: bool


@dataclass(frozen=True)
class FormulaRun:
    """What an op's backward formula does: the bytes it holds above the gradients it makes, at their highest
    (`temps`), per positional argument the `InputGrad` it makes (None: not a tensor needing one), and the same per
    tensor inside a positional list argument, in order (`members`: cat's and stack's slices of their gradient)."""
    temps: int = 0
    grads: tuple = ()
    members: tuple = ()


def formula_temps(call, grad_mask: tuple) -> int:
    """Bytes an op's backward formula holds above the input gradients it makes, at their highest: `pow(x, c)` holds
    `x.pow(c - 1)` and `c * x.pow(c - 1)` while it makes `grad * (...)`; `a / b` holds `a / b` and `(a / b) / b`
    for b's gradient; `x * w` with a broadcast `w` makes w's gradient at x's size before it sums it down."""
    return formula_run(call, grad_mask).temps


def formula_run(call, grad_mask: tuple, grad_strides: tuple | None = None) -> FormulaRun:
    """What the backward formula of `call` (`call_signature`) does with gradients for the outputs in `grad_mask`
    (those with one in the step), laid out with `grad_strides` (per output; None: as the output).

    Measured, not tabled: the op runs once more on fresh fake tensors with the recorded shapes, strides, dtypes and
    requires-grad flags, and its backward (the real formula) runs under the storage tracker. Cached per call
    signature and gradient strides. A view's formula that cannot run is one without temporaries (a view hands its
    gradient on); any other op's is listed (`formula_unmeasured`)."""
    if call is None or not any(grad_mask):
        return FormulaRun()
    key = (call, grad_mask, grad_strides)
    try:
        return _FORMULA_RUNS[key]
    except KeyError:
        pass
    try:
        run = _measure_formula(*call, grad_mask, grad_strides)
    except Exception:  # noqa: BLE001 - an op whose backward cannot run on fresh fake tensors: none counted, and
        run = FormulaRun()  # the estimate lists the op among its unknown ops
        if not returns_alias(call[0]):
            FORMULA_UNMEASURED.add(call)
    if len(_FORMULA_RUNS) > 65536:
        _FORMULA_RUNS.clear()
    _FORMULA_RUNS[key] = run
    return run


def formula_unmeasured(call) -> bool:
    """Whether `call`'s backward formula could not be run on fake tensors (its temporaries are not counted)."""
    return call is not None and call in FORMULA_UNMEASURED


class FreshCall:
    """A recorded call made again on fresh fake tensors: its arguments, and the leaves needing grad with the
    position of the argument each one is (None: inside a list, or by keyword)."""

    def __init__(self, args, kwargs):
        self.leaves: list = []
        self.positions: list = []
        self.members: list = []  # every tensor inside a positional list argument, in order
        # a model built on the meta device shows its parameters as meta tensors beside inputs on the sized device
        leaves = pytree.tree_leaves((args, [value for _, value in kwargs]))
        self.device = first_sized_device(leaf.device for leaf in leaves if isinstance(leaf, TensorMeta))
        self.args = [self.make(arg, position) for position, arg in enumerate(args)]
        self.kwargs = {key: self.make(value, None) for key, value in kwargs}

    def make(self, arg, position):
        if isinstance(arg, TensorMeta):
            device = self.device if arg.device == "meta" else arg.device
            tensor = torch.empty_strided(arg.shape, arg.stride, dtype=arg.dtype, device=device)
            if arg.requires_grad:
                tensor.requires_grad_(True)
                self.leaves.append(tensor)
                self.positions.append(position)
            return tensor
        if isinstance(arg, tuple):
            items = [self.make(item, None) for item in arg]
            if position is not None:
                self.members.extend(item for item in items if isinstance(item, torch.Tensor))
            return items
        return arg


def _measure_formula(func, args, kwargs, grad_mask: tuple, grad_strides: tuple | None) -> FormulaRun:
    tracker = StorageTracker()
    try:
        with FakeTensorMode(), CpuKernelLayouts(), torch.enable_grad(), tracker:  # (forward storages tracked: views
            # of them are not new)
            fresh_call = FreshCall(args, kwargs)
            out = func(*fresh_call.args, **fresh_call.kwargs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            strides = grad_strides or (None,) * len(outs)
            wanted = [(o, stride) for o, stride, want in zip(outs, strides, grad_mask)
                      if want and isinstance(o, torch.Tensor) and o.requires_grad]
            if not wanted or not fresh_call.leaves:
                return FormulaRun()
            grads = [torch.empty_like(o) if stride is None
                     else torch.empty_strided(o.shape, stride, dtype=o.dtype, device=o.device)
                     for o, stride in wanted]
            tracker.reset_peak()
            # (retain_graph: the saved tensors stay, as they do until the op's backward has run)
            made = torch.autograd.grad([o for o, _ in wanted], fresh_call.leaves, grads, allow_unused=True,
                                       retain_graph=True)
            held = tracker.peak - tracker.current  # (`made` still holds the gradients: what stays)
            return FormulaRun(max(0, held), _input_grads(fresh_call.positions, made, grads, len(args)),
                              _member_grads(fresh_call, made, grads))
    finally:
        tracker.close()


def _input_grads(positions: list, made, grads: list, count: int) -> tuple:
    """Per positional argument (`count`), the `InputGrad` made for it (`made`, the leaves' at `positions`)."""
    given = {_storage_id(grad) for grad in grads}
    out: list = [None] * count
    for position, grad in zip(positions, made):
        if position is not None:
            out[position] = _input_grad(grad, given)
    return tuple(out)


def _member_grads(fresh_call: FreshCall, made, grads: list) -> tuple:
    """Per tensor of the call's list arguments (`FreshCall.members`), the `InputGrad` made for it, or None."""
    given = {_storage_id(grad) for grad in grads}
    by_leaf = {id(leaf): grad for leaf, grad in zip(fresh_call.leaves, made)}
    return tuple(_input_grad(by_leaf.get(id(member)), given) for member in fresh_call.members)


def _input_grad(grad, given: set) -> InputGrad | None:
    """The gradient's strides and whether it is a new storage (not one of the output gradients `given`); None for
    no gradient, or one without strides or storage (a sparse one)."""
    storage = _storage_id(grad) if grad is not None else None
    return None if storage is None else InputGrad(tuple(grad.stride()), storage not in given)


def _storage_id(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata if tensor.layout == torch.strided else None
    except (RuntimeError, NotImplementedError):
        return None


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
