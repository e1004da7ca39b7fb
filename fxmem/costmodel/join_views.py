"""Which tensors a join (cat, stack) reads are views of their storage (`state.unsqueeze(1)`), and the view that made
each. Autograd hands such a tensor's slice of the join's gradient to that view's backward, not to the storage's
producer: until the view's backward runs, a gradient another op makes for the storage is its producer's first one,
not a sum (the static walk's `pending` views)."""
from __future__ import annotations

from .. import ops as optable


def _reshapes(record) -> bool:
    """A view whose backward hands on a view of its gradient (unsqueeze, transpose) and that lays its output out
    otherwise than its input."""
    info = optable.lookup(record.func)
    if info is None or info.category != optable.VIEW or not info.grad_passthrough or not info.grad_view:
        return False
    ins, outs = record.in_layouts[:1], record.out_layouts[:1]
    return bool(ins and outs and ins[0] is not None and outs[0] is not None
                and (ins[0].shape, ins[0].stride) != (outs[0].shape, outs[0].stride))


def join_views(records) -> dict[int, dict[int, int]]:
    """Join record index -> {storage key of a tensor it joins: the record of the view that made that tensor}, for
    tensors that the latest such view of their storage, laid out as they are, made."""
    views_of: dict[int, list] = {}  # storage key -> [(view record index, (shape, stride))]
    found: dict[int, dict[int, int]] = {}
    for record in records:
        if _reshapes(record) and record.in_keys[0] is not None and record.in_keys[0] == record.out_keys[0]:
            layout = record.out_layouts[0]
            views_of.setdefault(record.in_keys[0], []).append((record.idx, (layout.shape, layout.stride)))
        if record.grad_alias != "sliced" or not record.list_keys or record.call is None:
            continue
        metas = record.call[1][0] if isinstance(record.call[1][0], tuple) else ()
        for key, meta in zip(record.list_keys, metas):
            made = [idx for idx, layout in views_of.get(key, ())
                    if meta is not None and layout == (meta.shape, meta.stride)]
            if made:
                found.setdefault(record.idx, {})[key] = made[-1]
    return found
