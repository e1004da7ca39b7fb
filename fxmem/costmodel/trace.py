"""The forward trace: every dispatch-level op of a forward (and its loss) under fake tensors, with storages.

`trace_forward` runs the program under FakeTensorMode with a dispatch recorder: per op its input and output
storages, their bytes, what autograd saves for backward (from the op table `fxmem.ops`), its FLOPs, the graph node
and region that issued it, and how fxmem.nn.recast recipes stand in for saved tensors. No real memory is used. The
static estimate, the node costs and the checkpoint planner all read this one `ForwardTrace`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .. import ops as optable
from ..fake import (meta_as_device, module_tensors, propagating_real_values, run_on_real_values, sizing_device,
                    static_sizes_if_needed, with_data_dependent_fallback)
from ..kernel_layouts import CpuKernelLayouts
from ..nn.recast import installed as recast_installed, nested_recipes, scope_for as recast_scope
from ..ops import written_positions
from ..program import Program, buffers_kept
from ..step import compute_loss
from .formula import call_signature, formula_run
from .grad_leaves import reached_leaves
from .measured_saves import measured_held, measured_slots
from .grad_layouts import layout_of
from .recording_interpreter import RecordingInterpreter
from .storage_keys import StorageKeys


@dataclass
class OpRecord:
    idx: int
    func: Any
    node: str
    module: str
    in_keys: list  # per positional arg: storage key or None
    in_bytes: list  # per positional arg: tensor bytes (numel * itemsize)
    in_rg: list
    out_keys: list
    out_bytes: list
    out_rg: bool
    new_keys: list  # storages this op created
    flops: int
    region: str | None
    known: bool = True
    saves_measured: bool = False  # not in the op table: what it saves was measured (`measured_saves`)
    saved: list = field(default_factory=list)  # storage keys saved for backward
    held: list = field(default_factory=list)  # of those, kept on the op's autograd context: alive until the step ends
    list_keys: list = field(default_factory=list)  # storages of tensors passed inside list args (cat, stack) or
    # by keyword
    recast: list = field(default_factory=list)  # saved parameter casts that backward recasts (fxmem.nn.recast)
    grad_alias: str = ""  # the op table's grad_alias for this call ("shared" when add's alpha is 1, "expanded" when
    # sum keeps the input's dtype)
    int_outs: list = field(default_factory=list)  # storages of integer/bool outputs (max pooling's indices): no grad
    step: int = 0  # the graph node (of the program, or of a region's body) whose run issued the op
    # the tensors of the node's value this record made (it is the last of the node's records to make them): their
    # path in the value -> their storage key; () for a node returning one tensor (a group norm's output, not the
    # statistics its composite detaches after it), (0,), (1, 0) for an LSTM's output and h (`value_key`)
    values_made: dict = field(default_factory=dict)
    call: Any = None  # the call as `call_signature` freezes it (ops with a backward), for `formula_temps`
    # an in-place op on a view (relu_ on a linear's 3-D output, a view of its addmm's): autograd's CopySlices runs
    # its backward, which copies the base's gradient whole and clones the view's slice of it before the op's formula
    # runs: those bytes, held with the formula's
    copy_slices: int = 0
    # where each positional tensor argument and each output lies in its storage (`TensorLayout`, None for others):
    # with the storage keys, which tensor a gradient belongs to (`fxmem.costmodel.grad_layouts`)
    in_layouts: list = field(default_factory=list)
    out_layouts: list = field(default_factory=list)
    # positional input -> (the record of the view that made that very tensor, which of its outputs it is), for
    # views whose backward makes a new buffer (`fxmem.ops.view_grad_is_new`: select, slice, split): its gradient is
    # its own until that view's backward
    view_inputs: dict = field(default_factory=dict)
    # a transpose or reshape of such a view: its consumers' gradients go to that view's gradient (`view_inputs`),
    # its own backward hands nothing on
    routes_grads: bool = False
    # positional input -> the record of the transpose or reshape that made that very tensor: autograd node of its
    # own, whose backward hands the gradient on (and adds it to one its input has)
    alias_inputs: dict = field(default_factory=dict)
    # per tensor of a list argument (cat, stack), in order: (its storage key, the view record and output that made
    # it when that view's backward makes a new buffer, else None), and where it lies in its storage
    list_members: list = field(default_factory=list)
    list_layouts: list = field(default_factory=list)

    def written_keys(self) -> list[int]:
        """The storages the op writes in place (relu_'s input, an out= tensor), from its schema."""
        return [self.in_keys[i] for i in written_positions(self.func)
                if i < len(self.in_keys) and self.in_keys[i] is not None]


class DispatchRecorder(TorchDispatchMode):
    """Records every dispatch-level op with storage identities (fake storages: no real memory)."""

    def __init__(self):
        super().__init__()
        self.records: list[OpRecord] = []
        self.node = "<input>"
        # counts graph nodes run: a node's values stay referenced until it returns (a composite like matmul
        # holds its inputs over all the ops it dispatches), then the graph drops those it no longer needs
        self.step = 0
        self.step_each = False  # outside a graph (the loss function): each op a step of its own
        self.module = ""
        self.region: str | None = None
        self.storage_bytes: dict[int, int] = {}
        self.storages = StorageKeys(lambda: len(self.records) - 1)  # storage -> key, and when each was freed
        self.grad_enabled = True
        self.recast_node = False  # the current node is fxmem.nn.recast.cast_param
        self.recast_keys: set[int] = set()  # storages cast_param created (not saved when the module recasts)
        self.recast_enabled = False  # the traced module runs under fxmem.nn.recast's scope
        # recipe output storage -> storages its recipe holds (its tensor arguments, through nested recipes): a
        # record that saves the recipe instead of the output keeps those alive (free only inside regions)
        self.recipe_holds: dict[int, list[int]] = {}
        self.recipe_at: dict[int, str] = {}  # recipe output storage -> the node that registered the recipe
        self.recipe_of: dict[int, object] = {}  # recipe output storage -> the recipe (an in-place op replaces it)
        # recipe output storages recomputed once for all their saves (held from the first unpack to the last)
        self.recipe_shared: set[int] = set()
        # nesting a pass plans without tracing it (`as_recipes`): recipe output -> {holder's output: whether the
        # holder uses it through its shared value}
        self.planned_nesting: dict[int, dict[int, bool]] = {}
        self.unknown_saves: list = []  # (record, its keyword tensors' storages) of ops the table does not know
        # recipe outputs made by one shared run of a multi-output op (a max pooling's output and indices) -> a
        # group id: held together from the group's first unpack to its last
        self.recipe_group: dict[int, int] = {}
        self.loss_key: int | None = None  # the loss's storage (train mode): backward runs from there
        self.deferred: list = []  # (record, func, args, kwargs, outputs) of ops `settle_deferred` decides on
        self.settled: list = []  # records it gave a backward, for `confirm_settled`
        self.node_held: list = []  # storages the current graph node's ops save (`_hold_saved`)
        # tensor -> (the record of the view (`view_grad_is_new`) that made it, which of its outputs it is)
        self.view_made = WeakIdKeyDictionary()
        self.alias_made = WeakIdKeyDictionary()  # a transpose's or reshape's output -> its record

    def key(self, tensor) -> tuple[int, bool]:
        """(the tensor's storage key, whether this is the first time the storage is seen)."""
        storage = tensor.untyped_storage()
        key, new = self.storages.key(storage)
        if new:
            self.storage_bytes[key] = int(storage.nbytes())
        return key, new

    def recipe_holders(self) -> dict[int, list[int]]:
        """Recipe output storage -> the recipe outputs whose recipes hold it as a nested recipe (a U-Net cat's
        recipe holds its upsampling convolution's)."""
        return {key: list(holders) for key, holders in self.nesting().items()}

    def nesting(self) -> dict[int, dict[int, bool]]:
        """Recipe output storage -> {output of a recipe holding it nested: whether that recipe uses it through its
        shared value (a max pooling's recipes, recomputed right next to its input's own saves)}: as traced, with
        what a pass planned (`planned_nesting`)."""
        key_of = {id(recipe): key for key, recipe in self.recipe_of.items()}
        out: dict[int, dict[int, bool]] = {}

        def walk(recipe, holder: int) -> None:
            for shared in (False, True):
                for inner in nested_recipes(recipe, shared):
                    if id(inner) in key_of:
                        out.setdefault(key_of[id(inner)], {})[holder] = shared
                    else:  # no output of its own (a chain member an in-place op replaced, a group's shared run):
                        walk(inner, holder)  # recomputed with the holder, what it holds is used by its recomputations
        for key, recipe in self.recipe_of.items():
            walk(recipe, key)
        for key, holders in self.planned_nesting.items():
            out.setdefault(key, {}).update(holders)
        return out

    def copy_slices_bytes(self, func, args) -> int:
        """What autograd's CopySlices holds in the backward of an in-place op writing views that need a gradient:
        the base's gradient copied (its storage's bytes) and the view's slice cloned."""
        total = 0
        for position in written_positions(func):
            arg = args[position] if position < len(args) else None
            if isinstance(arg, torch.Tensor) and arg.requires_grad and arg._is_view():
                total += self.storage_bytes[self.key(arg)[0]] + int(arg.numel()) * arg.element_size()
        return total

    def save_original_copy(self, record: OpRecord, results: set) -> None:
        """An in-place op whose backward reads its input's value from before the write (clamp_, silu_, pow_) saves
        the copy autograd makes of it first (`original_self`: a clone dispatched just before it, in the same node):
        the op saves that copy in the input's place, and the copy has no backward of its own. The storage it writes
        stays saved only where the formula reads the result too (`results`, the keys of its output slots:
        scatter_reduce_ saves both)."""
        written = set(record.written_keys())
        for earlier in reversed(self.records):
            if earlier.step != record.step:
                return
            if earlier.func is torch.ops.aten.clone.default and earlier.new_keys and earlier.in_keys[0] in written:
                earlier.out_rg, earlier.call, earlier.saved = False, None, []
                original = earlier.in_keys[0]
                record.saved = [key for key in record.saved if key != original] + \
                    ([original] if original in results else []) + [earlier.out_keys[0]]
                return

    def hold_recipe_args(self, record: OpRecord) -> None:
        for key in record.recast:
            for held in self.recipe_holds.get(key, ()):
                if held not in record.saved:
                    record.saved.append(held)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            out = run_on_real_values(func, args, kwargs)
        in_keys, in_bytes, in_rg, list_keys = self._inputs(args)
        # tensors passed by keyword (SDPA's attn_mask on CPU) are read too: held to here, like list members
        list_keys.extend(self.key(value)[0] for value in kwargs.values() if isinstance(value, torch.Tensor))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if self.step_each:
            self.step += 1
        out_keys, out_bytes, new_keys, int_outs = self._outputs(outs)
        float_out = any(key is not None and key not in int_outs for key in out_keys)
        out_rg = self.grad_enabled and torch.is_grad_enabled() and float_out and any(in_rg) and \
            not optable.grad_free(func)
        record = OpRecord(len(self.records), func, self.node, self.module, in_keys, in_bytes, in_rg, out_keys,
                          out_bytes, out_rg, new_keys, optable.flops(func, args, out), self.region,
                          list_keys=list_keys, int_outs=int_outs, step=self.step,
                          in_layouts=[layout_of(arg) if isinstance(arg, torch.Tensor) else None for arg in args],
                          out_layouts=[layout_of(o) if isinstance(o, torch.Tensor) else None for o in outs])
        self.forget_written_recipes(record)
        if out_rg:
            self._record_saves(record, func, args, kwargs)
            self._record_grad_alias(record, func, args, kwargs)
            self._record_views(record, func, args, outs)
            self._hold_saved(record, (*args, *kwargs.values(), *outs))
        elif self.grad_enabled and any(in_rg) and _below_autograd(func):
            # an op outside the table run with grad off on inputs needing grad: a custom op whose autograd formula
            # runs it below autograd (the table's custom ops too), or an op inside a custom autograd Function's
            # forward (`settle_deferred`).
            # (Without a backward anywhere, in inference, an op costs its outputs alone, which are tracked: never
            # unknown.)
            record.known = False
            if float_out:  # (held to the node's end: its arguments too, for what it saves)
                self.deferred.append((record, func, args, kwargs, outs))
        self.records.append(record)
        return out

    def forget_written_recipes(self, record: OpRecord) -> None:
        """A recipe's output written in place (through any view) is saved as a tensor from then on: the recipe
        would give the old values, and fxmem.nn.recast checks the output's version when packing. (A node that
        registers the written storage as a recipe again, an in-place remat_call, makes it one after the op.)"""
        for key in record.written_keys():
            if key in self.recipe_of:
                self.recast_keys.discard(key)

    def settle_deferred(self) -> None:
        """The ops outside the table run with grad off on inputs needing grad (`deferred`), once the graph node that
        ran them returned: one whose output autograd then gave a backward (a custom op with a registered autograd
        formula: transformers' grouped_mm fallback for mixture-of-experts layers) has one, and what it saves and
        its formula holds are measured on fakes, as for any op outside the table. The others (ops inside a custom
        autograd Function's forward, whose backward this trace cannot see) stay unknown."""
        for record, func, args, kwargs, outs in self.deferred:
            if any(isinstance(out, torch.Tensor) and out.requires_grad for out in outs):
                record.out_rg = True
                self._record_saves(record, func, args, kwargs)
                self._record_grad_alias(record, func, args, kwargs)
                self._record_views(record, func, args, outs)
                self._hold_saved(record, (*args, *kwargs.values(), *outs))
                self.settled.append(record)
        self.deferred = []

    def _hold_saved(self, record: OpRecord, tensors) -> None:
        """The storages `record` saves stay until its graph node returns (`node_held`): the node's recipes are told
        apart by storage then, and a recipe's output autograd no longer holds (max pooling's indices, saved as the
        recipe) would be gone."""
        saved = set(record.saved)
        self.node_held.extend(tensor.untyped_storage() for tensor in tensors
                              if isinstance(tensor, torch.Tensor) and self.key(tensor)[0] in saved)

    def confirm_settled(self) -> None:
        """After the trace (the measuring runs need no recorder above them): an op `settle_deferred` gave a
        backward whose own formula, run on fakes, makes no gradient (an op without an autograd formula of its own,
        inside a custom autograd Function's forward) has none this trace can see after all: unknown again."""
        for record in self.settled:
            masks = (True,) * len(record.out_keys)
            if record.call is None or not any(made is not None for made in formula_run(record.call, masks).grads):
                record.out_rg, record.known, record.saved = False, False, []
                self.unknown_saves = [(saver, kw) for saver, kw in self.unknown_saves if saver is not record]
        self.settled = []

    def _inputs(self, args) -> tuple[list, list, list, list]:
        """(storage key, bytes, requires grad) per positional argument, and the storages inside list arguments."""
        in_keys, in_bytes, in_rg, list_keys = [], [], [], []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                key, _ = self.key(arg)
                in_keys.append(key)
                in_bytes.append(int(arg.numel()) * arg.element_size())
                in_rg.append(bool(arg.requires_grad))
            elif isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
                # e.g. cat/stack: treat the list as one argument; keep the first as representative
                keys = [self.key(tensor)[0] for tensor in arg]
                list_keys.extend(keys)
                in_keys.append(keys[0])
                in_bytes.append(sum(int(tensor.numel()) * tensor.element_size() for tensor in arg))
                in_rg.append(any(tensor.requires_grad for tensor in arg))
            else:
                in_keys.append(None)
                in_bytes.append(0)
                in_rg.append(False)
        return in_keys, in_bytes, in_rg, list_keys

    def _outputs(self, outs) -> tuple[list, list, list, list]:
        """(storage key, bytes) per output, the storages new here, and the integer/bool outputs' storages."""
        out_keys, out_bytes, new_keys, int_outs = [], [], [], []
        for tensor in outs:
            if isinstance(tensor, torch.Tensor):
                key, new = self.key(tensor)
                out_keys.append(key)
                out_bytes.append(int(tensor.numel()) * tensor.element_size())
                if not (tensor.is_floating_point() or tensor.is_complex()):
                    int_outs.append(key)
                if new:
                    new_keys.append(key)
                    if self.recast_node:
                        self.recast_keys.add(key)
            else:
                out_keys.append(None)
                out_bytes.append(0)
        return out_keys, out_bytes, new_keys, int_outs

    def _record_saves(self, record: OpRecord, func, args, kwargs) -> None:
        """What an op with a backward saves (the op table's slots), its call signature and CopySlices bytes."""
        # (an in-place op's backward holds what its out-of-place variant's formula holds)
        record.call = call_signature(optable.functional_variant(func) or func, args, kwargs)
        record.copy_slices = self.copy_slices_bytes(func, args)
        ctx = optable.SaveCtx(tuple(args), kwargs, tuple(record.in_rg))
        slots, record.known = optable.saved(func, ctx)
        kw_keys = {name: self.key(value)[0] for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        record.saved.extend(self._slot_keys(record, slots, kw_keys))
        record.saved.extend(self.key(tensor)[0] for kind, position in slots if kind == "list"
                            for tensor in _list_tensors(args, position))
        if not record.known:
            self.unknown_saves.append((record, kw_keys))
        if written_positions(func):
            self.save_original_copy(record, {record.out_keys[i] for kind, i in slots if kind == "out"})
        if self.recast_enabled and self.recast_keys and self.region is None:
            # casts of parameters/inputs are saved as their source and cast again in backward; inside a
            # region the region's own hooks decide (checkpoint recomputes, offload moves them)
            record.recast = [key for key in record.saved if key in self.recast_keys]
            record.saved = [key for key in record.saved if key not in self.recast_keys]
            self.hold_recipe_args(record)

    def _record_views(self, record: OpRecord, func, args, outs) -> None:
        """Which inputs are views whose backward makes a new buffer (`OpRecord.view_inputs`), or transposes and
        reshapes with an autograd node of their own (`OpRecord.alias_inputs`), and the outputs that are such."""
        record.view_inputs = {position: self.view_made[arg] for position, arg in enumerate(args)
                              if isinstance(arg, torch.Tensor) and arg in self.view_made}
        record.alias_inputs = {position: self.alias_made[arg] for position, arg in enumerate(args)
                               if isinstance(arg, torch.Tensor) and arg in self.alias_made}
        members = [tensor for position in range(len(args)) for tensor in _list_tensors(args, position)]
        record.list_members = [(self.key(tensor)[0], self.view_made.get(tensor)) for tensor in members]
        record.list_layouts = [layout_of(tensor) for tensor in members]
        tensors = [out for out in outs if isinstance(out, torch.Tensor)]
        if optable.view_grad_is_new(func):
            self.view_made.update({out: (record.idx, position) for position, out in enumerate(outs)
                                   if isinstance(out, torch.Tensor)})
        elif not optable.view_grad_is_a_view(func):
            return
        elif 0 in record.view_inputs:
            # a transpose or reshape of such a view: its gradient is that view's, seen through it (one buffer)
            record.routes_grads = True
            self.view_made.update(dict.fromkeys(tensors, record.view_inputs[0]))
        else:
            self.alias_made.update(dict.fromkeys(tensors, record.idx))

    @staticmethod
    def _slot_keys(record: OpRecord, slots, kw_keys: dict) -> list:
        """The storages the slots (`fxmem.ops.Saved`) name in this record."""
        saved = []
        for kind, position in slots:
            if kind == "list":
                continue  # (`_record_saves` takes the list's tensors)
            keys = kw_keys if kind == "kw" else dict(enumerate(record.in_keys if kind == "in" else record.out_keys))
            if keys.get(position) is not None:
                saved.append(keys[position])
        return saved

    def measure_unknown_saves(self) -> None:
        """Ops the table does not know: what they save is measured (`measured_saves`, after the trace: autograd,
        which saves, does not run inside dispatch) in place of the default guess, and they count as known. Saves
        rewritten as recasts or recipes stay so (the measured saves must hold them); not where an in-place op's
        original copy was saved."""
        for record, kw_keys in self.unknown_saves:
            slots = measured_slots(record.call)
            if slots is None or written_positions(record.func):
                continue
            keys = self._slot_keys(record, slots, kw_keys)
            if not set(record.recast) <= set(keys):
                continue
            record.held = [key for key in self._slot_keys(record, measured_held(record.call), kw_keys)
                           if key not in keys]
            record.saved = [key for key in keys if key not in record.recast] + record.held
            record.known = record.saves_measured = True
        self.unknown_saves = []

    @staticmethod
    def _record_grad_alias(record: OpRecord, func, args, kwargs) -> None:
        info = optable.lookup(func)
        if info is None:
            record.known = False
        elif info.grad_alias == "shared":
            record.grad_alias = info.grad_alias if kwargs.get("alpha", 1) == 1 else ""
        elif info.grad_alias == "expanded":
            same_dtype = kwargs.get("dtype") in (None, getattr(args[0], "dtype", None))
            record.grad_alias = info.grad_alias if same_dtype else ""
        elif info.grad_alias:
            record.grad_alias = info.grad_alias


def _list_tensors(args, position: int) -> list:
    """The tensors inside positional list argument `position` (cat's, index's; None where index takes a whole dim),
    none when that argument is not a list."""
    arg = args[position] if position < len(args) else None
    return [tensor for tensor in arg if isinstance(tensor, torch.Tensor)] if isinstance(arg, (list, tuple)) else []


@dataclass(frozen=True)
class ForwardTrace:
    """What `trace_forward` recorded: the recorder (its `records`, `storage_bytes`, recipes), the storages that
    exist before the step ({key: "param" | "buffer" | "input"}), the storages the step hands back (outputs, and
    the loss in train mode), the traced module's parameters, and those of them the loss's backward gives a
    gradient (`trained`, train mode: `grad_leaves`; the optimizer keeps state for these alone)."""
    recorder: DispatchRecorder
    base_keys: dict
    out_keys: set
    params: list
    trained: list


def trace_forward(program: Program, args, kwargs, mode: str, loss_fn=None) -> ForwardTrace:
    """Run forward (+ loss in train mode) under FakeTensorMode, recording dispatch-level ops. Sizes that depend on
    tensor values are taken from the example inputs (see `fxmem.fake.with_data_dependent_fallback`)."""
    return with_data_dependent_fallback(lambda: static_sizes_if_needed(
        lambda static: _trace_forward(program, args, kwargs, mode, loss_fn, static)))


class _SharedFakes:
    """One FakeTensorMode kept across traces with the fakes it made of parameters, buffers and tensor attributes:
    a pass traces its program several times (snapshots share parameters), and converting a tensor is a sizeable
    part of a trace. A tensor whose type, dtype, device, shape, strides, storage or requires_grad changed since its
    fake was made (a pass cast or replaced it) starts a fresh mode. Not used when fakes must carry real values (the
    data-dependent fallback).

    The fakes kept have static sizes, as the ones a trace's ops make of real tensors do (only inputs' sizes are
    symbolic): a fake made with the mode's shape env would carry a fresh symbol per size, and the next trace's
    broadcasts would hand such a size to kernels that take only concrete ones (a (4, 8) weight times a
    (b, t, 4, 8) activation: "SymIntArrayRef expected to contain only concrete integers", every second trace).
    Example inputs are not kept: each trace makes their fakes at the sizes it asks for."""

    def __init__(self):
        self.mode: FakeTensorMode | None = None
        self.fakes = WeakIdKeyDictionary()  # real tensor -> (signature, fake)

    @staticmethod
    def signature(tensor: torch.Tensor) -> tuple:
        return (type(tensor), tensor.dtype, tensor.device, tuple(tensor.shape), tensor.stride(),
                tensor.storage_offset(), tensor.requires_grad, tensor.untyped_storage()._cdata)

    def mode_for(self, tensors: list) -> FakeTensorMode:
        if propagating_real_values():
            return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        stale = self.mode is None or any(
            (entry := self.fakes.get(t)) is not None and entry[0] != self.signature(t) for t in tensors)
        if stale:
            self.mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
            self.fakes = WeakIdKeyDictionary()
        return self.mode

    def keep(self, mode: FakeTensorMode, tensors: list) -> None:
        """Hold the fakes of `tensors` (the mode's memo holds them weakly only)."""
        if mode is not self.mode:
            return
        for tensor in tensors:
            if tensor not in self.fakes:
                self.fakes[tensor] = (self.signature(tensor), mode.from_tensor(tensor, static_shapes=True))

    def drop(self) -> None:
        self.mode, self.fakes = None, WeakIdKeyDictionary()


_SHARED_FAKES = _SharedFakes()


def _trace_forward(program: Program, args, kwargs, mode: str, loss_fn=None,
                   static_inputs: bool = False) -> ForwardTrace:
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    state = _reals(module_tensors(program.module))
    reals = _reals(state + [x for x in flat if isinstance(x, torch.Tensor)])
    fake_mode = _SHARED_FAKES.mode_for(reals)
    on_device = meta_as_device(fake_mode, reals, sizing_device(flat))
    try:
        with buffers_kept(program.module):  # in-place ops on real buffers alone run for real under the fake mode
            out = _trace_forward_in(fake_mode, program, flat, (args, kwargs), mode, loss_fn, static_inputs)
    except BaseException:
        _SHARED_FAKES.drop()  # a failed trace may leave unbacked symbols in the mode's shape env
        raise
    _SHARED_FAKES.keep(fake_mode, state)
    del on_device  # (held until the trace's fakes are kept)
    return out


def _reals(tensors: list) -> list:
    """`tensors` that are not fakes, each once."""
    return list({id(t): t for t in tensors if not isinstance(t, FakeTensor)}.values())


def _trace_forward_in(fake_mode, program: Program, flat, inputs: tuple, mode: str, loss_fn=None,
                      static_inputs: bool = False) -> ForwardTrace:
    """The trace in `fake_mode`; `flat` are `inputs` (args, kwargs) flattened."""
    module = program.module
    with fake_mode:
        fake_flat = [fake_mode.from_tensor(x, static_shapes=static_inputs) if isinstance(x, torch.Tensor) else x
                     for x in flat]
    recorder = DispatchRecorder()
    recorder.grad_enabled = mode == "train"
    recorder.recast_enabled = recast_installed(module)
    was_training = module.training
    trained = []  # (train mode: the parameters the loss's backward reaches)
    module.train(mode == "train")
    grad_ctx = torch.enable_grad() if mode == "train" else torch.no_grad()
    try:
        with fake_mode, grad_ctx:
            params = list(module.parameters())
            base_keys, state_storages = _base_keys(recorder, fake_mode, params + list(module.buffers()), fake_flat)
            # the CPU kernels' output layouts below the recorder (a reshape copies where the real run's does), and
            # what the module's forward hooks enter (recipes register there)
            with CpuKernelLayouts(), recorder, recast_scope(module):
                out_flat = RecordingInterpreter(module, recorder).run(*fake_flat, enable_io_processing=False)
                output = module.graph.process_outputs(out_flat)
                out_keys = {recorder.key(t)[0] for t in pytree.tree_leaves(out_flat) if isinstance(t, torch.Tensor)}
                if mode == "train":
                    recorder.node, recorder.module, recorder.step_each = "loss", "", True
                    args, kwargs = inputs
                    fake_args = pytree.tree_unflatten(fake_flat, pytree.tree_flatten((tuple(args), dict(kwargs)))[1])
                    loss = compute_loss(loss_fn, output, fake_args[0], fake_args[1])
                    recorder.settle_deferred()
                    recorder.node_held = []
                    recorder.loss_key = recorder.key(loss)[0]
                    out_keys.add(recorder.loss_key)
                    trained = _trained(recorder, params, state_storages, loss)
    finally:
        recorder.storages.stop()
        module.train(was_training)
    del state_storages  # (held until the trace was over)
    recorder.confirm_settled()
    recorder.measure_unknown_saves()
    return ForwardTrace(recorder, base_keys, out_keys, params, trained)


def _base_keys(recorder: DispatchRecorder, fake_mode, state: list, fake_flat: list) -> tuple[dict, list]:
    """Parameters, buffers and inputs first, so they are known storages (the baseline): (storage key -> "param" |
    "buffer" | "input", the storages of the parameters' and buffers' fakes in the order of `state`, to hold while
    the trace runs: not the fakes, whose lifetime decides which fake later uses of a buffer get: HF Llama's
    rotary `inv_freq` fails to multiply under symbolic sizes when this one is held)."""
    recorder.node = "<params>"
    base_keys = {}
    storages = []
    for tensor in state:
        # the fake mode memoizes conversions to this storage while it lives: every use of this parameter sees it
        fake = fake_mode.from_tensor(tensor)
        storages.append(fake.untyped_storage())
        key = recorder.key(fake)[0]
        base_keys[key] = "param" if isinstance(tensor, nn.Parameter) else "buffer"
        if not isinstance(tensor, FakeTensor):
            recorder.storages.alias(tensor.untyped_storage(), key)
    for tensor in fake_flat:
        if isinstance(tensor, torch.Tensor):
            base_keys.setdefault(recorder.key(tensor)[0], "input")
    return base_keys, storages


def _trained(recorder: DispatchRecorder, params: list, storages: list, loss) -> list:
    """The parameters (of `params`, whose fakes' storages `storages` starts with) whose storage the loss's
    backward accumulates a gradient into (`reached_leaves`)."""
    reached = {recorder.key(leaf)[0] for leaf in reached_leaves(loss)}
    return [param for param, storage in zip(params, storages) if param.requires_grad
            and recorder.storages.key(storage)[0] in reached]


def cached_per_trace(recorder: DispatchRecorder, name: str, make):
    """`make()` once per trace, kept on its recorder under `name` (a copy of the recorder with other records, as
    `as_recipes` makes, gets its own)."""
    hit = recorder.__dict__.get(name)
    if hit is None or hit[0] is not recorder.records:
        hit = recorder.__dict__[name] = (recorder.records, make())
    return hit[1]


def _below_autograd(func) -> bool:
    """`func` may be a custom op run below its autograd formula: outside the op table, or one of the table's custom
    ops (`fxmem.ops.OpInfo.custom_autograd`)."""
    info = optable.lookup(func)
    return info is None or info.custom_autograd
