"""Ground truth: run real steps and record live tensor-storage bytes with a dispatch mode.

`StorageTracker` sees every storage an aten op creates, and learns of its release through `weakref.finalize` on
the storage object, so it knows exactly how many bytes are live after every op. It is seeded with the storages
that exist before the step (parameters, buffers, optimizer state, inputs). The same tracker runs under
FakeTensorMode for the cost model's traced estimate, where no real memory is allocated.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .nn.recast import observing
from .program import Program
from .step import make_torch_optimizer, training_step
from .step_memory import COMMON_KEYS, StepMemory
from .units import format_bytes
from .userstate import keeps_model_state, mode_set


@dataclass
class TimelinePoint:
    phase: str  # forward | backward | optimizer
    label: str  # fx node name, module path or aten op
    live: int  # bytes live after the op
    peak: int  # highest live bytes while the op ran (its outputs plus everything live before)

    def to_dict(self):
        return {"phase": self.phase, "label": self.label, "live": self.live, "peak": self.peak}


class StorageTracker(TorchDispatchMode):
    """Counts live storage bytes; `label_fn()` names the current position for the timeline. `device`: count only
    storages on it (a CUDA step's pinned host buffers, the offload pass's "cpu" tier, are not device memory);
    None counts every storage."""

    def __init__(self, label_fn: Callable[[Any], str] | None = None, device: torch.device | None = None):
        super().__init__()
        self.device = device
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_label = ""
        self.peak_phase = ""
        self.phase = "setup"
        self.timeline: list[TimelinePoint] = []
        self.label_fn = label_fn
        self.record = False
        self._finalizers: list[weakref.finalize] = []

    # ------------------------------------------------------------------------------------------- storages
    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple[int, int] | None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return storage

    def add(self, tensor: torch.Tensor) -> bool:
        storage = self._key(tensor)
        if storage is None or (self.device is not None and storage.device != self.device):
            return False
        key = storage._cdata
        if key in self.live:
            return False
        nbytes = int(storage.nbytes())
        self.live[key] = nbytes
        self.current += nbytes
        self._finalizers.append(weakref.finalize(storage, self._release, key))
        return True

    def _release(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        self.current -= nbytes

    def seed(self, tree) -> None:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self.add(leaf)

    def bytes_of(self, tree) -> int:
        seen, total = set(), 0
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                storage = self._key(leaf)
                if storage is not None and storage._cdata not in seen:
                    seen.add(storage._cdata)
                    total += int(storage.nbytes())
        return total

    def reset_peak(self) -> None:
        self.peak = self.current
        self.peak_label = "start"
        self.peak_phase = self.phase

    def close(self) -> None:
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    # ------------------------------------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.add(leaf)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_label = self._label(func)
            self.peak_phase = self.phase
        if self.record:
            label = self._label(func)
            timeline = self.timeline
            if timeline and timeline[-1].label == label and timeline[-1].phase == self.phase:
                timeline[-1].live = self.current
                timeline[-1].peak = max(timeline[-1].peak, self.current)
            else:
                timeline.append(TimelinePoint(self.phase, label, self.current, self.current))
        return out

    def _label(self, func) -> str:
        if self.label_fn is not None:
            label = self.label_fn(func)
            if label:
                return label
        return str(getattr(func, "__name__", func))


def backward_label(func) -> str | None:
    """In backward: the forward node (tagged in grad_fn metadata) whose gradient is being computed."""
    try:
        node = torch._C._current_autograd_node()
    except Exception:  # noqa: BLE001
        node = None
    if node is None:
        return None
    try:
        metadata = node.metadata
        if "fxmem_label" in metadata:
            return metadata["fxmem_label"]
    except Exception:  # noqa: BLE001
        pass
    return node.name()


# ----------------------------------------------------------------------------------------------- profile
@dataclass
class MemoryProfile(StepMemory):
    """Measured memory of one steady-state step: the fields of `MemoryEstimate` it shares (`StepMemory`)."""
    method: str = "measured"
    cuda_max_allocated: int | None = None
    allocator: dict | None = None  # CUDA: the caching allocator on the same step (`allocator_counters`)

    def to_dict(self) -> dict:
        data = self.plain(COMMON_KEYS + ("world_size", "zero_stage", "timeline", "unknown_ops"))
        if self.cuda_max_allocated is not None:
            data["cuda_max_allocated"] = self.cuda_max_allocated
        if self.allocator is not None:
            data["allocator"] = dict(self.allocator)
        return data

    def allocator_line(self) -> str | None:
        """The CUDA allocator's peak beside this count's, both above the step's start (None off CUDA)."""
        counters = self.allocator
        if not counters:
            return None
        return (f"CUDA allocator on the same step: peak allocated {format_bytes(counters['allocated_peak'])} "
                f"({format_bytes(counters['allocated_peak'] - counters['allocated_start'])} above the step's start; "
                f"requested {format_bytes(counters['requested_peak'] - counters['requested_start'])}, reserved peak "
                f"{format_bytes(counters['reserved_peak'])}) against live tensors {format_bytes(self.peak)} "
                f"({format_bytes(self.peak - counters['tracked_start'])} above the step's start): the allocator adds "
                "rounding, cached blocks and kernel workspaces")


