"""What a step holds: the `MemoryEstimate` every method returns, optimizer state and workspace, ZeRO sharding."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..step_memory import COMMON_KEYS, StepMemory

# bitsandbytes 8-bit optimizers keep 32-bit state for tensors smaller than this (bnb's min_8bit_size)
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
EIGHT_BIT_OPTIMIZERS = ("adamw8bit", "adam8bit", "paged_adamw8bit")


@dataclass
class MemoryEstimate(StepMemory):
    """Bytes of one steady-state step (training) or one forward (inference), estimated."""
    peak_module: str = ""
    by_module: list = field(default_factory=list)  # [(module path, bytes saved for backward)] heaviest first
    flops_forward: int = 0
    flops_backward: int = 0
    method: str = "static"
    notes: list = field(default_factory=list)
    program_key: str = ""  # program_key() of the program estimated (not in to_dict: reports stay the same)

    def to_dict(self) -> dict:
        out = self.plain(COMMON_KEYS + ("peak_module", "flops_forward", "flops_backward", "world_size",
                                        "zero_stage", "timeline", "unknown_ops"))
        out["by_module"] = [{"module": module, "bytes": nbytes} for module, nbytes in self.by_module]
        out["notes"] = list(self.notes)
        return out


def apply_sharding(est: MemoryEstimate, world_size: int, zero_stage: int) -> None:
    """ZeRO / FSDP: stage 1 shards optimizer state, 2 adds gradients, 3 adds parameters."""
    est.world_size, est.zero_stage = world_size, zero_stage
    if world_size == 1 or zero_stage == 0:
        return
    saved = 0
    if zero_stage >= 1:
        shed = est.optimizer_state - math.ceil(est.optimizer_state / world_size)
        est.optimizer_state -= shed
        saved += shed
    if zero_stage >= 2:
        shed = est.grads - math.ceil(est.grads / world_size)
        est.grads -= shed
        saved += shed
    if zero_stage >= 3:
        shed = est.params - math.ceil(est.params / world_size)
        est.params -= shed
        saved += shed
    est.peak = max(0, est.peak - saved)


def optimizer_state_bytes(optimizer: str, params: list[torch.Tensor]) -> int:
    """Bytes of optimizer state for these parameters (bitsandbytes 8-bit: its real state layout)."""
    total = 0
    for param in params:
        if not param.requires_grad:
            continue
        numel, nbytes = param.numel(), param.numel() * param.element_size()
        if optimizer in ("adam", "adamw"):
            total += 2 * nbytes + 4  # exp_avg, exp_avg_sq, float32 step tensor
        elif optimizer == "sgd-momentum":
            total += nbytes
        elif optimizer in EIGHT_BIT_OPTIMIZERS:
            if numel < BNB_MIN_8BIT_SIZE:
                total += 2 * numel * 4
            else:
                total += 2 * numel + 2 * 4 * math.ceil(numel / BNB_BLOCKSIZE)
    if optimizer in EIGHT_BIT_OPTIMIZERS and total:
        total += 2 * 256 * 4  # the two quantization maps
    return total


def optimizer_step_workspace(optimizer: str, params: list[torch.Tensor]) -> int:
    """What optimizer.step() holds above the walk's end of backward: the gradients, and its temporaries.

    Adam/AdamW on CPU run torch's per-tensor loop (foreach kernels are for CUDA devices): for each parameter
    `denom = (exp_avg_sq.sqrt() / c).add_(eps)`, two tensors of its size at once, while the previous parameter's
    `denom` is still referenced until the assignment (a weight following a weight of its size: three at once)."""
    trainable = [param for param in params if param.requires_grad]
    sizes = [param.numel() * param.element_size() for param in trainable]
    if not sizes:
        return 0
    if optimizer in ("adam", "adamw") and not all(param.device.type == "cuda" for param in trainable):
        return sum(sizes) + max(prev + 2 * size for prev, size in zip([0] + sizes, sizes))
    if optimizer in ("adam", "adamw"):
        return sum(sizes) + 2 * max(sizes)
    if optimizer == "sgd-momentum":
        return max(sizes)
    if optimizer in ("sgd", "none"):
        return 0
    return 2 * max(param.numel() * 4 for param in trainable)
