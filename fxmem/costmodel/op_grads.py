"""One op's backward in the static walk (`fxmem.costmodel.backward_walk`): its inputs still to get a gradient, and
what the walk handed on and added for it so far."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OpGrads:
    """One op's backward in the walk."""
    record: object
    ins: list  # (key, bytes, requires grad, position) per input
    same: object = ()  # inputs whose gradient is the output's (a view, an in-place op passing it through)
    shares: bool = False  # add's one gradient for both inputs
    passthrough: bool = False
    grad_view: bool = False  # the op table says the input's gradient may be a view of the output's
    handed_over: bool = False
    handed_to: object = None  # the input (storage key) the output's gradient was handed on to
    handed_expanded: bool = False
    accumulated: int = 0  # bytes added into existing gradients once the formula returns
    sums: list = field(default_factory=list)  # (position, key, bytes added, bytes of the sum, the holder of a
    # gradient kept apart from the storage's it is added to, or None: `StaticBackward.held`): gradients this op adds
    # to ones its inputs have (out of place)
    # storages this op made a gradient for that holds its other views' (q, k, v of a qkv)
    covered: set = field(default_factory=set)
    renewed: list = field(default_factory=list)  # (key, bytes): an in-place op's input gradients, new buffers under
    # its output's key
    fresh: set = field(default_factory=set)  # inputs whose gradient the formula makes new (`formula_run`), not a
    # view of the output's: a view's reshape of a gradient not contiguous in its shape copies
    copied: list = field(default_factory=list)  # (key, bytes): such copies of a view's gradient, under its key
    views: set = field(default_factory=set)  # inputs whose gradient the formula makes a view of an output's
    view_sums: list = field(default_factory=list)  # (position, view record, its output, bytes): gradients added to
    # a view's
    new_buffers: set = field(default_factory=set)  # inputs the walk gives a new gradient buffer
