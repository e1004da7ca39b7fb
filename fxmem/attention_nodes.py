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


def is_op(n, targets) -> bool:
    """`n` is a node that calls one of `targets`."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def sym_shape(n) -> tuple | None:
    v = node_value(n, source=SYMBOLIC, tensor_only=True)
    return None if v is None else tuple(str(s) for s in v.shape)


def _as_int(s) -> int:
    try:
        return int(s)
    except Exception:  # noqa: BLE001 - an unbacked / symbolic size: its example hint
        hint = getattr(getattr(s, "node", None), "hint", None)
        return int(hint) if hint is not None else -1


def shape(n) -> tuple | None:
    v = node_value(n)
    return tuple(_as_int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def dtype(n):
    v = node_value(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def device(n):
    v = node_value(n)
    return v.device if isinstance(v, torch.Tensor) else None


def same_shape(a, b) -> bool:
    """Provably the same shape: symbolic shapes equal (and concrete example shapes equal)."""
    sa, sb = sym_shape(a), sym_shape(b)
    if sa is None or sb is None or sa != sb:
        return False
    return shape(a) == shape(b)


def norm_dim(d: int, ndim: int) -> int:
    """Dim `d` of an `ndim`-dim tensor, counted from the front."""
    return d + ndim if d < 0 else d


def consumers(n: fx.Node) -> list[fx.Node]:
    """The users of `n` but its metadata asserts (`ASSERTS`)."""
    return [u for u in n.users if not is_op(u, ASSERTS)]


def attr_value(n: fx.Node):
    """What the get_attr node `n` names in its graph's module; None when it names nothing."""
    obj = n.graph.owning_module
    for part in str(n.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
