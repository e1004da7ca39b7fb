"""The static estimate's backward walk: the records in reverse, each op's gradients (with the buffers autograd shares:
a view's, a join's slices, add's one gradient for both inputs; a select's or a chunk's own until that view's
backward makes its input's), the temporaries its formula holds (`formula_temps`), what regions recompute or bring
back, and what the op saved freed."""
from __future__ import annotations

from collections import defaultdict

from .. import ops as optable
from ..ops import written_positions
from .formula import covers_storage, formula_run
from .forward_walk import ForwardWalk, timeline_add
from .grad_layouts import GradLayouts, fresh_strides
from .join_views import join_views
from .liveness import SavePlan, first_unpack
from .op_grads import OpGrads
from .shared_grads import SharedGrads
from .view_grad_walk import ViewGradWalk


class StaticBackward(ViewGradWalk):
    """The backward walk, from the last record to the first. Its live bytes continue the forward walk's.

    What stays referenced until the step ends: its outputs, what ops off the loss's path saved (`off_loss`:
    records whose backward never runs; their graph stays referenced by the outputs they make), and what custom ops
    keep on their autograd context (`OpRecord.held`: released with the graph, not by backward). `seed`: the loss's
    storage and the bytes of the gradient backward starts from (`seed_gradient`), live from its start to its
    end."""

    def __init__(self, plan: SavePlan, forward: ForwardWalk, off_loss: set, seed: tuple = (None, 0)):
        self.plan = plan
        self.storage_bytes = plan.storage_bytes
        self.live, self.live_bytes = forward.live, forward.live_bytes
        self.peak, self.timeline = forward.peak, forward.timeline
        self.off_loss = off_loss
        self.kept_by_outputs = set(plan.out_keys) | {key for record in plan.records if record.idx in off_loss
                                                     for key in record.saved} | \
            {key for record in plan.records for key in record.held}
        self.param_keys = {key for key, kind in plan.base_keys.items() if kind == "param"}
        self.grad_live: dict[int, int] = {}  # storage key of a forward value -> bytes of its gradient buffer
        self.grad_layouts = GradLayouts()  # the strides of each tensor's gradient
        self.shared = SharedGrads()  # gradients that are one buffer (add's, handed on down a chain of adds)
        # a join's slice handed to a view of a storage (`join_views`) reaches the storage's producer at that view's
        # backward: storage key -> that view's record while it has not run, and the bytes of the gradient other
        # ops made the storage meanwhile (the producer's first, not a sum)
        self.join_views = join_views(plan.records)
        self.pending: dict[int, int] = {}
        # gradients kept apart from their storage's until a later record adds them to it (`_hold_apart`): holder ->
        # (storage key, bytes); holders: ("direct", key) for a producer's while a join's slice waits at a view
        # (`_direct_grad`), ("alias", record) for a weight's at its transpose (`_hold_for_alias`)
        self.held: dict[tuple, tuple[int, int]] = {}
        self.seed = seed
        if seed[0] is not None:
            self.grad_live[seed[0]] = 0  # (counted apart: the records' walk neither makes nor frees it)
            self.live_bytes += seed[1]
        # last forward reader of each storage whose backward runs (one without makes it no gradient: a detach, the
        # device query of a norm's statistics, an op off the loss's path such as the stack of an LSTM's final
        # states when only its outputs are used)
        self.read_until = {key: record.idx for record in plan.records if record.out_rg and record.idx not in off_loss
                           for key in record.in_keys + record.list_keys if key is not None}
        # keys whose gradient is a view of another's buffer, which autograd adds into out of place: a slice of a
        # cat's ("sliced"), a sum's one-element gradient expanded ("expanded")
        self.grad_views: set[int] = set()
        self.grad_expanded: set[int] = set()  # of those, the expanded ones: every stride 0, views of them are views
        # record of a view whose backward makes a new buffer (`OpRecord.view_inputs`) -> {output: bytes of its
        # gradient}, held apart from its storage's until that backward
        self.view_grads: dict[int, dict[int, int]] = {}
        self.node_high = 0  # the highest live bytes inside the current op's backward (transients included)
        self.free_saved_at: dict[int, list[int]] = defaultdict(list)
        kept_until = plan.offload_times.kept_until  # (offloaded, and kept on the device by another saver)
        for key, until in plan.saved_until.items():
            self.free_saved_at[kept_until.get(key, until)].append(key)
        self.recomputed_live: dict[str, int] = {}
        # region -> the record in whose backward it recomputes
        self.recompute_at = {name: first_unpack(plan.records, plan.region_first[name], plan.region_last[name])
                             for name, info in plan.regions.items() if info is not None and info.kind == "recompute"}
        # a recomputed tensor is freed once the last op (in backward order) that saved it has run its backward
        self.recomputed_free_at: dict[int, list] = defaultdict(list)  # record index -> [(region, bytes)]
        for name, recomputed in plan.recompute_keys.items():
            for key, until in recomputed.items():
                self.recomputed_free_at[until].append((name, self.storage_bytes[key]))
        self.reload_at = plan.offload_times.reload_at

    def run(self) -> None:
        for record in reversed(self.plan.records):
            for key in self.reload_at.get(record.idx, ()):
                self.live_bytes += self.storage_bytes[key]
            if not record.out_rg or record.idx in self.off_loss or record.routes_grads:
                self._recompute(record)
                # an op without a backward still frees what is held until its position (a region input held
                # until the region's first op, e.g. a mask built there), and a region whose first op needs no
                # grad (e.g. prim.device) still ends its recomputation here
                self._free_saved(record)
                self._end_region(record)
                continue
            self._op_backward(record)
        # end of backward: only parameter grads stay (plus the step's outputs, still referenced by the caller)
        for key in list(self.grad_live):
            if key not in self.param_keys:
                self.live_bytes -= self.grad_live.pop(key)
        self.live_bytes -= self.seed[1]

    def param_grad_bytes(self) -> int:
        """Bytes of the parameters' gradients the walk holds at its end."""
        return sum(nbytes for key, nbytes in self.grad_live.items() if key in self.param_keys)

    def _bump(self, label: str, module: str) -> None:
        self.node_high = max(self.node_high, self.live_bytes)
        self.peak.see(self.live_bytes, f"{label} (backward)", "backward", module)

    def _grad_bytes(self, key: int) -> int:
        """The bytes of `key`'s gradient buffer: the one it shares with others, else its own."""
        shared = self.shared.size(key)
        return self.grad_live[key] if shared is None else shared

    def _drop_grad(self, key: int) -> None:
        """`key`'s gradient goes: its bytes with it, or to another gradient that is the same buffer and stays."""
        nbytes = self.grad_live.pop(key)
        heir = self.shared.leave(key)
        if heir is not None and heir in self.grad_live:
            self.grad_live[heir] += nbytes
        else:
            self.live_bytes -= nbytes

    def _expanded_view(self, key: int) -> None:
        self.grad_views.add(key)
        self.grad_expanded.add(key)

    def _free_saved(self, record) -> None:
        """What the backward of `record` releases: tensors saved until it, recomputed tensors it saved."""
        for key in self.free_saved_at.get(record.idx, ()):
            if key in self.kept_by_outputs:
                continue  # the step's outputs stay referenced by the caller until the step ends
            if key in self.live:
                self.live.discard(key)
                self.live_bytes -= self.storage_bytes[key]
            elif any(key in keys for keys in self.plan.offloaded.values()):
                self.live_bytes -= self.storage_bytes[key]
        for key in self.plan.offload_times.copy_free_at.get(record.idx, ()):
            self.live_bytes -= self.storage_bytes[key]  # the reloaded copy of a storage kept on the device too
        for name, nbytes in self.recomputed_free_at.get(record.idx, ()):
            if name in self.recomputed_live:
                self.recomputed_live[name] -= nbytes
                self.live_bytes -= nbytes

    def _recompute(self, record) -> None:
        """The region's recomputation, if it runs in this record's backward (`recompute_at`): what it leaves for
        the backward stays, what it holds above that while it runs goes again."""
        region = record.region
        if region and record.idx == self.recompute_at.get(region) and region not in self.recomputed_live:
            self.recomputed_live[region] = self.plan.recompute_bytes.get(region, 0)
            self.live_bytes += self.recomputed_live[region]
            during = self.plan.recompute_over.get(region, 0)
            if during:  # what the recomputation holds while it runs and drops: its own temporaries, inputs it
                self.live_bytes += during  # makes again that no op in it saves
                self._bump(record.node, record.module)
                self.live_bytes -= during

    def _end_region(self, record) -> None:
        """At a region's first record its recomputed tensors are all released."""
        region = record.region
        if region and record.idx == self.plan.region_first.get(region) and region in self.recomputed_live:
            self.live_bytes -= self.recomputed_live.pop(region)

    def _op_backward(self, record) -> None:
        """One op's backward: its outputs' gradients, recomputations and recipes made for it, its inputs'
        gradients and the formula's temporaries at once; then what it releases."""
        plan = self.plan
        if record.idx in self.view_grads:
            self._view_backward(record)
            return
        node_peak_start = self.live_bytes
        self.node_high = self.live_bytes
        again = plan.recast_at.get(record.idx, 0)
        self.live_bytes += again  # parameter copies cast again, recipes recomputed for this op's backward
        self.live_bytes += plan.held_from.get(record.idx, 0)  # a shared recipe, made here for this and earlier savers
        self._seed_output_grads(record)
        grad_mask = tuple(key is not None and key in self.grad_live for key in record.out_keys)  # (before a view
        # hands one on)
        # the region's recomputation runs in the backward of its last op that saves a tensor (its first unpack),
        # once the gradients of that op's outputs are made: with them live (a dropout's scaling after its mask
        # multiply saves nothing, so its gradient is made before)
        self._recompute(record)
        grad_strides = tuple(self.grad_layouts.take(key, layout) if wanted else None
                             for key, layout, wanted in zip(record.out_keys, record.out_layouts, grad_mask))
        run = formula_run(record.call, grad_mask, grad_strides)
        # inputs that are views with a gradient of their own, read by an op whose output is not a view of them
        routed = {position: made for position, made in enumerate(run.grads)
                  if made is not None and position in record.view_inputs and record.in_rg[position]
                  and record.in_keys[position] not in record.out_keys}
        op = self._op_grads(record, skip=routed)
        op.fresh = {record.in_keys[i] for i, made in enumerate(run.grads) if made is not None and made.fresh}
        op.views = {record.in_keys[i] for i, made in enumerate(run.grads) if made is not None and not made.fresh}
        if self._hands_on(record, run):
            op.passthrough = True
            # in place (scatter_reduce_ summing into self): the output's gradient is the written input's, as is
            op.same = set(op.same) | {key for key in op.views if key in record.out_keys}
        self._hand_fresh_view_grads(op, routed)
        self._hand_join_slices(op)
        self._join_split_grads(record)
        self._hand_expanded_sum(op)
        self._input_grads(op)
        self._hand_view_grads_as_is(op, routed)
        self._receive_layouts(op, run)
        # temporaries a backward formula holds with the gradients it makes (pow: x.pow(c - 1) and c * that)
        # (the gradients it makes for inputs that have one already are added to theirs once it returns)
        temps = run.temps + record.copy_slices
        self.live_bytes += temps
        self._bump(record.node, record.module)
        self.live_bytes -= temps + op.accumulated
        self._replace_copied(op)
        node_peak = max(self.live_bytes, node_peak_start, self.node_high)  # (node_high: with the temporaries)
        self.live_bytes -= again
        self.live_bytes -= plan.held_until.get(record.idx, 0)  # a shared recipe's first saver: its last unpack
        # the op's output grads die, and what it saved
        for key in record.out_keys:
            if key is not None and key in self.grad_live and key not in self.param_keys and key not in op.same:
                self._drop_grad(key)
                self.grad_views.discard(key)
        for key, nbytes in op.renewed:
            self.grad_live[key] = nbytes
            self.live_bytes += nbytes
        self._free_saved(record)
        node_peak = self._add_sums(op, node_peak)
        node_peak = max(node_peak, self._add_pending(record), self._add_alias_grad(record))
        self._end_region(record)
        timeline_add(self.timeline, "backward", record.node, self.live_bytes, node_peak)

    def _seed_output_grads(self, record) -> None:
        """The gradients of the op's outputs (allocated by consumers; the graph's outputs get theirs from the
        loss); an output no later op reads (SDPA's logsumexp, a norm's mean) gets none."""
        for key, nbytes in zip(record.out_keys, record.out_bytes):
            if key is not None and key not in self.grad_live and nbytes and key not in record.int_outs \
                    and self.read_until.get(key, -1) > record.idx:
                self.grad_live[key] = self.storage_bytes.get(key, nbytes)
                self.live_bytes += self.grad_live[key]

    def _op_grads(self, record, skip=()) -> OpGrads:
        """The op's inputs needing a gradient from the walk (`skip`: positions whose gradient is a view's own)."""
        info = optable.lookup(record.func)
        passthrough = info is not None and info.grad_passthrough
        ins = [(key, nbytes, rg, position)
               for position, (key, nbytes, rg) in enumerate(zip(record.in_keys, record.in_bytes, record.in_rg))
               if position not in skip]
        # a view (or an in-place op whose grad passes through) of its input's storage: the output's grad is the
        # input's, the same buffer, which lives on to the input's producer (not an accumulation, not freed here)
        same = {key for key, _, rg, _ in ins if rg and key is not None and key in record.out_keys} \
            if passthrough else ()
        # add(a, b) hands one gradient tensor to both inputs (same shape as the output, alpha 1): the first input
        # whose path runs last in backward (the earliest created) holds the buffer, the other aliases it (0 bytes)
        shares = record.grad_alias == "shared" and record.out_bytes and \
            sum(1 for key, nbytes, rg, _ in ins if rg and key is not None and nbytes == record.out_bytes[0]) > 1
        if shares:
            ins.sort(key=lambda item: self.plan.created_in.get(item[0], -1) if item[0] is not None else 0)
        return OpGrads(record, ins, same=same, shares=shares, passthrough=passthrough,
                        grad_view=bool(info is not None and info.grad_view))

    def _accumulate_transient(self, record, key: int) -> None:
        """A gradient added into an existing one: a transient of its size."""
        self._bump(record.node, record.module)
        self.live_bytes += self.storage_bytes[key]
        self._bump(record.node, record.module)
        self.live_bytes -= self.storage_bytes[key]

    def _hand_join_slices(self, op: OpGrads) -> None:
        """cat/stack hand each input a slice of their output's gradient (views, no new buffer): the buffer lives
        until the last slice is consumed, held by the earliest-created input (whose producer runs last). An input
        that is a view with a gradient of its own (`OpRecord.list_members`: a RoPE half, `x[..., :d]`) gets its
        slice there, apart from its storage's."""
        record = op.record
        members = record.list_members or [(key, None) for key in record.list_keys]
        if not (record.grad_alias == "sliced" and record.list_keys and any(record.in_rg) and record.out_keys
                and record.out_keys[0] in self.grad_live
                and not any(key in self.param_keys for key, made in members if made is None)):
            return
        out_key = record.out_keys[0]
        inputs = [(made[0], made) for made in dict.fromkeys(made for _, made in members if made is not None)]
        inputs += [(self.plan.created_in.get(key, -1), key)
                   for key in dict.fromkeys(key for key, made in members if made is None)]
        holds = True  # (the first input in creation order takes the buffer)
        for _, item in sorted(inputs, key=lambda pair: pair[0]):
            if isinstance(item, tuple):
                holds = self._hand_slice_to_view(record, item, holds) and holds
            else:
                holds = self._hand_slice_to_storage(record, item, holds) and holds
        if holds:
            self._drop_grad(out_key)  # every input had a gradient already
        op.ins = [item for item in op.ins if item[0] not in record.list_keys]

    def _hand_slice_to_storage(self, record, key: int, holds: bool) -> bool:
        """A join's slice for a storage's gradient; returns whether the buffer is still to be held."""
        grad_live = self.grad_live
        if key in grad_live:  # accumulated into an existing gradient: a transient of its size
            self._accumulate_transient(record, key)
            return True
        if holds:
            grad_live[key] = grad_live.pop(record.out_keys[0])
            self.shared.replace(record.out_keys[0], key)
        else:
            grad_live[key] = 0
        self.grad_views.add(key)
        if key in self.join_views.get(record.idx, {}):
            self.pending[key] = self.join_views[record.idx][key]
        return not holds

    def _hand_slice_to_view(self, record, made: tuple, holds: bool) -> bool:
        """A join's slice for output `out` of view `view` (`made`); returns whether the buffer is still to be held."""
        view, out = made
        grads = self.view_grads.setdefault(view, {})
        if out in grads:  # added to the one it has, out of place
            self._add_to_view_grad(view, out, record)
            return True
        grads[out] = 0
        if holds:
            out_key = record.out_keys[0]
            heir = self.shared.leave(out_key)
            grads[out] = self.grad_live.pop(out_key)
            if heir is not None:  # the buffer stays counted under another gradient that is it
                self.grad_live[heir] += grads[out]
                grads[out] = 0
        return not holds

    def _join_split_grads(self, record) -> None:
        """split/unbind: backward joins its outputs' gradients (the views' under the storage's key) into a new
        gradient of the input's size, alive with them."""
        key = record.in_keys[0] if record.in_keys else None
        if record.grad_alias != "joined" or key not in self.grad_live or key in self.param_keys:
            return
        self.live_bytes += record.in_bytes[0]
        self._bump(record.node, record.module)
        self._drop_grad(key)
        self.grad_live[key] = record.in_bytes[0]

    def _hand_expanded_sum(self, op: OpGrads) -> None:
        """sum hands its input its own gradient expanded to the input's shape, a view: no new buffer when every
        stride is 0 (the sum made one element, or its gradient was such a view already), and the input is its
        whole storage (a slice's backward makes the storage's gradient whole). Between the storage's maker and the
        sum only views of the whole storage can sit, and those of a tensor whose strides are all 0 are views again;
        a partial sum's expanded gradient is not (a reshape of it copies): counted whole."""
        record, grad_live = op.record, self.grad_live
        if record.grad_alias == "expanded" and record.in_rg and record.in_rg[0] and record.in_keys[0] is not None \
                and record.in_keys[0] not in self.param_keys \
                and record.in_keys[0] not in grad_live and record.out_keys[0] in grad_live \
                and record.call is not None \
                and covers_storage(record.call[1][0], self.storage_bytes.get(record.in_keys[0], 0)) \
                and (record.out_keys[0] in self.grad_expanded
                     or record.out_bytes[0] == record.call[1][0].dtype.itemsize):
            key = record.in_keys[0]
            grad_live[key] = grad_live.pop(record.out_keys[0])
            self.shared.replace(record.out_keys[0], key)
            self._expanded_view(key)
            op.ins = op.ins[1:]

    def _input_grads(self, op: OpGrads) -> None:
        """Each input needing a gradient gets one: the output's handed on (a view, add's shared buffer), a new
        buffer, or an addition into the one it has."""
        record, grad_live = op.record, self.grad_live
        for key, nbytes, needs_grad, position in op.ins:
            if not needs_grad or key is None:
                continue
            if key in op.same:
                if key in op.fresh:  # a copy of the output's gradient (a reshape of a non-contiguous one)
                    self.live_bytes += nbytes
                    op.copied.append((key, nbytes))
                continue
            if op.shares and op.handed_over and nbytes == record.out_bytes[0] and key not in grad_live \
                    and key not in self.param_keys and key not in op.fresh:
                grad_live[key] = 0  # the same buffer the first input got
                if op.handed_to is not None:
                    self.shared.share(op.handed_to, key, self._grad_bytes(op.handed_to))
                if op.handed_expanded:
                    self._expanded_view(key)
                continue
            if key in op.covered:
                continue
            if key in grad_live:
                self._accumulate(op, key, nbytes, position)
                continue
            out_key = record.out_keys[0] if record.out_keys else None
            if op.passthrough and not op.handed_over and out_key in grad_live and key not in op.fresh \
                    and (nbytes <= self._handed_size(record, out_key)
                         or out_key in self.grad_expanded and key not in self.param_keys
                         and (key == record.in_keys[0] or op.shares) and op.grad_view):
                op.handed_expanded = out_key in self.grad_expanded
                handed_view = out_key in self.grad_views
                grad_live[key] = grad_live.pop(out_key)  # the output's grad becomes the input's (a view)
                self.shared.replace(out_key, key)
                op.handed_to = key
                if op.handed_expanded:
                    self._expanded_view(key)
                elif handed_view:
                    self.grad_views.add(key)
                op.handed_over = True
                continue
            grad_live[key] = self.storage_bytes.get(key, nbytes) if key not in self.param_keys else nbytes
            self.live_bytes += grad_live[key]
            op.new_buffers.add(key)
            views = sum(view_bytes for view_key, view_bytes, view_rg, _ in op.ins if view_key == key and view_rg)
            if key not in self.param_keys and views <= grad_live[key]:
                op.covered.add(key)  # views of one storage, together within it: a gradient each, as many bytes

    def _handed_size(self, record, out_key: int) -> int:
        """The size of the output's gradient an op can hand on: its buffer's, or the output's own where it is a view
        of another's buffer (a join's slice, which holds no bytes of its own)."""
        return record.out_bytes[0] if out_key in self.grad_views else self._grad_bytes(out_key)

    def _hands_on(self, record, run) -> bool:
        """Whether the formula hands some input the output's gradient as it is (clone's backward; self's in a
        scatter_reduce sum that includes self, whose source gets a new one), each such input a whole storage: that
        storage's gradient is the output's buffer, handed on."""
        handed = [(position, grad) for position, grad in enumerate(run.grads) if grad is not None and not grad.fresh]
        return bool(handed) and all(covers_storage(record.call[1][position],
                                                   self.storage_bytes.get(record.in_keys[position], 0))
                                    for position, grad in handed)

    def _receive_layouts(self, op: OpGrads, run) -> None:
        """Each input's gradient strides, as the formula lays it out; an expanded view of the output's gradient (a
        partial sum's) that the walk counts whole, as a new buffer, is laid out as a new tensor is (the copy a
        reshape makes of it is the one counted)."""
        record = op.record
        for position, made in enumerate(run.grads):
            if made is None:
                continue
            key, layout = record.in_keys[position], record.in_layouts[position]
            counted_whole = not made.fresh and key in op.new_buffers and layout is not None \
                and any(stride == 0 and size > 1 for stride, size in zip(made.strides, layout.shape))
            self.grad_layouts.receive(key, layout, fresh_strides(layout) if counted_whole else made.strides)
        for (key, _), layout, made in zip(record.list_members, record.list_layouts, run.members):
            if made is not None:  # a join's slice of its gradient
                self.grad_layouts.receive(key, layout, made.strides)

    def _replace_copied(self, op: OpGrads) -> None:
        """A view's copied gradient replaces the one it was copied from under their storage's key (a buffer this
        key held goes; one it shared with another input stays with that one)."""
        for key, nbytes in op.copied:
            if key in self.grad_live:
                self._drop_grad(key)
            self.grad_live[key] = nbytes
            self.grad_views.discard(key)
            self.grad_expanded.discard(key)

    def _accumulate(self, op: OpGrads, key: int, nbytes: int, position: int) -> None:
        """Accumulation: new grad + old grad -> a transient of the new one's size, alive with the formula's other
        gradients and temporaries. Autograd adds it to the old one once the op's backward has released what it
        held, out of place under a dispatch mode (what fxmem.measure runs; without one, into a dense old one in
        place): the sum is a new buffer then, the old and new ones go."""
        record = op.record
        self._bump(record.node, record.module)
        if self._direct_grad(op, key, nbytes, position) or self._hold_for_alias(op, key, nbytes, position):
            return
        if key not in record.out_keys:
            # the new one: nothing of its own where it is a view of the output's gradient (add's, a sum's expanded);
            # the sum: the new one's size where the old one is a view (a join's slice, a sum's expanded gradient:
            # its buffer is held apart), else the old one's
            added = 0 if key in op.views and key not in op.fresh else nbytes
            self.live_bytes += added
            self._bump(record.node, record.module)
            total = nbytes if key in self.grad_views else max(nbytes, self.grad_live[key])
            op.sums.append((position, key, added, total, None))
            self.grad_views.discard(key)
            return
        self.live_bytes += nbytes
        self._bump(record.node, record.module)
        # an in-place op (dropout's scaling mul_) on a slice of a join (stack): its output's gradient is that slice,
        # released below; the input's is a new buffer, as for any in-place op
        self.grad_views.discard(key)
        if key in record.out_keys and written_positions(record.func):
            # in place: the output's gradient goes below, the input's stays (on a view, CopySlices's copy of the
            # whole base's gradient, the view's part written into it)
            op.renewed.append((key, self.storage_bytes.get(key, nbytes) if record.copy_slices else nbytes))
        op.accumulated += nbytes

    def _direct_grad(self, op: OpGrads, key: int, nbytes: int, position: int) -> bool:
        """Whether the gradient this op makes for `key` goes to its producer while `key`'s gradient so far is a
        join's slice waiting at a view's backward (`pending`): the first a new buffer of its own, kept apart until
        then; the next ones added to it out of place."""
        record = op.record
        if self.pending.get(key, record.idx) >= record.idx or key in record.out_keys:
            return False
        return self._hold_apart(op, key, nbytes, position, ("direct", key))

    def _hold_for_alias(self, op: OpGrads, key: int, nbytes: int, position: int) -> bool:
        """Whether the gradient this op makes for parameter `key` goes to a transpose or reshape of it first (an
        autograd node of its own, `OpRecord.alias_inputs`: a linear's `weight.t()`): it waits there, a new buffer,
        and is added to `key`'s at that view's backward, once this op's other new gradients are gone; a second
        reader of the same view adds to the one waiting. (Parameters only: an activation's gradient is its
        storage's in this walk, which its other views' paths meet.)"""
        record = op.record
        alias = record.alias_inputs.get(position)
        if alias is None or key in record.out_keys or key not in self.param_keys:
            return False
        return self._hold_apart(op, key, nbytes, position, ("alias", alias))

    def _hold_apart(self, op: OpGrads, key: int, nbytes: int, position: int, holder: tuple) -> bool:
        """Whether the gradient this op makes for `key` is kept apart under `holder` (`held`): the first a new
        buffer, the next ones added to it out of place once the op returns (`_add_sums`); a view of the output's
        gradient with nothing held yet is not kept apart."""
        added = 0 if key in op.views and key not in op.fresh else nbytes
        if holder in self.held:
            self.live_bytes += added
            op.sums.append((position, key, added, max(nbytes, self.held[holder][1]), holder))
            return True
        if not added:
            return False
        self.live_bytes += nbytes
        self._bump(op.record.node, op.record.module)
        self.held[holder] = (key, nbytes)
        return True

    def _add_alias_grad(self, record) -> int:
        """At the backward of a transpose or reshape holding a gradient for its input (`_hold_for_alias`): added to
        the one the input has, out of place; the old one and the held one go. Returns the live bytes at the sum."""
        held = self.held.pop(("alias", record.idx), None)
        if held is None:
            return self.live_bytes
        key, nbytes = held
        if key not in self.grad_live:  # (the other gradient went meanwhile: the held one is the input's)
            self.grad_live[key] = nbytes
            return self.live_bytes
        total = nbytes if key in self.grad_views else max(nbytes, self.grad_live[key])
        return self._add_held(record, key, nbytes, total)

    def _add_pending(self, record) -> int:
        """At the backward of a view a join read: the slice it hands its storage's producer is added to the gradient
        other ops made that storage meanwhile (held apart, `_direct_grad`), out of place; both go. Returns the live
        bytes at the sum."""
        key = record.in_keys[0] if record.in_keys else None
        if key is None or self.pending.get(key) != record.idx:
            return self.live_bytes
        del self.pending[key]
        if ("direct", key) not in self.held:
            return self.live_bytes
        _, direct = self.held.pop(("direct", key))
        return self._add_held(record, key, direct, direct)

    def _add_held(self, record, key: int, held: int, total: int) -> int:
        """A gradient of `held` bytes kept apart from `key`'s is added to it out of place, a sum of `total` bytes: the
        old one and the held one go. Returns the live bytes at the sum."""
        self.live_bytes += total
        self._bump(record.node, record.module)
        high = self.live_bytes
        self._drop_grad(key)
        self.live_bytes -= held
        self.grad_live[key] = total
        self.grad_views.discard(key)
        return high

    def _add_sums(self, op: OpGrads, node_peak: int) -> int:
        """Each gradient this op made for an input that has one already is added to that one, in the order of the
        op's inputs (the engine's): the sum is a new buffer and the old gradient goes at once (a join's slice with
        the join's buffer when this input held it: the slices of inputs created later were consumed before, their
        producers ran first); the new gradients stay until all are handed on (the engine holds the op's outputs
        until then). Returns the node's peak with them."""
        sums = [(position, (key, total, into), None) for position, key, _, total, into in op.sums]
        sums += [(position, None, (view, out)) for position, view, out, _ in op.view_sums]
        for _, grad_sum, view_sum in sorted(sums, key=lambda item: item[0]):
            if view_sum is not None:
                node_peak = max(node_peak, self._add_to_view_grad(*view_sum, op.record))
                continue
            key, total, into = grad_sum
            self.live_bytes += total
            self._bump(op.record.node, op.record.module)
            node_peak = max(node_peak, self.live_bytes)
            if into is not None:  # (a gradient kept apart from the storage's, `_hold_apart`)
                self.live_bytes -= self.held[into][1]
                self.held[into] = (key, total)
            else:
                self._drop_grad(key)
                self.grad_live[key] = total
        self.live_bytes -= sum(item[2] for item in op.sums) + sum(item[3] for item in op.view_sums)
        return node_peak
