"""Fake runs lay out each op's outputs as the CPU kernels do (`fxmem.kernel_layouts`): every aten call of small
modules, forward and backward, with inputs and output gradients in several layouts, replayed on fake tensors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxmem.kernel_layouts import CPU_KERNEL_LAYOUTS, CpuKernelLayouts


class _Calls(TorchDispatchMode):
    """Each functional aten call: (op, args, kwargs, output strides)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if not schema.is_mutable and not any(ret.alias_info for ret in schema.returns):
            self.calls.append((func, args, kwargs, _strides(out)))
        return out


def _strides(out) -> list:
    """(shape, strides) of each tensor output, a size-1 dimension's stride left out (it means nothing)."""
    return [(tuple(t.shape), tuple(s if n != 1 else None for n, s in zip(t.shape, t.stride())))
            for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel()]


def _layouts(x: torch.Tensor) -> list:
    """`x` contiguous, with its last two or its first two dimensions swapped in memory, and channels-last."""
    out = [x.contiguous(), x.transpose(-1, -2).contiguous().transpose(-1, -2),
           x.transpose(0, 1).contiguous().transpose(0, 1)]
    if x.dim() == 4:
        out.append(x.contiguous(memory_format=torch.channels_last))
    return out


class _Loss(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.loss = loss

    def forward(self, x):
        return self.loss(x, torch.linspace(-1, 1, x.numel()).reshape(x.shape), reduction="none")


class _NativeDropout(nn.Module):
    """`aten.native_dropout`, which only fused (non-CPU) dropout reaches from nn.Dropout."""

    def forward(self, x):
        return torch.native_dropout(x, 0.3, True)[0]


class _Logit(nn.Module):
    def forward(self, x):
        return torch.logit(torch.sigmoid(x), eps=1e-3)


MODULES = {
    "batch norm 1d": (nn.BatchNorm1d(6), (4, 6, 10)),
    "batch norm 2d": (nn.BatchNorm2d(6), (2, 6, 5, 5)),
    "batch norm 1d, no affine": (nn.BatchNorm1d(6, affine=False, track_running_stats=False), (4, 6, 10)),
    "layer norm": (nn.LayerNorm(10), (4, 6, 10)),
    "group norm": (nn.GroupNorm(3, 6), (2, 6, 5, 5)),
    "log softmax": (nn.LogSoftmax(-1), (4, 6, 10)),
    "softmax": (nn.Softmax(1), (4, 6, 10)),
    "elu": (nn.ELU(), (4, 6, 10)),
    "elu in place": (nn.Sequential(nn.Linear(10, 10), nn.ELU(inplace=True)), (4, 6, 10)),
    "hardswish": (nn.Hardswish(), (4, 6, 10)),
    "hardsigmoid": (nn.Hardsigmoid(), (4, 6, 10)),
    "hardtanh": (nn.Hardtanh(), (4, 6, 10)),
    "softplus": (nn.Softplus(), (4, 6, 10)),
    "log sigmoid": (nn.LogSigmoid(), (4, 6, 10)),
    "logit": (_Logit(), (4, 6, 10)),
    "native dropout": (_NativeDropout(), (4, 6, 10)),
    "gelu": (nn.GELU(), (4, 6, 10)),
    "silu": (nn.SiLU(), (4, 6, 10)),
    "mse loss": (_Loss(F.mse_loss), (4, 6, 10)),
    "smooth l1 loss": (_Loss(F.smooth_l1_loss), (4, 6, 10)),
    "huber loss": (_Loss(F.huber_loss), (4, 6, 10)),
    "linear": (nn.Linear(10, 7), (4, 6, 10)),
    "conv 2d": (nn.Conv2d(6, 4, 3, padding=1), (2, 6, 5, 5)),
    "avg pool 1d": (nn.AvgPool1d(2), (4, 6, 10)),
    "max pool 2d": (nn.MaxPool2d(2), (2, 6, 6, 6)),
}


def _real_calls(module: nn.Module, shape: tuple) -> list:
    torch.manual_seed(0)
    module.train()
    calls = _Calls()
    for x in _layouts(torch.randn(shape)):
        x = x.detach().requires_grad_(True)
        with calls:
            out = module(x)
            for grad in _layouts(torch.randn(out.shape)):
                torch.autograd.backward(out, grad, retain_graph=True)
    return calls.calls


@pytest.mark.parametrize("name", MODULES)
def test_fake_runs_lay_out_outputs_as_cpu_kernels_do(name):
    module, shape = MODULES[name]
    calls = _real_calls(module, shape)
    assert calls
    differ = []
    for func, args, kwargs, real in calls:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, fake_mode.from_tensor, (args, kwargs))
        with fake_mode, CpuKernelLayouts():
            fake = _strides(func(*fake_args, **fake_kwargs))
        if fake != real:
            differ.append(f"{func} on {[tuple(a.stride()) for a in args if isinstance(a, torch.Tensor)]}: "
                          f"CPU {real}, fake {fake}")
    assert not differ, "\n".join(differ[:5])


def test_every_op_given_a_cpu_layout_lays_out_differently_without_it():
    """Each entry of the table is needed: without the mode, some call of the modules above differs."""
    seen = set()
    for module, shape in MODULES.values():
        for func, args, kwargs, real in _real_calls(module, shape):
            if func not in CPU_KERNEL_LAYOUTS or func in seen:
                continue
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, fake_mode.from_tensor, (args, kwargs))
            with fake_mode:
                if _strides(func(*fake_args, **fake_kwargs)) != real:
                    seen.add(func)
    assert set(CPU_KERNEL_LAYOUTS) == seen
