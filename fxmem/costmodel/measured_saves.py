"""What an op the op table does not know (`fxmem.ops`) saves for its backward, measured instead of guessed: CPU's
LSTM layer (`aten.mkldnn_rnn_layer`) saves its workspace output, which the table's default (every tensor input)
misses, and the estimate came out at a fraction of the measured activations. A custom op's autograd may also keep
an input on its context object, outside saved-tensor hooks (transformers' grouped matmul fallback keeps its
offsets so): an input the graph keeps alive once the call's own references are gone is held (`measured_held`),
and unlike a saved tensor, which backward releases, it lives as long as the graph's nodes do."""
from __future__ import annotations

import weakref

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
    return _measured(call)[0]


def measured_held(call) -> list:
    """The slots of inputs `call`'s autograd keeps alive outside saved-tensor hooks (on its context object): kept
    until the graph is dropped, past the op's backward. Empty where `measured_slots` is None."""
    return _measured(call)[1]


def _measured(call) -> tuple:
    """(saved slots or None, held slots) of `call`, cached per call signature."""
    if call is None:
        return None, []
    if call not in _SLOTS:
        try:
            _SLOTS[call] = _measure(*call)
        except Exception:  # noqa: BLE001 - not runnable on fresh fakes: the default, listed as unknown
            _SLOTS[call] = None, []
    return _SLOTS[call]


def _measure(func, args, kwargs) -> tuple:
    saved: list = []
    with FakeTensorMode(), CpuKernelLayouts(), torch.enable_grad():
        fresh = FreshCall(args, kwargs)
        # (made by an op, as an activation is: a leaf needing grad is kept alive by its gradient accumulator, which
        # `held` would mistake for the op keeping it)
        call_args = [_made(arg) for arg in fresh.args]
        call_kwargs = {key: _made(value) for key, value in fresh.kwargs.items()}
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda t: t):
            out = func(*call_args, **call_kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    inputs = [(("kw", key), value) for key, value in call_kwargs.items()] + \
        [(("in", i), value) for i, value in enumerate(call_args)]
    named = _by_storage([slot for slot, _ in inputs], [value for _, value in inputs])
    named.update(_by_storage([("out", j) for j in range(len(outs))], outs))
    slots = _slots_of(saved, named)
    if slots is None:
        return None, []
    watched = [(slot, weakref.ref(value)) for slot, value in inputs
               if isinstance(value, torch.Tensor) and slot not in slots]
    # (the call's own references: what stays alive is the graph's, `out` holds it)
    del fresh, call_args, call_kwargs, inputs, named, saved
    return slots, [slot for slot, alive in watched if alive() is not None]


def _made(arg):
    """`arg` (a fresh argument, or a list of them) with each leaf needing grad replaced by a view of it: the same
    storage, made by an op."""
    if isinstance(arg, list):
        return [_made(item) for item in arg]
    if isinstance(arg, torch.Tensor) and arg.requires_grad and arg.is_leaf:
        return arg.view_as(arg)
    return arg


def _slots_of(saved: list, named: dict) -> list | None:
    """The slot of each saved tensor's storage, in order, once each; None if one is not an argument or output."""
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
