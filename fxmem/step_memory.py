"""What one step holds, by kind: the fields the cost model's estimate (`fxmem.costmodel.MemoryEstimate`) and a
measurement (`fxmem.measure.MemoryProfile`) share, so the two are compared field by field."""
from __future__ import annotations

from dataclasses import dataclass, field

COMMON_KEYS = ("method", "mode", "optimizer", "device", "params", "buffers", "grads", "optimizer_state", "inputs",
               "activations", "peak", "peak_phase", "peak_at")


@dataclass
class StepMemory:
    """Bytes of one steady-state step (training) or one forward (inference)."""
    params: int = 0
    buffers: int = 0
    grads: int = 0
    optimizer_state: int = 0
    inputs: int = 0
    activations: int = 0  # saved for backward (plus outputs) at the end of forward
    peak: int = 0
    peak_phase: str = ""
    peak_at: str = ""  # node (forward) or node's backward where the peak occurs
    timeline: list = field(default_factory=list)  # TimelinePoint per node: forward, then backward
    unknown_ops: list = field(default_factory=list)
    mode: str = "train"
    optimizer: str = "adamw"
    method: str = ""
    device: str = "cpu"
    world_size: int = 1
    zero_stage: int = 0

    def plain(self, keys: tuple) -> dict:
        """These fields as plain data, in this order (the timeline's points as dicts, lists copied)."""
        out = {}
        for key in keys:
            value = getattr(self, key)
            if key == "timeline":
                value = [point.to_dict() if hasattr(point, "to_dict") else point for point in value]
            out[key] = list(value) if isinstance(value, list) else value
        return out
