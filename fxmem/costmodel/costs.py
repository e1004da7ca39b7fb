"""What recomputing costs (an op's roofline time in FLOP-equivalents) and what each graph node costs in memory."""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import ops as optable
from ..program import Program
from .trace import trace_forward

# CPU machine balance (FLOPs per byte at which an op stops being memory-bound)
CPU_BALANCE = 10.0
# CPU random draws cost far more than their bytes (a Bernoulli draw per element against fast matmuls): 1000
# FLOP-equivalents per element drawn, whatever the dtype it is drawn into (the CPU kernel takes the same time per
# element for bool, uint8 and float; a packed mask writes an eighth of a byte per element and costs the same)
DRAW_COST_PER_ELEMENT_CPU = 1000.0
# CPU kernels slower per byte written than the roofline says, in FLOP-equivalents as above (`python
# benchmarks/remat_recompute_count.py --kernels` measures them): poolings and convolutions, at about the lowest of
# what that benchmark finds (larger convolutions are above that by their FLOPs anyway). Dispatch-level names, as
# the recorder sees them: conv2d and conv_transpose2d run aten.convolution, max_pool2d runs max_pool2d_with_indices
SLOW_KERNELS_CPU = {**dict.fromkeys(("max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices",
                                     "avg_pool2d", "avg_pool3d"), 180.0),
                    "convolution": 170.0}


def op_cost(record, balance: float | None) -> float:
    """Recompute cost of one recorded op: FLOPs, or with a machine balance the roofline max(FLOPs, balance x bytes
    read and written). Views and metadata ops (prim.device) move no data. On CPU (balance below CUDA's) a random
    draw costs DRAW_COST_PER_ELEMENT_CPU per element it draws (its FLOPs in the op table), a pooling or
    convolution at least SLOW_KERNELS_CPU's."""
    if balance is None:
        return float(record.flops)
    category = optable.category(record.func)
    if category == optable.VIEW or optable.ignored(record.func):  # (prim.device and other queries read no data)
        return float(record.flops)
    written = sum(nbytes for nbytes in record.out_bytes if nbytes)
    moved = sum(nbytes for nbytes in record.in_bytes if nbytes) + written
    if category == optable.RANDOM and balance < 100:
        return DRAW_COST_PER_ELEMENT_CPU * float(record.flops)
    slow = SLOW_KERNELS_CPU.get(optable.packet(record.func)) if balance < 100 else None
    if slow is not None:
        return max(float(record.flops), balance * moved, slow * written)
    return max(float(record.flops), balance * moved)


def default_balance(program: Program) -> float:
    """FLOPs per byte at which an op stops being memory-bound: ~10 for CPUs, ~100 for datacenter GPUs."""
    param = next(program.module.parameters(), None)
    return 100.0 if param is not None and param.device.type == "cuda" else CPU_BALANCE


def step_cost(program: Program, mode: str | None = None, loss_fn=None, balance: float | None = None) -> float:
    """Roofline cost of one step of `program` at its example inputs, in FLOP-equivalents: every forward op's
    `op_cost` and, in train mode, twice that for the backward of each op whose output requires grad (the
    convention of the estimate's FLOPs). Recomputation is not in it: the passes that add some state its cost."""
    mode = mode or program.mode
    balance = default_balance(program) if balance is None else balance
    traced = trace_forward(program, program.example_args, program.example_kwargs, mode, loss_fn)
    backward = 2.0 if mode == "train" else 0.0
    return sum(op_cost(record, balance) * (1.0 + (backward if record.out_rg else 0.0))
               for record in traced.recorder.records)


@dataclass
class NodeCost:
    """What one graph node costs: bytes it creates, bytes autograd keeps for it, its FLOPs."""
    name: str
    module: str
    out_bytes: int = 0
    saved_bytes: int = 0  # activations this node's ops save (each storage counted at its first saver)
    kept_bytes: int = 0  # activations this node creates that some op saves: what recomputing the node could drop
    flops: int = 0
    ops: list = field(default_factory=list)


def node_costs(program: Program, mode: str | None = None, loss_fn=None) -> dict[str, NodeCost]:
    """Per-node costs from the static forward trace (for passes deciding what to keep or recompute); with `loss_fn`
    (train mode) the loss's saves count too (logits a cross-entropy keeps)."""
    mode = mode or program.mode
    traced = trace_forward(program, program.example_args, program.example_kwargs, mode, loss_fn)
    recorder, base_keys = traced.recorder, traced.base_keys
    out: dict[str, NodeCost] = {}
    saved_seen: set[int] = set()
    for record in recorder.records:
        cost = out.setdefault(record.node, NodeCost(record.node, record.module))
        cost.flops += record.flops
        cost.out_bytes += sum(recorder.storage_bytes[key] for key in record.new_keys)
        cost.ops.append(str(record.func))
        for key in record.saved:
            if key not in saved_seen and base_keys.get(key) is None:
                saved_seen.add(key)
                cost.saved_bytes += recorder.storage_bytes[key]
    for record in recorder.records:
        out[record.node].kept_bytes += sum(recorder.storage_bytes[key] for key in record.new_keys
                                           if key in saved_seen)
    return out
