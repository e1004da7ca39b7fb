"""What a saved graph may call: the allow-list that `fxmem.load` resolves call targets against.

A saved result names each call target by a qualified name (`torch.ops.aten.add.Tensor`, `operator.getitem`,
`fxmem.nn.remat.remat`). Loading resolves a name only if it is on this list; nothing is imported by name and no
attribute is looked up outside these tables, so a result cannot make `fxmem.load` call anything else
(`builtins.eval`, `os.system`, `subprocess.run`, ...).

- aten operators (`torch.ops.aten.<op>.<overload>`), except those that open files by name (`aten.from_file`,
  `aten.save`: an argument called `filename`);
- the higher-order operators `torch.export` emits around a subgraph (`torch.ops.higher_order.<name>`);
- `operator` arithmetic/comparison/indexing, a few builtins and `torch.sym_*` helpers that fx graphs use;
- fxmem's own runtime functions (`fxmem/nn/`), which passes put into graphs.

`call_method` and `getattr` may only name public attributes of `torch.Tensor`.
"""
from __future__ import annotations

import builtins
import keyword
import math
import operator
import re

import torch

from .nn import attention, dropout, modes, recast, remat

ATEN_PREFIX = "torch.ops.aten."
HOP_PREFIX = "torch.ops.higher_order."
HIGHER_ORDER_OPS = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast"})

_OPERATOR_NAMES = ("getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq",
                   "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift",
                   "matmul")
_BUILTIN_NAMES = ("float", "int", "bool", "abs", "min", "max", "getattr")
_TORCH_NAMES = ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")
_MATH_NAMES = ("ceil", "floor", "trunc", "sqrt")


def _table() -> dict[str, object]:
    table: dict[str, object] = {}
    for prefix, mod, names in (("operator", operator, _OPERATOR_NAMES), ("builtins", builtins, _BUILTIN_NAMES),
                               ("torch", torch, _TORCH_NAMES), ("math", math, _MATH_NAMES)):
        for name in names:
            function = getattr(mod, name, None)
            if function is not None:
                table[f"{prefix}.{name}"] = function
    runtime = (recast.cast_param, remat.remat, remat.remat_call, modes.count_batch, dropout.bool_mask_dropout,
               dropout.bool_mask_dropout_remat, attention.sdpa_dropout)
    for function in runtime:
        table[f"{function.__module__}.{function.__qualname__}"] = function
    return table


PYTHON_TARGETS: dict[str, object] = _table()
# names results saved by earlier versions give functions that moved since -> their name now
MOVED_TARGETS = {"fxmem.nn.recast.remat": "fxmem.nn.remat.remat",
                 "fxmem.nn.recast.remat_call": "fxmem.nn.remat.remat_call"}
_NAME_OF = {id(fn): name for name, fn in PYTHON_TARGETS.items()}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TargetError(ValueError):
    """A call target (or an operator named in an argument) that the allow-list does not hold."""


def target_name(target) -> str:
    """The qualified name a saved graph stores for `target`; TargetError if loading could not resolve it."""
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace != "aten":
            raise TargetError(f"operator {target} is not an aten operator")
        name = f"{ATEN_PREFIX}{target._opname}.{target._overloadname}"
    elif isinstance(target, torch._ops.HigherOrderOperator):
        name = HOP_PREFIX + target.name()
    else:
        name = _NAME_OF.get(id(target))
        if name is None:
            raise TargetError(f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)} is "
                              "not a function a saved graph may call")
    resolve_target(name)  # what is saved must load
    return name


def resolve_target(name) -> object:
    """The callable `name` stands for; TargetError if it is not on the allow-list."""
    if not isinstance(name, str):
        raise TargetError(f"a call target must be a name, got {type(name).__name__}")
    if name.startswith(ATEN_PREFIX):
        return aten_op(name[len("torch.ops."):])
    if name.startswith(HOP_PREFIX):
        hop = name[len(HOP_PREFIX):]
        if hop not in HIGHER_ORDER_OPS:
            raise TargetError(f"{name} is not a higher-order operator a saved graph may call")
        return getattr(torch.ops.higher_order, hop)
    target = PYTHON_TARGETS.get(MOVED_TARGETS.get(name, name))
    if target is None:
        raise TargetError(f"{name} is not a function a saved graph may call")
    return target


def aten_op(name) -> torch._ops.OpOverload:
    """`aten.<op>.<overload>` (how fxmem's runtime functions name ops in their arguments) -> the operator."""
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or parts[0] != "aten" or not all(_IDENT.match(p) for p in parts[1:]):
        raise TargetError(f"{name!r} is not an aten operator name (aten.<op>.<overload>)")
    packet = getattr(torch.ops.aten, parts[1], None)  # (an operator lookup: attributes that are not are refused)
    op = getattr(packet, parts[2], None) if isinstance(packet, torch._ops.OpOverloadPacket) else None
    if not isinstance(op, torch._ops.OpOverload):
        raise TargetError(f"{name} is not an aten operator of this torch")
    if any(a.name == "filename" for a in op._schema.arguments):
        raise TargetError(f"{name} opens a file by name; a saved graph may not call it")
    return op


def check_op_name_args(target, args: tuple, kwargs: dict) -> None:
    """fxmem's recompute functions take the operator they run as a name (`remat(y, 'aten.gelu.default', ...)`): that
    name must be an aten operator too."""
    names = []
    if target is remat.remat and len(args) > 1:
        names.append(args[1])
    elif target is remat.remat_call and args:
        names.append(args[0])
        for member in kwargs.get("_fxmem_chain") or ():
            names.append(member[0] if isinstance(member, (tuple, list)) and member else member)
    for op_name in names:
        aten_op(op_name)


def check_attribute_name(kind: str, name) -> None:
    """`call_method` and `getattr` may only name public attributes of torch.Tensor."""
    if not isinstance(name, str) or not _IDENT.match(name) or name.startswith("_") or keyword.iskeyword(name) \
            or not hasattr(torch.Tensor, name):
        raise TargetError(f"{kind} {name!r} is not a public torch.Tensor attribute")
