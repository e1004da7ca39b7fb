"""Kernel workspaces the cost model does not count, named in the estimate rather than left out silently.

On CUDA, cuDNN's convolutions take a workspace from the caching allocator while they run, forward and backward. It
is no tensor, so neither the cost model nor `fxmem.measure` counts it, yet it adds to the allocator's peak. On an
H200 (`benchmarks/cuda_allocator_gap.py`: the U-Net, base 64 at 128x128, batch 53) one `convolution_backward` took
640 MiB, and the checkpointed step's allocator peak stood 0.52 GiB above its live tensors; eager's peak, at the end
of the forward, hid it. Its size follows the algorithm cuDNN picks at run time, so it is named, not estimated.
"""
from __future__ import annotations

import torch
from torch import fx

from .. import ops as optable
from ..program import Program

MEASURED = "up to 640 MiB for one op on an H200: benchmarks/results/cuda_allocator_gap.md"


def convolution_count(program: Program) -> int:
    """Calls in the program's graphs (nested graph modules included) of ops taking a cuDNN workspace on CUDA: the
    convolutions (`fxmem.ops.takes_cuda_workspace`)."""
    return sum(1 for module in program.module.modules() if isinstance(module, fx.GraphModule)
               for node in module.graph.nodes
               if node.op == "call_function" and optable.takes_cuda_workspace(node.target))


def workspace_notes(program: Program, device: str) -> list[str]:
    """The estimate's note naming what it leaves out on `device`: on CUDA, the convolutions' cuDNN workspaces."""
    if torch.device(device).type != "cuda":
        return []
    count = convolution_count(program)
    if not count:
        return []
    return [f"not counted on CUDA: the cuDNN workspaces of {count} convolution call(s), taken and given back while "
            f"each runs (forward and backward); they can raise the allocator's peak above this estimate ({MEASURED})"]
