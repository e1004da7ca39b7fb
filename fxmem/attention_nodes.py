"""What the attention matcher reads off an aten-level fx node: the op sets it looks for, the example value's
shape and dtype, the users past metadata asserts, the tensor a get_attr names."""
from __future__ import annotations

import torch
from torch import fx

from .node_value import SYMBOLIC, node_value


aten = torch.ops.aten

SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
MATMUL = {aten.matmul.default, aten.bmm.default}
EINSUM = {aten.einsum.default}
# ops that pass the scores or probabilities through unchanged when they keep the dtype (and the device)
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default,
         aten.type_as.default, aten.clone.default, aten.contiguous.default, aten.alias.default}
DROPOUT = {aten.dropout.default}
ASSERTS = {aten._assert_tensor_metadata.default}
SDPA = {aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_attention_math.default}


def is_op(node, targets) -> bool:
    """`node` is a node that calls one of `targets`."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def sym_shape(node) -> tuple | None:
    value = node_value(node, source=SYMBOLIC, tensor_only=True)
    return None if value is None else tuple(str(s) for s in value.shape)


def _as_int(size) -> int:
    try:
        return int(size)
    except Exception:  # noqa: BLE001 - an unbacked / symbolic size: its example hint
        hint = getattr(getattr(size, "node", None), "hint", None)
        return int(hint) if hint is not None else -1


def shape(node) -> tuple | None:
    value = node_value(node)
    return tuple(_as_int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def dtype(node):
    value = node_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def device(node):
    value = node_value(node)
    return value.device if isinstance(value, torch.Tensor) else None


def same_shape(first, second) -> bool:
    """Provably the same shape: symbolic shapes equal (and concrete example shapes equal)."""
    first_symbolic, second_symbolic = sym_shape(first), sym_shape(second)
    if first_symbolic is None or second_symbolic is None or first_symbolic != second_symbolic:
        return False
    return shape(first) == shape(second)


def norm_dim(dim: int, ndim: int) -> int:
    """Dim `dim` of an `ndim`-dim tensor, counted from the front."""
    return dim + ndim if dim < 0 else dim


def consumers(node: fx.Node) -> list[fx.Node]:
    """The users of `node` but its metadata asserts (`ASSERTS`)."""
    return [u for u in node.users if not is_op(u, ASSERTS)]


def attr_value(node: fx.Node):
    """What the get_attr node `node` names in its graph's module; None when it names nothing."""
    obj = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
