"""What recomputing a span of a forward trace would hold, for a planner choosing regions before it emits any."""
from __future__ import annotations

from ..nn.regions import names_op
from .liveness import TraceLiveness, first_unpack
from ..nn.dropout import DRAW_OPS
from .recipe_closure import recipe_high
from .trace import ForwardTrace, cached_per_trace
from .trace_index import TraceIndex


class Keeps:
    """The one thing `TraceLiveness.recompute_high` asks of a region's RegionInfo (whether it keeps an op's
    outputs), answered once per op overload."""
    __slots__ = ("_ops", "_seen")

    def __init__(self, keep_ops: frozenset):
        self._ops, self._seen = keep_ops, {}

    def keeps(self, func) -> bool:
        kept = self._seen.get(id(func))  # (overloads live as long as torch; hashing one by id is much cheaper)
        if kept is None:
            kept = self._seen[id(func)] = names_op(func, self._ops)
        return kept


class RecomputeWalk:
    """The same walk as the estimate of an emitted region (`TraceLiveness.recompute_high`), with a span of the
    trace run as a recompute region that keeps the outputs of the ops `keep_ops` names (as RegionInfo.keep_ops).

    `over(first, last, keep_ops)` gives, for records first..last:
    - the most the recomputation holds at once above what it leaves for the backward;
    - the bytes it leaves: what the span's ops save of its own making;
    - of those, the ones a step without the region would not hold (recipe saves, region inputs made again), as
      (node of the first op saving it, bytes): each is live in backward until that node's backward.
    `runs_in(first, last)` names the node in whose backward the recomputation runs.

    On a program with recipes (fxmem.nn.recast), inside an emitted region the recipe scope steps aside: what the
    span's ops save as recipes they save as tensors there, recomputed and left for the backward, and a region input
    that is a recipe's output is made again for the recomputation (left too if an op in the span saves it, else
    held while it runs)."""

    def __init__(self, traced: ForwardTrace):
        self.recorder, self.base_keys, self.out_keys = traced.recorder, traced.base_keys, traced.out_keys
        self.records = self.recorder.records
        self.liveness = TraceLiveness.of(traced)
        self.created_in = TraceIndex.of(self.recorder).created_in
        self._memo: dict = {}

    @classmethod
    def of(cls, traced: ForwardTrace) -> "RecomputeWalk":
        """One walk per trace, kept on its recorder (a planner asks about the same spans for several candidate
        sets)."""
        return cached_per_trace(traced.recorder, "_fxmem_recompute_walk", lambda: cls(traced))

    def runs_in(self, first: int, last: int) -> str:
        """The node in whose backward the recomputation of records first..last runs: its last op that saves a tensor
        (the ops after it save nothing; their backward runs first)."""
        return self.records[first_unpack(self.records, first, last)].node

    def over(self, first: int, last: int, keep_ops: frozenset, recipes: bool = False) -> tuple[int, int, list]:
        """(see the class docstring); `recipes`: the span runs as a recipe region (`recipe_closure`)."""
        key = (first, last, frozenset(keep_ops), recipes)
        if key not in self._memo:
            self._memo[key] = self._over(first, last, key[2], recipes)
        return self._memo[key]

    def _made_again(self, key: int, first: int) -> bool:
        """Whether `key` is a region input (records from `first` on) that is a recipe's output."""
        return key in self.recorder.recipe_holds and self.created_in.get(key, -1) < first and key not in self.out_keys

    def _over(self, first: int, last: int, keep_ops: frozenset, recipes: bool) -> tuple[int, int, list]:
        records, storage_bytes, base = self.records, self.recorder.storage_bytes, self.base_keys
        keeps = Keeps(keep_ops)
        made = {key for record in records[first:last + 1] for key in record.new_keys}
        kept = {key for record in records[first:last + 1] if keeps.keeps(record.func) for key in record.new_keys}
        saved: dict[int, int] = {}
        plain: set[int] = set()  # saved as tensors outside a region too
        for record in records[first:last + 1]:
            if record.out_rg:
                plain.update(record.saved)
                for key in record.saved + record.recast:  # (recipe saves are plain inside a region)
                    if base.get(key) is None and key not in kept and (key in made or self._made_again(key, first)):
                        saved[key] = min(saved.get(key, record.idx), record.idx)
        again = {key: storage_bytes[key] for record in records[first:last + 1]
                 for key in record.in_keys + record.list_keys
                 if key is not None and base.get(key) is None and key not in saved and self._made_again(key, first)}
        leaves = sum(storage_bytes[key] for key in saved)
        if recipes:
            high = recipe_high(self.liveness, first, last, saved, again, draws_again=not keep_ops & DRAW_OPS)
        else:
            high = self.liveness.recompute_high(first, last, keeps, saved, again)
        extra = [(records[i].node, storage_bytes[key]) for key, i in saved.items()
                 if key not in plain or self._made_again(key, first)]
        return max(0, high - leaves), leaves, extra
