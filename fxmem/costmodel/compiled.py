"""What a torch.compile'd training step saves for backward, known before it runs.

The static estimate prices eager execution: what autograd saves op by op. Under torch.compile (inductor) the
partitioner decides instead: it honours recompute tags (fxmem's checkpoint regions and remat sites), recomputes
cheap pointwise ops by its own min-cut, and at an `activation_memory_budget` below 1 recomputes more. `compiled_saves`
asks the compiler itself: dynamo captures the module (fullgraph), AOT autograd traces the joint graph on fake tensors
with inductor's decompositions and joint-graph passes, and inductor's own partitioner splits it; the saved values
are read off the backward graph's inputs and the compile stops there, before code generation (no kernel is built,
nothing runs, no real memory). Inductor's one later change to what is saved is counted as the compiler decides it:
with its layout optimisation on (on CPU whenever a graph has a convolution and mkldnn is there), each convolution
weight saved for backward is saved as a channels-last copy (`layout_copies`), bytes like an activation's, held from
forward to backward. Equal to `fxmem.measure.saved_bytes` of the compiled module's real step in
tests/test_compiled_saves.py and on library models (benchmarks/compiled_saves_zoo.py, whose table also gives the
time of each against a real cold compile).
"""
from __future__ import annotations

import functools
import itertools
import types
from typing import NamedTuple

import torch
from torch import fx

from ..errors import CaptureError
from .example_size import known_size


class CompiledSaves(NamedTuple):
    """Bytes of the distinct storages a compiled training step saves for backward, parameters and buffers left
    out (as `fxmem.measure.saved_bytes` counts them): `activations`, what the partitioner saves, and
    `layout_copies`, inductor's channels-last copies of saved convolution weights."""
    activations: int
    layout_copies: int

    @property
    def total(self) -> int:
        return self.activations + self.layout_copies


class _Partitioned(Exception):
    """Raised by the recording partitioner once the partition is read: the compile goes no further."""


@functools.cache
def _recorder_class() -> type:
    """The recording partitioner's class, made on first use (inductor is imported only by callers that compile)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class _Recorder(CustomPartitionerFn):
        """Inductor's partitioner (`custom_partitioner_fn`: called after inductor's joint-graph passes, with the
        indices of the inputs that are parameters and buffers) that records what the backward graph takes from
        forward, then stops the compile."""

        def __init__(self):
            self.saves: CompiledSaves | None = None
            self.error: CaptureError | None = None  # what made the saves unknowable (raised once the compile stops)

        def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs):
            forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            try:
                self.saves = saved_by(forward, backward, set(kwargs.get("static_lifetime_input_indices") or ()))
            except CaptureError as error:
                self.error = error
            raise _Partitioned

        def uuid(self):
            return None  # (never cached)
    return _Recorder


def saved_by(forward: fx.GraphModule, backward: fx.GraphModule, static: set) -> CompiledSaves:
    """What a partition saves: the backward graph's inputs that are not tangents, distinct storages, leaving out the
    forward's inputs at `static` positions (parameters, buffers); saved convolution weights as their channels-last
    copies where inductor optimises layouts."""
    from torch._inductor.graph import GraphLowering
    placeholders = [node.name for node in forward.graph.nodes if node.op == "placeholder"]
    static_names = {placeholders[i] for i in static if i < len(placeholders)}
    weights = {node.args[1].name for node in forward.graph.nodes
               if node.target is torch.ops.aten.convolution.default and isinstance(node.args[1], fx.Node)}
    layout_opt = bool(weights) and GraphLowering.decide_layout_opt(forward, is_inference=False)
    seen: set[int] = set()
    activations = copies = 0
    for node in backward.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or node.name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        if node.name in static_names:
            if layout_opt and node.name in weights and value.dim() == 4 and \
                    not value.is_contiguous(memory_format=torch.channels_last):
                copies += _concrete(value.untyped_storage().nbytes(), node)
            continue
        storage = value.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            activations += _concrete(storage.nbytes(), node)
    return CompiledSaves(activations, copies)


def _concrete(nbytes, node: fx.Node) -> int:
    """A saved value's bytes as an int: a size dynamo made symbolic at its value here; one that depends on the data
    (an unbacked size: nonzero, a mask's selection) is not known before the step runs, a CaptureError."""
    known = known_size(nbytes)
    if known is not None:
        return known
    raise CaptureError(f"compiled_saves: the compiled step saves {node.name}, whose size depends on the data "
                       f"({nbytes} bytes): not known before the step runs")


_calls = itertools.count(1)


def _fresh_call(module: torch.nn.Module):
    """A function calling `module` with a code object of its own: dynamo caches per code object, so each
    prediction compiles afresh (another budget, another plan) and leaves no cache entry behind."""
    def call(*args, **kwargs):
        return module(*args, **kwargs)
    code = call.__code__.replace(co_name=f"fxmem_compiled_saves_{next(_calls)}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def compiled_saves(module: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                   activation_memory_budget: float | None = None) -> CompiledSaves:
    """What `module`'s training forward under torch.compile (inductor, one graph) saves for backward, at
    `activation_memory_budget` (None: the compiler's setting). Nothing runs: the module, its buffers and the random
    state are as before. A module dynamo cannot capture in one graph is a CaptureError naming the break."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    recorder = _recorder_class()()
    budget = {} if activation_memory_budget is None else {"activation_memory_budget": activation_memory_budget}
    compiled = torch.compile(_fresh_call(module), fullgraph=True)
    try:
        with functorch_config.patch(enable_autograd_cache=False, **budget), \
                inductor_config.patch(fx_graph_cache=False, custom_partitioner_fn=recorder), torch.enable_grad():
            compiled(*args, **(kwargs or {}))
    except torch._dynamo.exc.BackendCompilerFailed:
        if recorder.error is not None:
            raise recorder.error from None
        if recorder.saves is None:
            raise
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CaptureError(f"compiled_saves: torch.compile cannot capture {type(module).__name__} in one graph: "
                           f"{first_line}") from error
    if recorder.saves is None:
        raise CaptureError(f"compiled_saves: {type(module).__name__}'s forward made no training graph to partition "
                           "(no tensor requiring a gradient, or grad mode off)")
    return recorder.saves
