"""What an op the op table does not know (`fxmem.ops`) saves for its backward, measured instead of guessed: CPU's
LSTM layer (`aten.mkldnn_rnn_layer`) saves its workspace output, which the table's default (every tensor input)
misses, and the estimate came out at a fraction of the measured activations."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..kernel_layouts import CpuKernelLayouts
from .formula import FreshCall

_SLOTS: dict = {}


def measured_slots(call) -> list | None:
    """The slots (`fxmem.ops.Saved`: ("in", i), ("out", j), ("kw", name)) of what `call` (a
    `formula.call_signature`) saves for its backward. The op runs once on fresh fake tensors of the call's shapes,
    requires-grad flags as recorded, under saved-tensor hooks; each saved tensor is named by the argument or output
    whose storage it is. None where the op cannot run so, or saves a tensor that is neither (the table's default
    stands, and the op is listed as unknown). Cached per call signature."""
    if call is None:
        return None
    if call not in _SLOTS:
        try:
            _SLOTS[call] = _measure(*call)
        except Exception:  # noqa: BLE001 - not runnable on fresh fakes: the default, listed as unknown
            _SLOTS[call] = None
    return _SLOTS[call]


def _measure(func, args, kwargs) -> list | None:
    saved: list = []
    with FakeTensorMode(), CpuKernelLayouts(), torch.enable_grad():
        fresh = FreshCall(args, kwargs)
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda t: t):
            out = func(*fresh.args, **fresh.kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    named = _by_storage([("kw", key) for key in fresh.kwargs], list(fresh.kwargs.values()))
    named.update(_by_storage([("in", i) for i in range(len(fresh.args))], fresh.args))
    named.update(_by_storage([("out", j) for j in range(len(outs))], outs))
    slots: list = []
    for tensor in saved:
        slot = named.get(tensor.untyped_storage()._cdata)
        if slot is None:
            return None
        if slot not in slots:
            slots.append(slot)
    return slots


def _by_storage(slots: list, values) -> dict:
    """Storage -> slot, for the values that are tensors."""
    return {value.untyped_storage()._cdata: slot for slot, value in zip(slots, values)
            if isinstance(value, torch.Tensor)}
