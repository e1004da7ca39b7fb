"""Real parameter subclasses (bitsandbytes' Params4bit, Int8Params) among a fake-mode op's inputs.

FakeTensorMode before torch 2.13 returns NotImplemented for any tensor subclass it does not know, a real Parameter
subclass among `allow_non_fake_inputs` too (2.13 takes one that only adds attributes), so a 4-bit linear's
dequantize fails under the fake runs of the program's metadata and the cost model. Those runs hand the op a plain
alias of such a parameter instead: the same storage, shape, strides and values.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree


def has_parameter_subclass(args: tuple, kwargs: dict) -> bool:
    """Whether an op's arguments (top level, or in a list or tuple there) hold an instance of a Parameter subclass
    other than Parameter itself. (A dispatch's `types` leave such a subclass out when it disables dispatch.)"""
    for value in (*args, *kwargs.values()):
        for leaf in value if isinstance(value, (list, tuple)) else (value,):
            if _is_parameter_subclass(leaf):
                return True
    return False


def as_plain_tensor(value):
    """`value` as a plain tensor alias when it is an instance of a Parameter subclass, else `value`."""
    if _is_parameter_subclass(value):
        return value.as_subclass(torch.Tensor)
    return value


def _is_parameter_subclass(value) -> bool:
    """By type: `isinstance(x, nn.Parameter)` also holds for a fake or plain tensor marked as a parameter."""
    return issubclass(type(value), nn.Parameter) and type(value) is not nn.Parameter


def plain_parameters(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args` and `kwargs` with every Parameter-subclass tensor replaced by its plain alias."""
    return pytree.tree_map_only(torch.Tensor, as_plain_tensor, (args, kwargs))
