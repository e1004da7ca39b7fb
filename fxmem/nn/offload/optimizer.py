"""Gradients and optimizer state off the device: `OffloadedOptimizer` (ZeRO-Offload style) moves each gradient to
the host when it is accumulated and steps on host copies of the parameters."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class OffloadedOptimizer:
    """ZeRO-Offload style: gradients leave the device as soon as they are accumulated, the optimizer steps on
    host copies of the parameters, and the updated values are copied back.

        opt = OffloadedOptimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        loss.backward(); opt.step(); opt.zero_grad()

    threshold: bytes; a gradient is moved only if the device's allocated memory is above it when the
    gradient is ready (memory pressure), otherwise it stays and is moved at `step()`. `memory_fn` measures the
    device's allocated bytes (default: torch.cuda.memory_allocated on CUDA, and on CPU the sum of live
    parameter and gradient bytes). Parameters end a step bit-identical to the wrapped optimizer run on the
    device, because the same optimizer code runs on the same values (fp32 or the parameter's dtype).
    """

    def __init__(self, params, make_optimizer: Callable[[list], torch.optim.Optimizer], threshold: int | None = None,
                 memory_fn: Callable[[], int] | None = None, host: str = "cpu"):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("OffloadedOptimizer: no parameters require grad")
        self.threshold = threshold
        pin = torch.cuda.is_available()
        self.host = torch.device(host)
        self.master = []
        for param in self.params:
            master_copy = param.detach().to(self.host, copy=True)
            if pin and master_copy.device.type == "cpu":
                master_copy = master_copy.pin_memory()
            self.master.append(nn.Parameter(master_copy, requires_grad=True))
        self.optimizer = make_optimizer(self.master)
        self.memory_fn = memory_fn or self._default_memory
        self.moved = 0  # gradients moved early (in backward) in the last step
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    def _default_memory(self) -> int:
        device = self.params[0].device
        if device.type == "cuda":
            return int(torch.cuda.memory_allocated(device))
        return sum(p.numel() * p.element_size() + (p.grad.numel() * p.grad.element_size() if p.grad is not None
                                                   else 0) for p in self.params)

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if self.threshold is not None and self.memory_fn() <= self.threshold:
                return
            self._move(index)
            self.moved += 1
        return hook

    def _move(self, index: int) -> None:
        param, master_param = self.params[index], self.master[index]
        if param.grad is None:
            return
        # a copy to the host that returns before it is done (non_blocking) is safe only where nothing reads it before
        # step() synchronizes; a gradient accumulated into one already moved is added on the host at once, so that
        # copy blocks (and, on the same stream, waits for the earlier one too)
        host_grad = param.grad.detach().to(self.host, non_blocking=param.grad.is_cuda and master_param.grad is None)
        master_param.grad = host_grad if master_param.grad is None else master_param.grad.add_(host_grad)
        param.grad = None  # the device gradient is freed now

    def step(self) -> None:
        for index in range(len(self.params)):
            self._move(index)  # anything kept on the device (below the threshold)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.optimizer.step()
        with torch.no_grad():
            for param, master_param in zip(self.params, self.master):
                param.copy_(master_param, non_blocking=param.is_cuda)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.moved = 0
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param in self.params:
            param.grad = None

    @property
    def state(self):
        return self.optimizer.state

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
