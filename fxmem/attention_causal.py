"""Which masks of an attention site provably are the top-left causal mask SDPA's `is_causal` means: a keep-mask
read from a constant buffer (or an in-graph `tril(ones)`) whose values are exactly lower-triangular ones, sliced
from index 0 on both of its last two dims to exactly the score matrix's size."""
from __future__ import annotations

import torch
from torch import fx

from .attention_constants import float_const
from .attention_nodes import aten, attr_value, is_op, shape, sym_shape
from .attention_site import AttentionSite


def _tril_source(node: fx.Node) -> tuple[torch.Tensor | None, str]:
    """The constant whose (top-left) slice `node` is, if node = slice*(const) with every slice starting at 0."""
    while is_op(node, {aten.slice.Tensor, aten.alias.default, aten.detach.default}):
        if node.target is not aten.slice.Tensor:  # a full slice is captured as alias
            node = node.args[0]
            continue
        slice_args = list(node.args) + [None] * (5 - len(node.args))
        if slice_args[2] not in (None, 0) or (slice_args[4] not in (None, 1)):
            return None, "slice does not start at 0"
        node = slice_args[0]
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = attr_value(node)
        return (value if isinstance(value, torch.Tensor) else None), f"buffer {node.target}"
    if is_op(node, {aten.tril.default}) and (len(node.args) < 2 or node.args[1] == 0):
        base = node.args[0]
        if is_op(base, {aten.ones.default, aten.ones_like.default}) or (
                is_op(base, {aten.full.default}) and float_const(base.args[1]) == 1.0):
            ones_shape = shape(base)
            if ones_shape is not None:
                return torch.ones(ones_shape).tril(), "tril(ones)"
    return None, "not a constant buffer"


def _is_lower_tri_ones(tensor: torch.Tensor) -> bool:
    if tensor.dim() < 2 or any(s != 1 for s in tensor.shape[:-2]):
        return False
    nonzero = tensor.reshape(tensor.shape[-2], tensor.shape[-1]) != 0
    want = torch.ones(nonzero.shape, dtype=torch.bool, device=nonzero.device).tril()
    return bool(torch.equal(nonzero, want))


def _causal_keep(mask: fx.Node, scores_like: fx.Node, kind: str) -> tuple[bool, str]:
    """Is `mask` (a keep- or drop-mask) provably the top-left causal mask of the scores' last two dims?"""
    node, polarity = mask, kind  # polarity: keep = True attends
    # peel eq(x, 0) / ne(x, 0) / logical_not / bool casts
    for _ in range(4):
        if is_op(node, {aten.eq.Scalar}) and float_const(node.args[1]) == 0.0:
            node, polarity = node.args[0], ("drop" if polarity == "keep" else "keep")
            continue
        if is_op(node, {aten.ne.Scalar}) and float_const(node.args[1]) == 0.0:
            node = node.args[0]
            continue
        if is_op(node, {aten.logical_not.default, aten.bitwise_not.default}):
            node, polarity = node.args[0], ("drop" if polarity == "keep" else "keep")
            continue
        if is_op(node, {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}):
            node = node.args[0]
            continue
        break
    if polarity != "keep":
        return False, ""
    src, how = _tril_source(node)
    if src is None or not _is_lower_tri_ones(src):
        return False, ""
    score_shape, mask_shape = sym_shape(scores_like), sym_shape(node)
    if score_shape is None or mask_shape is None or len(mask_shape) < 2 or mask_shape[-2:] != score_shape[-2:] or \
            any(x != "1" for x in mask_shape[:-2]):
        return False, ""
    return True, f"{how} sliced to the score shape"


def finish_masks(site: AttentionSite) -> None:
    """Mark the provably causal masks of `site` (`site.causal` when that is its only mask) and note how SDPA treats
    its other bool masks."""
    for mask in site.masks:
        if mask.kind in ("keep", "drop"):
            mask.causal, how = _causal_keep(mask.node, site.scores, mask.kind)
            if mask.causal:
                mask.source += f" ({how})"
    if len(site.masks) == 1 and site.masks[0].causal:
        site.causal = True
    elif any(m.causal for m in site.masks):
        site.notes.append("causal mask combined with another mask: passed as an explicit attn_mask")
    for mask in site.masks:
        if mask.kind in ("keep", "drop") and not mask.causal:
            site.notes.append("bool mask: a row whose every key is masked gives 0 with SDPA where the original "
                              "softmax gives NaN")
            break