ALLOCATOR_STATS = {"allocated": "allocated_bytes.all", "requested": "requested_bytes.all",
                   "reserved": "reserved_bytes.all"}


def allocator_counters(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's byte counters on `device` (`torch.cuda.memory_stats`): current and peak bytes
    allocated (rounded blocks), requested (what the tensors asked for) and reserved (segments held from CUDA)."""
    stats = torch.cuda.memory_stats(device)
    out = {}
    for name, key in ALLOCATOR_STATS.items():
        out[f"{name}_current"] = int(stats.get(f"{key}.current", 0))
        out[f"{name}_peak"] = int(stats.get(f"{key}.peak", 0))
    return out


def allocator_step(start: dict[str, int], end: dict[str, int], tracked_start: int) -> dict[str, int]:
    """One step's allocator record: the counters at its start and their peaks over it (peaks reset at the start),
    with the live bytes fxmem's tracker counted at the start (`tracked_start`) to compare from."""
    return {"allocated_start": start["allocated_current"], "allocated_peak": end["allocated_peak"],
            "requested_start": start["requested_current"], "requested_peak": end["requested_peak"],
            "reserved_peak": end["reserved_peak"], "tracked_start": int(tracked_start)}


def _as_call(args, kwargs):
    if not isinstance(args, tuple):
        args = (args,) if not isinstance(args, list) else tuple(args)
    return args, dict(kwargs or {})


class _ForwardLabels:
    """Labels forward ops by the innermost module running (hooks) and tags grad_fns with it for backward."""

    def __init__(self, model: nn.Module):
        self.stack: list[str] = []
        self.handles = []
        if isinstance(model, torch.fx.GraphModule):
            return  # GraphModules are labelled per node by the interpreter in the cost model
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._pre(name or model.__class__.__name__)))
            self.handles.append(mod.register_forward_hook(self._post, always_call=True))

    def _pre(self, name):
        def hook(mod, inp):
            self.stack.append(name)
        return hook

    def _post(self, mod, inp, out):
        if self.stack:
            self.stack.pop()
        label = self.stack[-1] if self.stack else None
        del label

    def current(self):
        return self.stack[-1] if self.stack else None

    def close(self):
        for handle in self.handles:
            handle.remove()


# (nine parameters: the measuring entry's keyword options, called by fxmem.measure and the benchmarks)
def run_profiled_step(model, args, kwargs, *, mode: str, optimizer_name: str, loss_fn=None,
                      steps: int = 2, label_fn=None, optimizer=None) -> MemoryProfile:
    """Run `steps` steps; profile the last one (the steady state: optimizer state exists)."""
    params = [p for p in model.parameters()] if isinstance(model, nn.Module) else []
    buffers = [b for b in model.buffers()] if isinstance(model, nn.Module) else []
    if mode == "train" and optimizer is None:
        optimizer = make_torch_optimizer(optimizer_name, params)
    labels = _ForwardLabels(model) if label_fn is None else None

    def label_of(func):
        if tracker.phase == "backward":
            return backward_label(func) or str(func)
        if label_fn is not None:
            return label_fn(func)
        return labels.current() or str(getattr(func, "__name__", func))

    device = next((p.device for p in params), torch.device("cpu"))
    tracker = StorageTracker(label_of, device=device if device.type == "cuda" else None)
    prof = MemoryProfile(mode=mode, optimizer=optimizer_name if mode == "train" else "none")
    prof.device = str(device)
    marks = {}

    def mark(phase):
        if phase == "backward":
            marks["fwd_end"] = tracker.current
        tracker.phase = phase if phase != "end" else "end"

    try:
        for step in range(steps):
            last = step == steps - 1
            if last:
                base, counters_at_start = _start_recording(tracker, prof, (params, buffers), (args, kwargs),
                                                           optimizer, device)
            ctx = tracker if last else _nullcontext()
            with ctx:
                if mode == "train":
                    _train_step_with_grad_capture(model, args, kwargs, optimizer, loss_fn, mark if last else None,
                                                  prof if last else None, params)
                else:
                    if last:
                        mark("forward")
                    with torch.no_grad():
                        out = model(*args, **kwargs)
                    if last:
                        marks["fwd_end"] = tracker.current
                    del out
            if last:
                tracker.record = False
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    prof.cuda_max_allocated = int(torch.cuda.max_memory_allocated(device))
                    prof.allocator = allocator_step(counters_at_start, allocator_counters(device), base)
        prof.activations = max(0, marks.get("fwd_end", base) - base)
        prof.peak = tracker.peak
        prof.peak_at = tracker.peak_label
        prof.peak_phase = tracker.peak_phase
        prof.timeline = tracker.timeline
        return prof
    finally:
        tracker.close()
        if labels is not None:
            labels.close()


