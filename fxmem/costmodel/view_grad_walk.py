"""The static backward walk's part for views whose backward makes a new buffer (select, slice, an expand, a chunk's
outputs; `OpRecord.view_inputs`): each such view's outputs hold gradients of their own, apart from their storage's,
until that view's backward makes its input's from them, the way autograd's engine keeps one input buffer per node.
`StaticBackward` mixes it in: the methods read and change the walk's state (live bytes, gradients, layouts)."""
from __future__ import annotations

from .formula import formula_run
from .forward_walk import timeline_add
from .op_grads import OpGrads


class ViewGradWalk:
    """Gradients of views with a new-buffer backward, inside `StaticBackward` (`view_grads`: view record -> {output:
    bytes of its gradient})."""

    def _hand_fresh_view_grads(self, op: OpGrads, routed: dict) -> None:
        """Inputs that are views whose backward makes a new buffer (`OpRecord.view_inputs`: `x[:, t]`, a chunk),
        given a new gradient by the formula: it is the view's own (its bytes), apart from its storage's, until the
        view's backward makes the base's from it; one added to the one the view has already is a new buffer once
        this op's backward has released what it held (out of place)."""
        record = op.record
        for position, made in routed.items():
            if not made.fresh:
                continue
            (view, out), nbytes = record.view_inputs[position], record.in_bytes[position]
            self.live_bytes += nbytes
            self._bump(record.node, record.module)
            if out in self.view_grads.get(view, {}):
                op.view_sums.append((position, view, out, nbytes))
            else:
                self.view_grads.setdefault(view, {})[out] = nbytes

    def _hand_view_grads_as_is(self, op: OpGrads, routed: dict) -> None:
        """Such inputs given the output's gradient as it is (add's): the view's gradient holds that buffer when no
        other input took it, else shares it (nothing of its own)."""
        record = op.record
        out_key = record.out_keys[0] if record.out_keys else None
        for position, made in routed.items():
            if made.fresh:
                continue
            view, out = record.view_inputs[position]
            grads = self.view_grads.setdefault(view, {})
            if out in grads:
                op.view_sums.append((position, view, out, 0))
                continue
            grads[out] = 0
            if not op.handed_over and out_key in self.grad_live and out_key not in self.param_keys \
                    and out_key not in op.same:
                heir = self.shared.leave(out_key)
                grads[out] = self.grad_live.pop(out_key)
                if heir is not None:  # the buffer stays counted under another gradient that is it
                    self.grad_live[heir] += grads[out]
                    grads[out] = 0
                self.grad_views.discard(out_key)
                op.handed_over = True

    def _add_to_view_grad(self, view: int, out: int, record) -> int:
        """Output `out` of view `view` has a gradient; a new one is added out of place: the sum is a new buffer of
        the output's size, the old one goes (the new one is the caller's to release). Returns the live bytes with
        the three."""
        grads = self.view_grads[view]
        total = self.plan.records[view].out_bytes[out]
        self.live_bytes += total
        self._bump(record.node, record.module)
        high = self.live_bytes
        self.live_bytes -= grads[out]
        grads[out] = total
        return high

    def _view_backward(self, record) -> None:
        """The backward of a view whose outputs have gradients of their own (`view_grads`): a new buffer of its
        input's size made from them (select, slice: zeros with it copied in; expand: it summed; split: them
        joined, with the storage's gradient its other outputs got through views of theirs), with the formula's
        temporaries; then the outputs' gradients go and the new one is handed on (`_hand_view_input_grad`)."""
        node_peak_start = self.node_high = self.live_bytes
        self._recompute(record)
        grads = self.view_grads.pop(record.idx)
        key, nbytes = record.in_keys[0], record.in_bytes[0]
        joined = record.grad_alias == "joined" and key in self.grad_live and key not in self.param_keys
        mask = tuple(out in grads or joined for out in range(len(record.out_keys)))
        strides = tuple(self.grad_layouts.take(out_key, layout) if wanted else None
                        for out_key, layout, wanted in zip(record.out_keys, record.out_layouts, mask))
        run = formula_run(record.call, mask, strides)
        made = run.grads[0] if run.grads else None
        # (an expand to its input's own shape hands the output's gradient on as it is: no new buffer)
        new = 0 if made is not None and not made.fresh and not joined and len(grads) == 1 else nbytes
        self.live_bytes += new + run.temps
        self._bump(record.node, record.module)
        self.live_bytes -= run.temps + sum(grads.values()) - (nbytes - new)
        if joined:  # (what `_join_split_grads` joins)
            self._drop_grad(key)
            self.grad_views.discard(key)
            self.grad_expanded.discard(key)
        node_peak = max(self.live_bytes, node_peak_start, self.node_high)
        self.grad_layouts.receive(key, record.in_layouts[0], made.strides if made is not None else None)
        node_peak = max(node_peak, self._hand_view_input_grad(record, key, nbytes))
        self._free_saved(record)
        self._end_region(record)
        timeline_add(self.timeline, "backward", record.node, self.live_bytes, node_peak)

    def _hand_view_input_grad(self, record, key: int, nbytes: int) -> int:
        """The gradient a view's backward made for its input (`key`, `nbytes`): the output's of the view it was
        made from, or its storage's, added to what they have out of place. Returns the live bytes at the sum."""
        if 0 in record.view_inputs:
            view, out = record.view_inputs[0]
            if out in self.view_grads.get(view, {}):
                high = self._add_to_view_grad(view, out, record)
                self.live_bytes -= nbytes
                return high
            self.view_grads.setdefault(view, {})[out] = nbytes
            return self.live_bytes
        if key not in self.grad_live:
            # as `_input_grads` gives a gradient by storage: the whole storage's (q of a qkv: all three's, which
            # their other views' gradients then fill)
            self.grad_live[key] = nbytes if key in self.param_keys else max(nbytes, self.storage_bytes.get(key, 0))
            self.live_bytes += self.grad_live[key] - nbytes
            return self.live_bytes
        total = nbytes if key in self.grad_views else max(nbytes, self.grad_live[key])
        self.live_bytes += total
        self._bump(record.node, record.module)
        high = self.live_bytes
        self.live_bytes -= nbytes
        self._drop_grad(key)
        self.grad_live[key] = total
        self.grad_views.discard(key)
        self.grad_expanded.discard(key)
        return high
