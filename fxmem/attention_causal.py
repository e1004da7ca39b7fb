"""Which masks of an attention site provably are the top-left causal mask SDPA's `is_causal` means: a keep-mask
read from a constant buffer (or an in-graph `tril(ones)`) whose values are exactly lower-triangular ones, sliced
from index 0 on both of its last two dims to exactly the score matrix's size."""
from __future__ import annotations

import torch
from torch import fx

from .attention_constants import float_const
from .attention_nodes import aten, attr_value, is_op, shape, sym_shape
from .attention_site import AttentionSite


def _tril_source(n: fx.Node) -> tuple[torch.Tensor | None, str]:
    """The constant whose (top-left) slice `n` is, if n = slice*(const) with every slice starting at 0."""
    while is_op(n, {aten.slice.Tensor, aten.alias.default, aten.detach.default}):
        if n.target is not aten.slice.Tensor:  # a full slice is captured as alias
            n = n.args[0]
            continue
        a = list(n.args) + [None] * (5 - len(n.args))
        if a[2] not in (None, 0) or (a[4] not in (None, 1)):
            return None, "slice does not start at 0"
        n = a[0]
    if isinstance(n, fx.Node) and n.op == "get_attr":
        t = attr_value(n)
        return (t if isinstance(t, torch.Tensor) else None), f"buffer {n.target}"
    if is_op(n, {aten.tril.default}) and (len(n.args) < 2 or n.args[1] == 0):
        base = n.args[0]
        if is_op(base, {aten.ones.default, aten.ones_like.default}) or (
                is_op(base, {aten.full.default}) and float_const(base.args[1]) == 1.0):
            s = shape(base)
            if s is not None:
                return torch.ones(s).tril(), "tril(ones)"
    return None, "not a constant buffer"


def _is_lower_tri_ones(t: torch.Tensor) -> bool:
    if t.dim() < 2 or any(s != 1 for s in t.shape[:-2]):
        return False
    m = t.reshape(t.shape[-2], t.shape[-1]) != 0
    want = torch.ones(m.shape, dtype=torch.bool, device=m.device).tril()
    return bool(torch.equal(m, want))


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
    s, m = sym_shape(scores_like), sym_shape(node)
    if s is None or m is None or len(m) < 2 or m[-2:] != s[-2:] or any(x != "1" for x in m[:-2]):
        return False, ""
    return True, f"{how} sliced to the score shape"


def finish_masks(site: AttentionSite) -> None:
    """Mark the provably causal masks of `site` (`site.causal` when that is its only mask) and note how SDPA treats
    its other bool masks."""
    for m in site.masks:
        if m.kind in ("keep", "drop"):
            m.causal, how = _causal_keep(m.node, site.scores, m.kind)
            if m.causal:
                m.source += f" ({how})"
    if len(site.masks) == 1 and site.masks[0].causal:
        site.causal = True
    elif any(m.causal for m in site.masks):
        site.notes.append("causal mask combined with another mask: passed as an explicit attn_mask")
    for m in site.masks:
        if m.kind in ("keep", "drop") and not m.causal:
            site.notes.append("bool mask: a row whose every key is masked gives 0 with SDPA where the original "
                              "softmax gives NaN")
            break
