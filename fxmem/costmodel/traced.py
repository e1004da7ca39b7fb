"""The traced estimate: the real training step (forward, loss, backward, optimizer) run on fake tensors under the
storage tracker `fxmem.measure` uses, an exact simulated timeline without real memory."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from ..fake import meta_as_device, meta_module_as_device, sizing_device
from ..kernel_layouts import CpuKernelLayouts
from ..measure import StorageTracker, backward_label, optimizer_state_tensors
from ..nn.recast import scope_for as recast_scope
from ..program import Program, deep_copy, module_path
from ..step import make_torch_optimizer, training_step
from .graph_run import CodegenInterpreter
from .memory import MemoryEstimate


class _LabellingInterpreter(CodegenInterpreter):
    """Runs the graph, remembering the node running (`current`) and naming it on the autograd nodes it makes."""

    def __init__(self, module):
        super().__init__(module)
        self.current = "<input>"

    def run_node(self, n):
        self.current = n.name
        out = super().run_node(n)
        tag_grad_fns(out, n.name)
        return out


def traced_estimate(program: Program, args, kwargs, mode: str, optimizer: str, loss_fn,
                    static_inputs: bool = False) -> MemoryEstimate:
    """The step of `program` at inputs (args, kwargs) in `mode`, run on fakes and tracked storage by storage
    (`static_inputs`: the inputs' sizes concrete, not symbolic)."""
    # (a real tensor the loss_fn reads, e.g. fixed targets, is a constant in the fake step, as in the static trace)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    device = sizing_device(flat)
    on_device = meta_as_device(fake_mode, flat, device)  # noqa: F841 - (the memo holds them weakly)
    with FakeCopyMode(fake_mode):
        fake_module = deep_copy(program.module)
    meta_module_as_device(fake_mode, fake_module, device)
    with fake_mode:
        fake_flat = [fake_mode.from_tensor(x, static_shapes=static_inputs) if isinstance(x, torch.Tensor) else x
                     for x in flat]
    fake_args, fake_kwargs = pytree.tree_unflatten(fake_flat, spec)
    fake_module.train(mode == "train")
    interpreter = _LabellingInterpreter(fake_module)

    def label(func):
        if tracker.phase == "backward":
            return backward_label(func) or str(func)
        if tracker.phase == "optimizer":
            return "optimizer.step"
        return interpreter.current

    tracker = StorageTracker(label)
    est = MemoryEstimate(mode=mode, optimizer=optimizer, method="traced")

    def run_model(*call_args, **call_kwargs):
        flat_in, _ = pytree.tree_flatten((tuple(call_args), dict(call_kwargs)))
        with recast_scope(program.module):  # what the module's forward hooks would enter (a fake copy runs)
            out = interpreter.run(*flat_in, enable_io_processing=False)
        return fake_module.graph.process_outputs(out)

    with fake_mode, CpuKernelLayouts():  # (below the tracker, which the step enters)
        params = list(fake_module.parameters())
        buffers = list(fake_module.buffers())
        est.params = tracker.bytes_of(params)
        est.buffers = tracker.bytes_of(buffers)
        est.inputs = tracker.bytes_of(fake_flat)
        inputs = (fake_args, fake_kwargs)
        if mode == "train":
            base, forward_end = _train_step(tracker, est, run_model, inputs, (params, buffers, fake_flat), loss_fn)
        else:
            base, forward_end = _forward(tracker, run_model, inputs, (params, buffers, fake_flat))
    tracker.record = False
    est.activations = max(0, (forward_end if forward_end is not None else base) - base)
    est.peak = tracker.peak
    est.peak_at, est.peak_phase = tracker.peak_label, tracker.peak_phase
    est.timeline = tracker.timeline
    nodes = {n.name: n for n in program.graph.nodes}
    if est.peak_at in nodes:
        est.peak_module = module_path(nodes[est.peak_at])
    tracker.close()
    return est


def _seed(tracker: StorageTracker, groups) -> int:
    """Track the storages that exist before the step (parameters, buffers, inputs, optimizer state); their
    bytes, the baseline."""
    for tensors in groups:
        tracker.seed(tensors)
    base = tracker.current
    tracker.reset_peak()
    tracker.record = True
    return base


def _train_step(tracker: StorageTracker, est: MemoryEstimate, run_model, inputs: tuple, state: tuple,
                loss_fn) -> tuple[int, int | None]:
    """Step 1 creates optimizer state (untracked); step 2, the steady state, is tracked. Returns (the baseline,
    the live bytes at the end of forward)."""
    params, _, _ = state
    fake_args, fake_kwargs = inputs
    optimizer = make_torch_optimizer(est.optimizer, params)
    marks = {}

    def mark(phase):
        if phase == "backward":
            marks["forward_end"] = tracker.current
        if phase == "optimizer":
            est.grads = sum(int(p.grad.untyped_storage().nbytes()) for p in params if p.grad is not None)
        tracker.phase = phase

    training_step(run_model, fake_args, fake_kwargs, optimizer, loss_fn)
    optimizer_state = optimizer_state_tensors(optimizer) if optimizer is not None else []
    est.optimizer_state = tracker.bytes_of(optimizer_state)
    base = _seed(tracker, state + (optimizer_state,))
    with tracker:
        training_step(run_model, fake_args, fake_kwargs, optimizer, loss_fn, mark)
    return base, marks.get("forward_end")


def _forward(tracker: StorageTracker, run_model, inputs: tuple, state: tuple) -> tuple[int, int]:
    """An inference forward, tracked. Returns (the baseline, the live bytes at its end)."""
    fake_args, fake_kwargs = inputs
    base = _seed(tracker, state)
    tracker.phase = "forward"
    with tracker, torch.no_grad():
        out = run_model(*fake_args, **fake_kwargs)
        forward_end = tracker.current
        del out
    return base, forward_end


def tag_grad_fns(out, label: str) -> None:
    """Name, in autograd's node metadata, the graph node that created each backward node (for timelines)."""
    todo = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        grad_fn = todo.pop()
        try:
            metadata = grad_fn.metadata
        except Exception:  # noqa: BLE001
            continue
        if "fxmem_label" in metadata:
            continue
        metadata["fxmem_label"] = label
        todo.extend(f for f, _ in grad_fn.next_functions if f is not None and type(f).__name__ != "AccumulateGrad")
