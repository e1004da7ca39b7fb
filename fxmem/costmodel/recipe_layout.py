"""A forward trace as if some outputs were saved as recipes (fxmem.nn.recast), without tracing the rewrite.

A pass that plans recipes (the checkpoint pass's remat sites) weighs many sets of them; tracing each rewrite would
cost a forward trace per set. `as_recipes` edits the records of one trace instead, as a `RecipeLayout` says: which
outputs are recipes, which are recomputed once for all their saves, which recipes hold which nested, which one run
makes together, and what else a recipe keeps. A pass that emits the rewrite traces it for the real record.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from .trace import ForwardTrace


@dataclass(frozen=True)
class RecipeLayout:
    """What a set of recipes saves in place of their outputs (storage keys as in the trace)."""
    keys: frozenset  # outputs saved as recipes: their savers save the recipe instead
    shared: frozenset = frozenset()  # of `keys`, recomputed once for all their saves
    # as `DispatchRecorder.nesting`: nested recipe key -> {holder key: used through its shared value}
    nesting: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)  # as `DispatchRecorder.recipe_group`: outputs of one shared run
    # output key -> storage keys its recipe holds that nothing saves (a softmax's mask): saved by its savers too,
    # as the traced rewrite records them
    kept: dict = field(default_factory=dict)


def as_recipes(traced: ForwardTrace, layout: RecipeLayout) -> ForwardTrace:
    """`traced` as if the outputs `layout` names were saved as recipes. What a recipe holds is not recorded
    (`recipe_holds` stays as traced): this is for outputs whose recipe arguments are kept anyway (remat sites),
    where holding them adds nothing, but for `layout.kept`."""
    recorder = copy.copy(traced.recorder)
    keys = layout.keys
    recorder.recipe_shared = set(recorder.recipe_shared) | (set(layout.shared) & set(keys))
    recorder.planned_nesting = {**recorder.planned_nesting, **layout.nesting}
    recorder.recipe_group = {**recorder.recipe_group, **layout.groups}
    records = []
    for record in recorder.records:
        if record.region is None and record.saved and any(key in keys for key in record.saved):
            record = copy.copy(record)
            record.recast = list(record.recast) + [key for key in record.saved if key in keys]
            record.saved = [key for key in record.saved if key not in keys]
            record.saved += [held for key in record.recast for held in layout.kept.get(key, ())
                             if held not in record.saved]
        records.append(record)
    recorder.records = records
    return dataclasses.replace(traced, recorder=recorder)
