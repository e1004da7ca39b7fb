"""The dtypes along an attention site: low-precision attention whose softmax runs in a wider dtype.

Real bf16/fp16 code computes the softmax in float32 and casts the probabilities back before P @ V:
`softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)` (Hugging Face's eager attention),
`softmax(scores.float(), dim=-1).type_as(q)`, `.to(q)`, `_softmax(scores, -1, half_to_float=True)`. SDPA in the
attention's own dtype is the same computation: its kernels compute the softmax in float32 for bf16/fp16 inputs.

The rule the matcher applies (`check_precision`): walking from Q @ K^T (dtype D, the dtype SDPA runs in) through
the softmax to P @ V, the dtype may widen once (a cast above the softmax, or the softmax's own `dtype` /
`half_to_float`) to a wider float, and must then narrow once, back to D, before P @ V; with no widening there is no
cast either. An additive mask must be a D tensor (added to widened scores it is promoted exactly; a wider mask would
be rounded to D by SDPA).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .attention_nodes import aten, dtype
from .attention_site import AttentionSite, Reject


@dataclass(frozen=True)
class DtypeChange:
    """One change of dtype on the attention's path: at `node`, from `source` to `target`; `where` is 'scores'
    (above the softmax), 'softmax' (its dtype argument) or 'probabilities' (below it)."""
    node: fx.Node
    source: torch.dtype | None
    target: torch.dtype | None
    where: str


def _wider(source, target) -> bool:
    """`target` is a float dtype that holds every `source` value exactly (bf16/fp16 -> fp32 / fp64, fp32 -> fp64)."""
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return source in floats and target in floats and target.itemsize > source.itemsize


def softmax_output_dtype(softmax: fx.Node):
    """The dtype the softmax node computes in when it differs from its input's (its `dtype` argument, or
    `half_to_float`), else None."""
    src = dtype(softmax.args[0])
    if softmax.target is aten.softmax.int:
        wanted = softmax.args[2] if len(softmax.args) > 2 else softmax.kwargs.get("dtype")
        return wanted if wanted is not None and wanted != src else None
    if softmax.target is aten._softmax.default and len(softmax.args) > 2 and softmax.args[2]:
        return torch.float32
    return None


def record_change(site: AttentionSite, node: fx.Node, source, target, where: str) -> None:
    """Note a dtype change on the site's path (judged once the whole site is known, by `check_precision`)."""
    site.dtype_changes.append(DtypeChange(node, source, target, where))


def check_precision(site: AttentionSite) -> None:
    """Accept the site's dtype changes (one widening, then the cast back to the attention's dtype) or reject it with
    the reason; sets `site.softmax_dtype` and notes what SDPA does instead."""
    attention = dtype(site.scores)
    widen = [c for c in site.dtype_changes if c.where in ("scores", "softmax")]
    narrow = [c for c in site.dtype_changes if c.where == "probabilities"]
    for change in widen:
        if not _wider(change.source, change.target):
            raise Reject(f"scores are cast from {change.source} to {change.target} before the softmax "
                         f"({change.node.name}): SDPA computes in one dtype")
    if len(widen) > 1:
        raise Reject(f"the scores are widened twice before the softmax ({', '.join(c.node.name for c in widen)})")
    if not widen:
        for change in narrow:
            raise Reject(f"the probabilities are cast from {change.source} to {change.target} before P @ V")
    else:
        _check_cast_back(widen[0], narrow, attention)
        site.softmax_dtype = widen[0].target
        wide, low = (str(d).removeprefix("torch.") for d in (widen[0].target, attention))
        site.notes.append(f"softmax computed in {wide} on {low} scores, then cast back: SDPA runs in {low} (its "
                          "kernels compute the softmax in float32)")
    for mask in site.masks:
        if mask.kind == "additive" and dtype(mask.node) != attention:
            raise Reject(f"additive mask {mask.node.name} is {dtype(mask.node)} while the attention computes in "
                         f"{attention}: SDPA would take it rounded to {attention}")


def _check_cast_back(widening: DtypeChange, narrow: list, attention) -> None:
    """After the widening, exactly one cast of the probabilities back to the attention's dtype."""
    if not narrow:
        raise Reject(f"softmax computed in {widening.target} on {attention} scores is not cast back to {attention} "
                     "before P @ V")
    if len(narrow) > 1:
        raise Reject(f"the probabilities are cast {len(narrow)} times before P @ V "
                     f"({', '.join(c.node.name for c in narrow)})")
    if narrow[0].target != attention:
        raise Reject(f"the probabilities are cast to {narrow[0].target}, not back to the scores' {attention}, "
                     "before P @ V")
