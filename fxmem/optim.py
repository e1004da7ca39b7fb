"""`fxmem.make_optimizer(module, policy)`: the optimizer a policy asks for, built for a transformed module.

- "adamw" / "adam" / "sgd" / "sgd-momentum": torch's optimizers (`fxmem.step.make_torch_optimizer`);
- "adamw8bit" / "adam8bit" / "paged_adamw8bit": bitsandbytes' 8-bit optimizers (state in uint8 blocks with one
  fp32 absmax per 256 values; tensors under 4096 values keep fp32 state). PagedAdamW8bit pages its state
  through CUDA unified memory; on CPU there is nothing to page to and bitsandbytes runs it unpaged — the returned
  optimizer carries that in `fxmem_notes`.
- parameters stored in bf16/fp16 (the precision pass's `params: bf16`): the optimizer runs on fp32 master copies
  (`MasterWeightOptimizer`): gradients are copied into the fp32 masters, the inner optimizer updates them with
  fp32 state, and the result is rounded back into the low-precision parameters. Small updates are not lost to
  bf16 rounding. Memory per parameter: 2 (bf16) + 4 (master) + the inner optimizer's state in fp32.

Only parameters with `requires_grad` are optimized (frozen quantized weights, QLoRA base weights are skipped).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from .nn.offload import OffloadedOptimizer
from .step import OPTIMIZERS, make_torch_optimizer


class MasterWeightOptimizer:
    """Wraps an optimizer that updates fp32 master copies of low-precision parameters."""

    def __init__(self, params: list[nn.Parameter], name: str, lr: float = 1e-3):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().float().clone()) if p.dtype != torch.float32 else p
                        for p in self.params]
        self.inner = make_torch_optimizer(name, self.masters, lr=lr)
        self.fxmem_notes = [f"{sum(1 for p in self.params if p.dtype != torch.float32)} low-precision parameter(s) "
                            f"updated through fp32 master weights"]

    @property
    def state(self):
        return self.inner.state

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        for param, master in zip(self.params, self.masters):
            if master is param:
                continue
            master.grad = None if param.grad is None else param.grad.detach().float()
        out = self.inner.step(closure) if closure is not None else self.inner.step()
        for param, master in zip(self.params, self.masters):
            if master is not param:
                param.copy_(master)  # round to the parameter's dtype
                master.grad = None
        return out

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "masters": [m.detach() for m in self.masters]}

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for master, saved in zip(self.masters, state_dict["masters"]):
                master.copy_(saved)


def optimizer_name(policy_or_name) -> str:
    if isinstance(policy_or_name, str):
        name = policy_or_name
    elif policy_or_name is None:
        name = "adamw"
    else:
        name = getattr(policy_or_name, "optimizer", None)
        if name is None:
            raise TypeError(f"make_optimizer: expected a Policy or an optimizer name, got "
                            f"{type(policy_or_name).__name__}")
    name = str(name).lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"make_optimizer: unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    return name


def make_optimizer(module: nn.Module, policy="adamw", *, lr: float = 1e-3):
    """The optimizer `policy.optimizer` (or a name) names, for the trainable parameters of `module`.

    A module whose offload pass planned `grads: true` (`module.fxmem_offload`) gets the optimizer wrapped in
    `fxmem.nn.offload.OffloadedOptimizer`: gradients go to the host as they are accumulated (above the plan's
    `grad_threshold` of device memory, if set) and the optimizer steps there."""
    name = optimizer_name(policy)
    params = [p for p in module.parameters() if p.requires_grad]
    if name == "none" or not params:
        return None
    notes = []
    device = params[0].device
    plan = getattr(module, "fxmem_offload", None) or {}
    if plan.get("grads"):
        threshold = plan.get("grad_threshold")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = OffloadedOptimizer(params, lambda ps: make_optimizer_for(name, ps, lr), threshold=threshold)
        where = "the host" if device.type != "cpu" else "host copies (this module is already on the CPU)"
        opt.fxmem_notes = [f"offload grads: {name} steps on {where}; gradients move as they are accumulated"
                           + (f" while device memory is above {threshold} bytes" if threshold else "")]
        return opt
    if name == "paged_adamw8bit" and device.type != "cuda":
        notes.append("paged_adamw8bit: no CUDA device, bitsandbytes runs it unpaged (state stays on the CPU)")
    low = [p for p in params if p.dtype in (torch.bfloat16, torch.float16)]
    if low:
        if name in ("adamw8bit", "adam8bit", "paged_adamw8bit"):
            # bitsandbytes 8-bit optimizers support bf16/fp16 parameters natively (fp32 math, 8-bit state)
            opt = make_torch_optimizer(name, params, lr=lr)
        else:
            opt = MasterWeightOptimizer(params, name, lr=lr)
            notes.extend(opt.fxmem_notes)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = make_torch_optimizer(name, params, lr=lr)
    try:
        opt.fxmem_notes = notes
    except AttributeError:
        pass
    return opt


def make_optimizer_for(name: str, params: list, lr: float):
    """`name` over `params`: low-precision parameters get fp32 master weights unless bitsandbytes handles them."""
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    if low and name not in ("adamw8bit", "adam8bit", "paged_adamw8bit"):
        return MasterWeightOptimizer(params, name, lr=lr)
    return make_torch_optimizer(name, params, lr=lr)


def optimizer_state_bytes(opt) -> int:
    """Real storage bytes of an optimizer's state (after at least one step), master weights included."""
    seen, total = set(), 0

    def add(tensor):
        nonlocal total
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += int(storage.nbytes())
    inner = opt.inner if isinstance(opt, MasterWeightOptimizer) else opt
    for param_state in inner.state.values():
        for value in param_state.values():
            add(value)
    if isinstance(opt, MasterWeightOptimizer):
        for param, master in zip(opt.params, opt.masters):
            if master is not param:
                add(master)
    return total
