"""Output sizes CPU kernels give where the fake (meta) kernels give none: oneDNN's LSTM layer
(`aten.mkldnn_rnn_layer`, what `nn.LSTM` runs on CPU) returns a workspace, saved for backward, that its meta
function returns empty. Its size comes from oneDNN's primitive, so it is measured: the real kernel runs once per
call signature on uninitialized tensors of the call's shapes (a layer's worth of memory), or, above
`REAL_RUN_BYTES`, at fewer time steps, extended linearly to the call's (the workspace grows with the steps)."""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

aten = torch.ops.aten
REAL_RUN_BYTES = 256 * 2 ** 20  # at most this much input and output for one measuring run
_WORKSPACE: dict = {}


def with_cpu_kernel_sizes(func, args: tuple, out):
    """`out`, the fake result of `func(*args)`, with outputs the fake kernel leaves empty made the CPU kernel's
    size (fresh fakes: the mode this runs under makes them)."""
    if func is not aten.mkldnn_rnn_layer.default or args[0].device.type != "cpu" or not args[-1]:
        return out  # (args[-1]: train; in eval the kernel keeps no workspace)
    nbytes = rnn_workspace_bytes(args)
    return (*out[:3], torch.empty(nbytes, dtype=torch.uint8, device=args[0].device))


def rnn_workspace_bytes(args: tuple) -> int:
    """The bytes of the workspace `aten.mkldnn_rnn_layer(*args)` returns on the CPU (see the module's note)."""
    key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else
                tuple(a) if isinstance(a, list) else a for a in args)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = _measured_workspace(args)
    return _WORKSPACE[key]


def _measured_workspace(args: tuple) -> int:
    steps = int(args[0].shape[_time_dim(args)])
    layer_bytes = args[0].numel() * args[0].element_size() * (1 + args[10] / max(1, args[0].shape[-1]))
    run_steps = max(1, min(steps, math.floor(steps * REAL_RUN_BYTES / max(1.0, layer_bytes))))
    if run_steps == steps:
        return _run_workspace(args, steps)
    # it grows linearly with the steps beyond a fixed part: the line through two runs, at the call's steps
    fewer = max(1, run_steps // 2)
    at_run, at_fewer = _run_workspace(args, run_steps), _run_workspace(args, fewer)
    per_step = (at_run - at_fewer) / max(1, run_steps - fewer)
    return math.ceil(at_run + per_step * (steps - run_steps))


def _time_dim(args: tuple) -> int:
    return 1 if args[14] else 0  # (args[14]: batch_first)


def _run_workspace(args: tuple, steps: int) -> int:
    """The workspace's bytes from the real kernel, on uninitialized tensors of the call's shapes at `steps` time
    steps (it keeps one only where grad mode is on and its weights need grad)."""
    time_dim = _time_dim(args)
    with unset_fake_temporarily(), torch.enable_grad():
        real = [torch.empty(_shape(a, time_dim, steps, i == 0), dtype=a.dtype).requires_grad_(a.requires_grad)
                if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        workspace = aten.mkldnn_rnn_layer.default(*real)[3]
    return 0 if workspace is None else workspace.numel() * workspace.element_size()


def _shape(tensor: torch.Tensor, time_dim: int, steps: int, is_input: bool) -> list:
    shape = list(tensor.shape)
    if is_input:
        shape[time_dim] = steps
    return shape
