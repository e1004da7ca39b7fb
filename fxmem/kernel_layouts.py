"""The memory layouts CPU kernels give their outputs, where the fake (meta) kernels give others.

Fake tensors run an op's meta function or Python decomposition, which sometimes lays out the output differently
from the CPU kernel: `native_batch_norm` keeps a transposed input's strides where the CPU kernel writes a contiguous
output, `elu_backward` follows `self` where the CPU kernel follows `grad_output`. Memory follows from layouts: a
reshape of a non-contiguous tensor copies, a contiguous one's is a view. `CpuKernelLayouts`, a dispatch mode
entered inside a FakeTensorMode, gives such ops' CPU outputs the CPU kernel's strides, so that fake runs copy where
real ones do. `tests/test_kernel_layouts.py` replays these ops and others on real and fake tensors in every layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._prims_common import (compute_elementwise_output_strides, make_channels_last_strides_for,
                                 make_contiguous_strides_for, suggest_memory_format)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .kernel_sizes import with_cpu_kernel_sizes
from .parameter_subclasses import has_parameter_subclass, plain_parameters

aten = torch.ops.aten


@dataclass(frozen=True)
class KernelLayout:
    """How a CPU kernel lays out its outputs: "contiguous"; "suggested", contiguous in the memory format
    `Tensor.suggest_memory_format()` picks for argument `args[0]` (channels-last for an NHWC-strided 4-D input);
    "iterator", as TensorIterator lays out an elementwise result of the arguments `args`, the first one leading."""
    rule: str
    args: tuple = ()


_CONTIGUOUS = KernelLayout("contiguous")

CPU_KERNEL_LAYOUTS: dict = {
    aten.native_batch_norm.default: KernelLayout("suggested", (0,)),
    aten.native_batch_norm_backward.default: KernelLayout("suggested", (1,)),
    aten.native_layer_norm_backward.default: _CONTIGUOUS,
    aten._log_softmax_backward_data.default: _CONTIGUOUS,
    aten.mse_loss_backward.default: _CONTIGUOUS,
    aten.smooth_l1_loss_backward.default: _CONTIGUOUS,
    aten.huber_loss_backward.default: _CONTIGUOUS,
    aten.log_sigmoid_forward.default: _CONTIGUOUS,
    aten.elu_backward.default: KernelLayout("iterator", (0, 5)),
    aten.hardswish_backward.default: KernelLayout("iterator", (0, 1)),
    aten.hardsigmoid_backward.default: KernelLayout("iterator", (0, 1)),
    aten.hardtanh_backward.default: KernelLayout("iterator", (0, 1)),
    aten.softplus_backward.default: KernelLayout("iterator", (0, 1)),
    aten.logit_backward.default: KernelLayout("iterator", (0, 1)),
    aten.native_dropout_backward.default: KernelLayout("iterator", (0, 1)),
}


def kernel_strides(layout: KernelLayout, args: tuple, out: torch.Tensor) -> tuple | None:
    """The strides the CPU kernel gives `out` (an output of a call with positional `args`), or None when the
    rule does not say (an output of another shape than the arguments it follows: a norm's statistics)."""
    if layout.rule == "contiguous":
        return make_contiguous_strides_for(out.shape)
    leading = [args[i] for i in layout.args if i < len(args) and isinstance(args[i], torch.Tensor)]
    if not leading or any(tuple(t.shape) != tuple(out.shape) for t in leading):
        return None
    if layout.rule == "suggested":
        if suggest_memory_format(leading[0]) == torch.contiguous_format:
            return make_contiguous_strides_for(out.shape)
        return make_channels_last_strides_for(out.shape)
    return tuple(compute_elementwise_output_strides(*leading))


def as_cpu_kernel_lays_out(func, args: tuple, out):
    """`out`, the fake result of `func(*args)`, with each tensor output on the CPU re-laid out (a fresh tensor of
    the same values) where the CPU kernel's strides differ from the fake kernel's."""
    layout = CPU_KERNEL_LAYOUTS.get(func)
    if layout is None:
        return out

    def relaid(tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.dim() < 2:
            return tensor
        strides = kernel_strides(layout, args, tensor)
        if strides is None or tuple(strides) == tuple(tensor.stride()):
            return tensor
        fresh = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device)
        return fresh.copy_(tensor)  # (the values too: fakes may carry real ones, see fxmem.fake)
    return pytree.tree_map(relaid, out)


class CpuKernelLayouts(TorchDispatchMode):
    """Entered inside a FakeTensorMode (and below any mode that records storages): ops in `CPU_KERNEL_LAYOUTS`
    return their CPU outputs with the CPU kernel's strides, and outputs fake kernels leave empty get the CPU
    kernel's size (`fxmem.kernel_sizes`). Real parameter subclasses among an op's inputs reach the fake mode as
    plain aliases (`fxmem.parameter_subclasses`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if has_parameter_subclass(args, kwargs):
            args, kwargs = plain_parameters(args, kwargs)
        out = func(*args, **kwargs)
        return with_cpu_kernel_sizes(func, tuple(args), as_cpu_kernel_lays_out(func, tuple(args), out))