def _start_recording(tracker, prof, model_state, inputs, optimizer, device):
    """Before the profiled step: seed the tracker with what exists (parameters, buffers, inputs, optimizer state),
    count it into `prof` and start recording; the live bytes at the start and the CUDA allocator's counters (None
    off CUDA)."""
    params, buffers = model_state
    gc.collect()
    with torch.no_grad():
        pass
    tracker.seed(params)
    tracker.seed(buffers)
    tracker.seed(inputs)
    if optimizer is not None:
        tracker.seed(optimizer_state_tensors(optimizer))
    prof.params = tracker.bytes_of(params)
    prof.buffers = tracker.bytes_of(buffers)
    prof.inputs = tracker.bytes_of(inputs)
    prof.optimizer_state = tracker.bytes_of(optimizer_state_tensors(optimizer)) if optimizer else 0
    base = tracker.current
    tracker.reset_peak()
    tracker.record = True
    counters_at_start = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        counters_at_start = allocator_counters(device)
    return base, counters_at_start


def _train_step_with_grad_capture(model, args, kwargs, optimizer, loss_fn, mark, prof, params):
    def on_phase(phase):
        if mark is not None:
            if phase == "optimizer" and prof is not None:
                prof.grads = sum(int(p.grad.untyped_storage().nbytes()) for p in params if p.grad is not None)
            mark(phase)
    training_step(model, args, kwargs, optimizer, loss_fn, on_phase)


def optimizer_state_tensors(optimizer) -> list:
    """The tensors of an optimizer's state (bitsandbytes keeps some inside state objects)."""
    out = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif hasattr(value, "__dict__"):
                out.extend(t for t in vars(value).values() if isinstance(t, torch.Tensor))
    return out


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


@keeps_model_state(parameter_values=True)
def measure(model, args=(), kwargs=None, *, mode: str = "train", optimizer: str = "adamw", loss_fn=None,
            steps: int = 2) -> MemoryProfile:
    """Measure one steady-state step of `model` on its device (the last of `steps`).

    Runs real steps (optimizer steps included); the model comes back as it was given (parameter values, `.grad`,
    buffers, modes, RNG state: `fxmem.userstate`), so measuring needs no copy of it; its trainable parameters are
    copied aside while it runs (outside the measured bytes). A Program or a GraphModule from fxmem is measured the
    same way as the user's module.
    """
    if isinstance(model, Program):
        model = model.module
    args, kwargs = _as_call(args, kwargs)
    with mode_set(model, mode == "train"):
        return run_profiled_step(model, args, kwargs, mode=mode, optimizer_name=optimizer, loss_fn=loss_fn,
                                 steps=steps)


def saved_bytes(model, args=(), kwargs=None) -> int:
    """Bytes of the distinct storages autograd saves for backward in one training forward of `model`, parameters
    and buffers left out (they live anyway; `measure`'s activation bytes do not count them either). Unlike
    `measure`, this works on compiled modules (torch.compile), whose insides a dispatch mode cannot see: it counts
    what the compiled graph hands autograd."""
    return sum(t.untyped_storage().nbytes() for t in saved_tensors(model, args, kwargs))


@keeps_model_state
def saved_tensors(model, args=(), kwargs=None) -> list:
    """One saved tensor per storage `saved_bytes` counts (the first saved view of it), for callers that tell them
    apart (benchmarks/compile_saved_breakdown.py: inductor's weight-layout copies).

    A module fxmem rewrote with recipes (`fxmem.nn.recast`: remat, parameter casts) packs its saves in its own
    hooks, innermost; what those keep (the tensor, or a recipe's arguments instead of its output) is counted
    through `recast.observing`, and so is what a checkpoint region keeps outside any saved-tensor hook (the
    outputs a selective policy caches, the dropout masks its draw tape holds)."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, torch.Tensor] = {}

    def pack(tensor):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, wrapper subclasses)
            return tensor
        if storage.data_ptr() not in own:
            seen.setdefault(storage.data_ptr(), tensor.detach())
        return tensor

    with mode_set(model, True), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            observing(lambda ts: [pack(t) for t in ts]):
        out = model(*args, **(kwargs or {}))
    del out
    return list(seen.values())
