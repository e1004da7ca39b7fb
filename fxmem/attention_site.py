"""What the attention matcher finds: an `AttentionSite` with its `MaskTerm`s, and `Reject`, the reason a site
that is attention is not rewritten."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx


@dataclass
class MaskTerm:
    """One mask applied to the scores. kind: 'keep' (bool, True = attend), 'drop' (bool, True = masked out),
    'additive' (float, added to the scores)."""
    kind: str
    node: fx.Node
    causal: bool = False  # a keep/drop mask that is provably the top-left causal mask
    source: str = ""  # how it was recognised, for the report


@dataclass
class AttentionSite:
    """A matched attention computation softmax(scale * Q K^T + masks) [-> dropout] @ V."""
    module: str  # module path of the softmax
    softmax: fx.Node
    scores: fx.Node | None = None  # the Q @ K^T node
    output: fx.Node | None = None  # the P @ V node, whose uses the rewrite replaces
    nodes: list = field(default_factory=list)  # every node the rewrite replaces, graph order
    query: fx.Node | None = None
    key: fx.Node | None = None  # (..., Lk, E) layout (transpose peeled); None when `key_transposed` must be used
    key_transposed: fx.Node | None = None  # K^T as it is in the graph, when no transpose node could be peeled
    value: fx.Node | None = None
    key_expanded: fx.Node | None = None  # the repeat_kv outputs, used when GQA is not emitted
    value_expanded: fx.Node | None = None
    scale: list = field(default_factory=list)  # factors: ("mul"|"div", float | fx.Node)
    scale_value: float | None = None  # the product at the example inputs
    masks: list = field(default_factory=list)  # MaskTerm
    causal: bool = False  # the only mask is provably causal -> is_causal=True
    # the wider dtype the softmax computes in (cast back before P @ V; `fxmem.attention_precision`), None when none
    softmax_dtype: Any = None
    dtype_changes: list = field(default_factory=list)  # attention_precision.DtypeChange, in walk order
    dropout_p: float = 0.0
    dropout_train: Any = False  # bool or the ModeFlag node
    gqa_groups: int = 1  # query heads per key/value head (1 = no grouping)
    batch_dims: int = 2  # number of leading dims of q (3-D bmm form has 1)
    reason: str | None = None  # why it is not rewritten (None = rewritable)
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def mask(self) -> fx.Node | None:
        """The single mask node (when there is exactly one), for consumers that only want to know."""
        return self.masks[0].node if len(self.masks) == 1 else None

    def describe(self) -> str:
        parts = [f"scale={self.scale_value:.6g}" if self.scale_value is not None else "scale=?"]
        if self.causal:
            parts.append("causal")
        for mask in self.masks:
            if not (self.causal and mask.causal):
                parts.append(f"mask:{mask.kind}")
        if self.dropout_p:
            parts.append(f"dropout={self.dropout_p:g}")
        if self.gqa_groups > 1:
            parts.append(f"gqa={self.gqa_groups}")
        if self.softmax_dtype is not None:
            parts.append(f"softmax in {str(self.softmax_dtype).removeprefix('torch.')}")
        return ", ".join(parts)


class Reject(Exception):
    """Attention, but not provably rewritable: the message is the reason."""
