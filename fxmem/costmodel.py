"""The memory cost model: how much memory each part of the graph costs, and when. One place for all of it.

Two methods, same result type (`MemoryEstimate`):

- `static`: runs the forward graph under FakeTensorMode to learn every dispatch-level op's shapes, dtypes and
  storage aliasing (no real memory), then applies the op table (`fxmem.ops`) for what autograd saves, and walks a
  liveness model of forward, backward and the optimizer step. What a backward formula holds above the gradients
  it makes comes from running that one formula on fake tensors, once per call signature (`formula_temps`). Works
  for models far bigger than RAM.
- `traced`: runs the real training step (forward, loss, backward, optimizer) under FakeTensorMode with the same
  storage tracker `fxmem.measure` uses: an exact simulated timeline, still without real memory.

Regions that passes insert (checkpoint, offload) declare themselves through `fxmem.nn.regions.RegionInfo`; the
static walk models them (recompute in backward, off-device while offloaded).

Before any region exists, the checkpoint pass plans with this model too ("checkpoint plans" below): what recomputing
each candidate region would free and cost, each recomputation's spike, and a plan's peak, from the same forward
trace and static timeline (`measure_regions`, `build_region_model`, `RegionModel`).
"""
from __future__ import annotations

import bisect
import copy
import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv, optimization_hint
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from . import ops as optable
from .ops import written_positions
from .measure import StorageTracker, TimelinePoint, backward_label
from .nn.checkpoint import DRAW_OPS
from .nn.dropout import bool_mask_dropout, bool_mask_dropout_remat
from .nn.recast import active_scope as recast_active, aside as recast_aside, cast_param, \
    group_of, installed as recast_installed, nested_recipes, recipe_tensors, scope_for as recast_scope
from .nn.regions import names_op, region_info
from .outline import region_boundary
from .program import Program, buffers_kept, deep_copy, module_path
from .step import OPTIMIZERS, compute_loss, make_torch_optimizer
from .userstate import keeps_model_state

# bitsandbytes 8-bit optimizers keep 32-bit state for tensors smaller than this (bnb's min_8bit_size)
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256


@dataclass
class MemoryEstimate:
    """Bytes of one steady-state step (training) or one forward (inference)."""
    params: int = 0
    buffers: int = 0
    grads: int = 0
    optimizer_state: int = 0
    inputs: int = 0
    activations: int = 0  # saved for backward (plus outputs) at the end of forward
    peak: int = 0
    peak_phase: str = ""
    peak_at: str = ""  # node (forward) or node's backward where the peak occurs
    peak_module: str = ""
    timeline: list = field(default_factory=list)  # TimelinePoint per node: forward, then backward
    unknown_ops: list = field(default_factory=list)
    by_module: list = field(default_factory=list)  # [(module path, bytes saved for backward)] heaviest first
    flops_forward: int = 0
    flops_backward: int = 0
    mode: str = "train"
    optimizer: str = "adamw"
    method: str = "static"
    device: str = "cpu"
    world_size: int = 1
    zero_stage: int = 0
    notes: list = field(default_factory=list)
    program_key: str = ""  # program_key() of the program estimated (not in to_dict: reports stay the same)

    def to_dict(self) -> dict:
        keys = ("method", "mode", "optimizer", "device", "params", "buffers", "grads", "optimizer_state",
                "inputs", "activations", "peak", "peak_phase", "peak_at", "peak_module", "flops_forward",
                "flops_backward", "world_size", "zero_stage")
        d = {k: getattr(self, k) for k in keys}
        d["timeline"] = [p.to_dict() for p in self.timeline]
        d["unknown_ops"] = list(self.unknown_ops)
        d["by_module"] = [{"module": m, "bytes": b} for m, b in self.by_module]
        d["notes"] = list(self.notes)
        return d


# ============================================================================================ entry points

@keeps_model_state
def estimate(model_or_program, args=(), kwargs=None, *, mode: str | None = None, optimizer: str = "adamw",
             method: str = "static", world_size: int = 1, zero_stage: int = 0, loss_fn=None,
             device: str | None = None) -> MemoryEstimate:
    """Estimate the memory of a training step (or an inference forward) without allocating real tensors."""
    if method not in ("static", "traced"):
        raise ValueError(f"method must be 'static' or 'traced', got {method!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    program = _as_program(model_or_program, args, kwargs, mode or "train")
    mode = mode or program.mode
    if not args and not kwargs:
        args, kwargs = program.example_args, program.example_kwargs
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = dict(kwargs or {})
    if mode == "inference":
        optimizer = "none"
    fn = _static if method == "static" else _traced
    est = with_data_dependent_fallback(lambda: fn(program, args, kwargs, mode, optimizer, loss_fn))
    est.device = str(device or _device_of(program.module))
    if args is program.example_args and kwargs == program.example_kwargs:
        est.program_key = program_key(program)
    _apply_sharding(est, world_size, zero_stage)
    return est


def with_data_dependent_fallback(fn):
    """Run `fn` under FakeTensorMode; if a size depends on tensor values (PyG's masks, boolean indexing), run it
    again with fake tensors that carry the example inputs' real values, so those sizes are the example's."""
    grad_mode = torch.is_grad_enabled()
    try:
        return fn()
    except GuardOnDataDependentSymNode:
        # a failure inside a higher-order op (wrap_with_set_grad_enabled) can leave grad mode switched
        torch.set_grad_enabled(grad_mode)
        import logging

        import torch._functorch.config as fconfig
        log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
        level = log.level
        log.setLevel(logging.ERROR)  # it logs every value it takes from the real tensors
        try:
            with fconfig.patch(fake_tensor_propagate_real_tensors=True):
                out = fn()
        finally:
            log.setLevel(level)
        if isinstance(out, MemoryEstimate):
            out.notes.append("data-dependent sizes (e.g. boolean indexing) were taken from the example inputs' "
                             "values")
        return out


def _as_program(m, args, kwargs, mode) -> Program:
    if isinstance(m, Program):
        return m
    from .capture import capture
    return capture(m, args, kwargs, mode=mode)


def _device_of(module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _apply_sharding(est: MemoryEstimate, world_size: int, zero_stage: int) -> None:
    """ZeRO / FSDP: stage 1 shards optimizer state, 2 adds gradients, 3 adds parameters."""
    est.world_size, est.zero_stage = world_size, zero_stage
    if world_size == 1 or zero_stage == 0:
        return
    saved = 0
    if zero_stage >= 1:
        s = est.optimizer_state - math.ceil(est.optimizer_state / world_size)
        est.optimizer_state -= s
        saved += s
    if zero_stage >= 2:
        s = est.grads - math.ceil(est.grads / world_size)
        est.grads -= s
        saved += s
    if zero_stage >= 3:
        s = est.params - math.ceil(est.params / world_size)
        est.params -= s
        saved += s
    est.peak = max(0, est.peak - saved)


def optimizer_state_bytes(optimizer: str, params: list[torch.Tensor]) -> int:
    """Bytes of optimizer state for these parameters (bitsandbytes 8-bit: its real state layout)."""
    total = 0
    for p in params:
        if not p.requires_grad:
            continue
        n, b = p.numel(), p.numel() * p.element_size()
        if optimizer in ("adam", "adamw"):
            total += 2 * b + 4  # exp_avg, exp_avg_sq, float32 step tensor
        elif optimizer == "sgd-momentum":
            total += b
        elif optimizer in ("adamw8bit", "adam8bit", "paged_adamw8bit"):
            if n < BNB_MIN_8BIT_SIZE:
                total += 2 * n * 4
            else:
                total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCKSIZE)
    if optimizer in ("adamw8bit", "adam8bit", "paged_adamw8bit") and total:
        total += 2 * 256 * 4  # the two quantization maps
    return total


def optimizer_step_workspace(optimizer: str, params: list[torch.Tensor]) -> int:
    """What optimizer.step() holds above the walk's end of backward: the gradients, and its temporaries.

    Adam/AdamW on CPU run torch's per-tensor loop (foreach kernels are for CUDA devices): for each parameter
    `denom = (exp_avg_sq.sqrt() / c).add_(eps)`, two tensors of its size at once, while the previous parameter's
    `denom` is still referenced until the assignment (a weight following a weight of its size: three at once)."""
    trainable = [p for p in params if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in trainable]
    if not sizes:
        return 0
    if optimizer in ("adam", "adamw") and not all(p.device.type == "cuda" for p in trainable):
        return sum(sizes) + max(prev + 2 * size for prev, size in zip([0] + sizes, sizes))
    if optimizer in ("adam", "adamw"):
        return sum(sizes) + 2 * max(sizes)
    if optimizer == "sgd-momentum":
        return max(sizes)
    if optimizer in ("sgd", "none"):
        return 0
    return 2 * max(p.numel() * 4 for p in trainable)


# ============================================================================================ static

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
    saved: list = field(default_factory=list)  # storage keys saved for backward
    list_keys: list = field(default_factory=list)  # storages of tensors passed inside list args (cat, stack) or
    # by keyword
    recast: list = field(default_factory=list)  # saved parameter casts that backward recasts (fxmem.nn.recast)
    grad_alias: str = ""  # the op table's grad_alias for this call ("shared" when add's alpha is 1, "expanded" when
    # sum keeps the input's dtype)
    int_outs: list = field(default_factory=list)  # storages of integer/bool outputs (max pooling's indices): no grad
    step: int = 0  # the graph node (of the program, or of a region's body) whose run issued the op
    call: Any = None  # the call as `call_signature` freezes it (ops with a backward), for `formula_temps`
    # an in-place op on a view (relu_ on a linear's 3-D output, a view of its addmm's): autograd's CopySlices runs
    # its backward, which copies the base's gradient whole and clones the view's slice of it before the op's formula
    # runs: those bytes, held with the formula's
    copy_slices: int = 0


class _Recorder(TorchDispatchMode):
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
        self.keep_alive: list = []  # storages must not be freed and their ids reused during the trace
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
        # recipe outputs made by one shared run of a multi-output op (a max pooling's output and indices) -> a
        # group id: held together from the group's first unpack to its last
        self.recipe_group: dict[int, int] = {}
        self.loss_key: int | None = None  # the loss's storage (train mode): backward runs from there

    def key(self, t):
        st = t.untyped_storage()
        k = st._cdata
        if k not in self.storage_bytes:
            self.storage_bytes[k] = int(st.nbytes())
            self.keep_alive.append(st)
            return k, True
        return k, False

    def recipe_holders(self) -> dict[int, list[int]]:
        """Recipe output storage -> the recipe outputs whose recipes hold it as a nested recipe (a U-Net cat's
        recipe holds its upsampling convolution's)."""
        return {k: list(hs) for k, hs in self.nesting().items()}

    def nesting(self) -> dict[int, dict[int, bool]]:
        """Recipe output storage -> {output of a recipe holding it nested: whether that recipe uses it through its
        shared value (a max pooling's recipes, recomputed right next to its input's own saves)}: as traced, with
        what a pass planned (`planned_nesting`)."""
        key_of = {id(rp): k for k, rp in self.recipe_of.items()}
        out: dict[int, dict[int, bool]] = {}

        def walk(rp, k: int) -> None:
            for shared in (False, True):
                for inner in nested_recipes(rp, shared):
                    if id(inner) in key_of:
                        out.setdefault(key_of[id(inner)], {})[k] = shared
                    else:  # no output of its own (a chain member an in-place op replaced, a group's shared run):
                        walk(inner, k)  # recomputed with k, what it holds is used by k's recomputations
        for k, rp in self.recipe_of.items():
            walk(rp, k)
        for k, hs in self.planned_nesting.items():
            out.setdefault(k, {}).update(hs)
        return out

    def copy_slices_bytes(self, func, args) -> int:
        """What autograd's CopySlices holds in the backward of an in-place op writing views that need a gradient:
        the base's gradient copied (its storage's bytes) and the view's slice cloned."""
        total = 0
        for i in written_positions(func):
            a = args[i] if i < len(args) else None
            if isinstance(a, torch.Tensor) and a.requires_grad and a._is_view():
                total += self.storage_bytes[self.key(a)[0]] + int(a.numel()) * a.element_size()
        return total

    def save_original_copy(self, rec, func) -> None:
        """An in-place op whose backward reads its input's value from before the write (clamp_, silu_, pow_) saves
        the copy autograd makes of it first (`original_self`: a clone dispatched just before it, in the same node):
        the op saves that copy, not the storage it writes, and the copy has no backward of its own."""
        written = {rec.in_keys[i] for i in written_positions(func) if i < len(rec.in_keys)}
        for q in reversed(self.records):
            if q.step != rec.step:
                return
            if q.func is torch.ops.aten.clone.default and q.new_keys and q.in_keys[0] in written:
                q.out_rg, q.call, q.saved = False, None, []
                rec.saved = [k for k in rec.saved if k != q.in_keys[0]] + [q.out_keys[0]]
                return

    def hold_recipe_args(self, rec) -> None:
        for k in rec.recast:
            for h in self.recipe_holds.get(k, ()):
                if h not in rec.saved:
                    rec.saved.append(h)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        in_keys, in_bytes, in_rg, list_keys = [], [], [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                k, _ = self.key(a)
                in_keys.append(k)
                in_bytes.append(int(a.numel()) * a.element_size())
                in_rg.append(bool(a.requires_grad))
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                # e.g. cat/stack: treat the list as one argument; keep the first as representative
                ks = [self.key(t)[0] for t in a]
                list_keys.extend(ks)
                in_keys.append(ks[0])
                in_bytes.append(sum(int(t.numel()) * t.element_size() for t in a))
                in_rg.append(any(t.requires_grad for t in a))
            else:
                in_keys.append(None)
                in_bytes.append(0)
                in_rg.append(False)
        # tensors passed by keyword (SDPA's attn_mask on CPU) are read too: held to here, like list members
        list_keys.extend(self.key(v)[0] for v in kwargs.values() if isinstance(v, torch.Tensor))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if self.step_each:
            self.step += 1
        out_keys, out_bytes, new_keys, int_outs = [], [], [], []
        for t in outs:
            if isinstance(t, torch.Tensor):
                k, new = self.key(t)
                out_keys.append(k)
                out_bytes.append(int(t.numel()) * t.element_size())
                if not (t.is_floating_point() or t.is_complex()):
                    int_outs.append(k)
                if new:
                    new_keys.append(k)
                    if self.recast_node:
                        self.recast_keys.add(k)
            else:
                out_keys.append(None)
                out_bytes.append(0)
        float_out = any(k is not None and k not in int_outs for k in out_keys)
        out_rg = self.grad_enabled and torch.is_grad_enabled() and float_out and any(in_rg) and \
            not optable.grad_free(func)
        rec = OpRecord(len(self.records), func, self.node, self.module, in_keys, in_bytes, in_rg, out_keys,
                       out_bytes, out_rg, new_keys, optable.flops(func, args, out), self.region,
                       list_keys=list_keys, int_outs=int_outs, step=self.step)
        if out_rg:
            # (an in-place op's backward holds what its out-of-place variant's formula holds)
            rec.call = call_signature(optable.functional_variant(func) or func, args, kwargs)
            rec.copy_slices = self.copy_slices_bytes(func, args)
            ctx = optable.SaveCtx(tuple(args), kwargs, tuple(in_rg))
            slots, rec.known = optable.saved(func, ctx)
            for kind, i in slots:
                if kind == "kw":
                    rec.saved.append(self.key(kwargs[i])[0])
                    continue
                keys = in_keys if kind == "in" else out_keys
                if i < len(keys) and keys[i] is not None:
                    rec.saved.append(keys[i])
            if written_positions(func):
                self.save_original_copy(rec, func)
            if self.recast_enabled and self.recast_keys and self.region is None:
                # casts of parameters/inputs are saved as their source and cast again in backward; inside a
                # region the region's own hooks decide (checkpoint recomputes, offload moves them)
                rec.recast = [k for k in rec.saved if k in self.recast_keys]
                rec.saved = [k for k in rec.saved if k not in self.recast_keys]
                self.hold_recipe_args(rec)
        else:
            rec.known = True
        info = optable.lookup(func)
        if info is None:
            rec.known = False
        elif info.grad_alias == "shared":
            rec.grad_alias = info.grad_alias if kwargs.get("alpha", 1) == 1 else ""
        elif info.grad_alias == "expanded":
            same_dtype = kwargs.get("dtype") in (None, getattr(args[0], "dtype", None))
            rec.grad_alias = info.grad_alias if same_dtype else ""
        elif info.grad_alias:
            rec.grad_alias = info.grad_alias
        self.records.append(rec)
        return out


class _RecordingInterpreter(fx.Interpreter):
    def __init__(self, gm, recorder: _Recorder):
        super().__init__(gm)
        self.rec = recorder

    def run_node(self, n):
        self.rec.node = n.name
        self.rec.step += 1
        self.rec.module = module_path(n)
        self.rec.recast_node = n.op == "call_function" and n.target is cast_param
        first = len(self.rec.records)
        out = super().run_node(n)
        scope = recast_active()
        recipe = scope.recipe_for(out) if scope is not None and isinstance(out, torch.Tensor) else None
        if recipe is not None and self.rec.recipe_of.get(self.rec.key(out)[0]) is not recipe:
            # the node registered its output as a recipe (fxmem.nn.recast: remat, remat_call, bool-mask dropout),
            # or an in-place op re-registered a recipe's storage (relu_ after a batch norm): saved as the recipe,
            # which holds its arguments, and recomputed in backward (a view of a recipe's output is not new)
            self._as_recipe(self.rec.key(out)[0], recipe, n, first)
            # a tensor of the op's own making it saves besides its output (max pooling's indices), a recipe too
            for r in self.rec.records[first:]:
                for s in list(r.saved):
                    other = scope.recipe_of_storage(s)
                    if other is not None and other is not recipe and self.rec.recipe_of.get(s) is not other:
                        self._as_recipe(s, other, n, first)
        return out

    def _as_recipe(self, k: int, recipe, n, first: int) -> None:
        """Storage `k`, made by node `n` (its records from `first` on), saved as `recipe`."""
        rec = self.rec
        rec.recast_keys.add(k)
        rec.recipe_holds[k] = list(dict.fromkeys(rec.key(t)[0] for t in recipe_tensors(recipe)))
        rec.recipe_at[k] = n.name
        rec.recipe_of[k] = recipe
        group = group_of(recipe)
        if recipe.share or group is not None:
            rec.recipe_shared.add(k)
        else:
            rec.recipe_shared.discard(k)
        if group is not None:
            rec.recipe_group[k] = id(group)
        for r in rec.records[first:]:  # the op's own saves of it (ReLU's result, max pooling's indices) too
            if r.region is None and k in r.saved:
                r.saved = [s for s in r.saved if s != k]
                r.recast = list(r.recast) + [k]
                rec.hold_recipe_args(r)

    def call_module(self, target, args, kwargs):
        mod = self.fetch_attr(target)
        info = region_info(mod)
        if info is None:
            return super().call_module(target, args, kwargs)
        prev = self.rec.region
        self.rec.region = target
        try:
            with recast_aside():  # as the region's forward does: its own hooks decide inside
                if isinstance(info.body, fx.GraphModule) and not kwargs:  # its nodes counted, as the program's
                    return _StepInterpreter(info.body, self.rec).run(*args)
                return info.body(*args, **kwargs)  # the region's computation, recorded op by op
        finally:
            self.rec.region = prev


class _StepInterpreter(fx.Interpreter):
    """Runs a region's body node by node, counting its nodes as steps (labels stay the region's)."""

    def __init__(self, gm, recorder: _Recorder):
        super().__init__(gm)
        self.rec = recorder

    def run_node(self, n):
        self.rec.step += 1
        return super().run_node(n)


def trace_forward(program: Program, args, kwargs, mode: str, loss_fn=None):
    """Run forward (+ loss in train mode) under FakeTensorMode, recording dispatch-level ops.

    Returns (recorder, base storage keys, output storage keys, parameters). Sizes that depend on tensor values
    are taken from the example inputs (see `with_data_dependent_fallback`)."""
    return with_data_dependent_fallback(lambda: _trace_forward(program, args, kwargs, mode, loss_fn))


class _SharedFakes:
    """One FakeTensorMode kept across static traces with the fakes it made of parameters, buffers, tensor
    attributes and example inputs: a pass traces its program several times (snapshots share parameters), and
    converting a tensor costs about half a millisecond (a quarter of a 12-layer decoder's trace). A tensor whose
    type, dtype, device, shape, strides, storage or requires_grad changed since its fake was made (a pass cast or
    replaced it) starts a fresh mode. Not used when fakes must carry real values (the data-dependent fallback)."""

    def __init__(self):
        self.mode: FakeTensorMode | None = None
        self.fakes = WeakIdKeyDictionary()  # real tensor -> (signature, fake)

    @staticmethod
    def signature(t: torch.Tensor) -> tuple:
        return (type(t), t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad,
                t.untyped_storage()._cdata)

    def mode_for(self, tensors: list) -> FakeTensorMode:
        import torch._functorch.config as fconfig
        if fconfig.fake_tensor_propagate_real_tensors:
            return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        stale = self.mode is None or any(
            (e := self.fakes.get(t)) is not None and e[0] != self.signature(t) for t in tensors)
        if stale:
            self.mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
            self.fakes = WeakIdKeyDictionary()
        return self.mode

    def keep(self, mode: FakeTensorMode, tensors: list) -> None:
        """Hold the fakes of `tensors` (the mode's memo holds them weakly only)."""
        if mode is not self.mode:
            return
        for t in tensors:
            if t not in self.fakes:
                self.fakes[t] = (self.signature(t), mode.from_tensor(t))

    def drop(self) -> None:
        self.mode, self.fakes = None, WeakIdKeyDictionary()


_SHARED_FAKES = _SharedFakes()


def _module_tensors(gm: nn.Module) -> list:
    """Parameters, buffers and plain tensor attributes (graph constants) of every module under `gm`."""
    out = list(gm.parameters()) + list(gm.buffers())
    for m in gm.modules():
        out.extend(v for v in vars(m).values() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter))
    return out


def _trace_forward(program: Program, args, kwargs, mode: str, loss_fn=None):
    gm = program.module
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    reals = list({id(t): t for t in _module_tensors(gm) + [x for x in flat if isinstance(x, torch.Tensor)]
                  if not isinstance(t, torch._subclasses.FakeTensor)}.values())
    fake_mode = _SHARED_FAKES.mode_for(reals)
    try:
        with buffers_kept(gm):  # in-place ops on real buffers alone run for real under the fake mode
            out = _trace_forward_in(fake_mode, program, flat, args, kwargs, mode, loss_fn)
    except BaseException:
        _SHARED_FAKES.drop()  # a failed trace may leave unbacked symbols in the mode's shape env
        raise
    _SHARED_FAKES.keep(fake_mode, reals)
    return out


def _trace_forward_in(fake_mode, program: Program, flat, args, kwargs, mode: str, loss_fn=None):
    gm = program.module
    with fake_mode:
        fake_flat = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat]
    rec = _Recorder()
    rec.grad_enabled = mode == "train"
    rec.recast_enabled = recast_installed(gm)
    was = gm.training
    gm.train(mode == "train")
    grad_ctx = torch.enable_grad() if mode == "train" else torch.no_grad()
    try:
        with fake_mode, grad_ctx:
            # parameters/buffers/inputs first, so they are known storages (the baseline)
            params = list(gm.parameters())
            buffers = list(gm.buffers())
            rec.node = "<params>"
            base_keys = {}
            for t in params + buffers:
                # the fake mode memoizes conversions: every use of this parameter sees this fake storage
                base_keys[rec.key(fake_mode.from_tensor(t))[0]] = "param" if isinstance(t, nn.Parameter) \
                    else "buffer"
            for t in fake_flat:
                if isinstance(t, torch.Tensor):
                    base_keys.setdefault(rec.key(t)[0], "input")
            with rec, recast_scope(gm):  # what the module's forward hooks enter (recipes register there)
                out_flat = _RecordingInterpreter(gm, rec).run(*fake_flat, enable_io_processing=False)
                output = gm.graph.process_outputs(out_flat)
                out_keys = {rec.key(t)[0] for t in pytree.tree_leaves(out_flat) if isinstance(t, torch.Tensor)}
                if mode == "train":
                    rec.node, rec.module, rec.step_each = "loss", "", True
                    fake_args = pytree.tree_unflatten(fake_flat, pytree.tree_flatten((tuple(args), dict(kwargs)))[1])
                    loss = compute_loss(loss_fn, output, fake_args[0], fake_args[1])
                    rec.loss_key = rec.key(loss)[0]
                    out_keys.add(rec.loss_key)
    finally:
        gm.train(was)
    return rec, base_keys, out_keys, params


def program_key(program: Program) -> str:
    """A fingerprint of the program's code (the root graph and every graph module under it): equal keys, same
    computation at the same example inputs, so an estimate made for one holds for the other."""
    h = hashlib.sha1()
    for name, m in program.module.named_modules():
        if isinstance(m, fx.GraphModule):
            h.update(name.encode())
            h.update(m.code.encode())
    return h.hexdigest()


def as_recipes(traced, keys: set, shared: set = frozenset(), nesting: dict | None = None,
               groups: dict | None = None):
    """`traced` (what trace_forward returned) as if the outputs under `keys` were saved as recipes (fxmem.nn.recast),
    without tracing the rewritten program: their savers save the recipe instead (those under `shared` recomputed
    once for all their saves; `nesting`, as `_Recorder.nesting`: which recipes hold which nested, and use them
    through their shared value; `groups`, as `_Recorder.recipe_group`, outputs of one shared run). What a recipe
    holds is not recorded (`recipe_holds` stays as traced): this is for
    outputs whose recipe arguments are kept anyway (remat sites), where holding them adds nothing; a pass that
    emits the rewrite traces it for the real record."""
    rec = copy.copy(traced[0])
    rec.recipe_shared = set(rec.recipe_shared) | (set(shared) & set(keys))
    rec.planned_nesting = {**rec.planned_nesting, **(nesting or {})}
    rec.recipe_group = {**rec.recipe_group, **(groups or {})}
    records = []
    for r in rec.records:
        if r.region is None and r.saved and any(k in keys for k in r.saved):
            r = copy.copy(r)
            r.recast = list(r.recast) + [k for k in r.saved if k in keys]
            r.saved = [k for k in r.saved if k not in keys]
        records.append(r)
    rec.records = records
    return (rec,) + tuple(traced[1:])


def smallest_fitting_prefix(n: int, peak_of, budget: int) -> int:
    """The smallest k in 1..n with peak_of(k) <= budget, by bisection (a pass applies its candidates in order, so
    the peak falls as k grows); n when even all n do not fit. Passes call this with their own peak_of."""
    if peak_of(n) > budget:
        return n
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if peak_of(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def estimate_from_trace(program: Program, traced, *, mode: str, optimizer: str = "adamw",
                        loss_fn=None) -> MemoryEstimate:
    """The static estimate of `program` from `traced`, what `trace_forward` returned for the same program at its
    example inputs (same mode and loss): a pass that traced the program already saves a second trace."""
    if mode == "inference":
        optimizer = "none"
    est = _static(program, program.example_args, program.example_kwargs, mode, optimizer, loss_fn, traced=traced)
    est.device = str(_device_of(program.module))
    est.program_key = program_key(program)
    return est


def _static(program: Program, args, kwargs, mode, optimizer, loss_fn, traced=None) -> MemoryEstimate:
    rec, base_keys, out_keys, params = traced if traced is not None else \
        trace_forward(program, args, kwargs, mode, loss_fn)
    R = rec.records
    sb = rec.storage_bytes
    est = MemoryEstimate(mode=mode, optimizer=optimizer, method="static")
    est.params = sum(sb[k] for k, v in base_keys.items() if v == "param")
    est.buffers = sum(sb[k] for k, v in base_keys.items() if v == "buffer")
    est.inputs = sum(sb[k] for k, v in base_keys.items() if v == "input")
    trainable = [p for p in params if p.requires_grad] if mode == "train" else []
    est.optimizer_state = optimizer_state_bytes(optimizer, trainable) if mode == "train" else 0
    est.unknown_ops = sorted({str(r.func) for r in R if not r.known and not optable.ignored(r.func)})
    est.flops_forward = sum(r.flops for r in R)
    est.flops_backward = 2 * sum(r.flops for r in R if r.out_rg)
    # recompute regions run their forward again in backward (selective regions skip the ops they keep)
    for r in R:
        if r.region and r.out_rg:
            info = region_info(program.module.get_submodule(r.region))
            if info is not None and info.kind == "recompute" and not info.keeps(r.func):
                est.flops_backward += r.flops

    # ---------------------------------------------------------------------------- who saves what, until when
    regions: dict[str, object] = {}
    for r in R:
        if r.region and r.region not in regions:
            regions[r.region] = region_info(program.module.get_submodule(r.region))
    region_first: dict[str, int] = {}
    region_last: dict[str, int] = {}
    for r in R:
        if r.region:
            region_first.setdefault(r.region, r.idx)
            region_last[r.region] = r.idx
    created_in: dict[int, int] = {}
    for r in R:
        for k in r.new_keys:
            created_in[k] = r.idx
    # parameter casts and recipes under fxmem.nn.recast are not saved: backward casts the parameter again or
    # recomputes the recipe, a transient of the op's backward; a shared recipe is made once, at its first use in
    # backward, and held until its last (uses: its saves, and recomputations of recipes using it nested)
    recast_at: dict[int, int] = defaultdict(int)
    for r in R:
        for k in r.recast:
            if k not in rec.recipe_shared:
                recast_at[r.idx] += sb[k]
    held_from: dict[int, int] = defaultdict(int)
    held_until: dict[int, int] = defaultdict(int)
    group_members: dict[int, list[int]] = defaultdict(list)  # a group of one shared run -> its outputs
    for k, g in rec.recipe_group.items():
        group_members[g].append(k)
    for k, (lo, hi) in _shared_spans(R, rec.recipe_shared, rec.nesting(), created_in, rec.recipe_group,
                                     group_members).items():
        held_from[hi] += sb[k]
        held_until[lo] += sb[k]
    last_use: dict[int, int] = {}
    for r in R:
        for k in r.in_keys + r.out_keys + r.list_keys:
            if k is not None:
                last_use[k] = r.idx
    saved_until: dict[int, int] = {}  # key -> record index whose backward frees it (the earliest saver)
    recompute_bytes: dict[str, int] = defaultdict(int)  # region -> bytes recomputed at its backward
    recompute_keys: dict[str, dict[int, int]] = defaultdict(dict)  # region -> {key: earliest saver}
    recompute_transient: dict[str, dict[int, int]] = defaultdict(dict)  # region -> {key: bytes} live while it reruns
    offloaded: dict[str, set] = defaultdict(set)
    recipe_holds = {k: h for k, h in rec.recipe_holds.items() if base_keys.get(k) is None}
    for r in R:
        if not r.out_rg:
            continue
        info = regions.get(r.region) if r.region else None
        for k in r.saved:
            if base_keys.get(k) in ("param", "buffer", "input"):
                continue
            inside = info is not None and created_in.get(k, -1) >= region_first[r.region]
            if info is not None and info.kind == "recompute" and not inside and k in recipe_holds:
                continue  # a recipe's output entering the region: made again for the recomputation (below)
            # selective regions keep the outputs of their keep ops (what SAC caches), whoever saves them
            producer = R[created_in[k]].func if k in created_in else r.func
            if info is not None and info.kind == "recompute" and inside and not info.keeps(producer):
                rk = recompute_keys[r.region]
                if k not in rk:
                    recompute_bytes[r.region] += sb[k]  # once per tensor, however many ops save it
                rk[k] = min(rk.get(k, r.idx), r.idx)
                continue
            if info is not None and info.kind == "recompute" and inside and info.holds(producer):
                saved_until[k] = region_first[r.region]  # the region holds it until its backward is done
                continue
            if info is not None and info.kind == "offload" and inside:
                offloaded[r.region].add(k)
            first = saved_until.get(k)
            saved_until[k] = r.idx if first is None else min(first, r.idx)
    # selective regions cache every output of their keep ops, saved or not, until the recomputation takes it from
    # the cache (at the region's first unpack); what keep ops the recomputation never runs cached stays in the
    # cache until the region's backward is done, as outputs the region holds (a draw tape's masks) do; whoever
    # else saves it (an op after the region) may hold it longer
    for name, info in regions.items():
        if info is None or info.kind != "recompute" or not info.keep_ops:
            continue
        lo, hi = region_first[name], region_last[name]
        unpack = _first_unpack(R, lo, hi)
        for r in R[lo:hi + 1]:
            if info.keeps(r.func):
                for k in r.new_keys:
                    if base_keys.get(k) is None and k not in out_keys:
                        cached = unpack if _recomputed(r, unpack) and not info.holds(r.func) else lo
                        saved_until[k] = min(saved_until.get(k, cached), cached)
    # inputs of a recompute region are held by the region until its backward
    savers: dict[int, list[int]] = defaultdict(list)  # key -> records saving it (for offloaded region inputs)
    if any(getattr(i, "offload_inputs", False) for i in regions.values()):
        for r in R:
            ri = regions.get(r.region) if r.region else None
            if r.out_rg and not (ri is not None and ri.kind == "recompute" and not ri.keeps(r.func)):
                for k in r.saved:  # saves that persist (a recompute region's own saves are recomputed)
                    savers[k].append(r.idx)
    for name, info in regions.items():
        if info is None or info.kind != "recompute":
            continue
        lo, hi = region_first[name], region_last[name]
        for r in R[lo:hi + 1]:
            for k in r.in_keys + r.list_keys:  # (list_keys: every tensor of a cat's list, not only the first)
                if k in recipe_holds and created_in.get(k, -1) < lo and k not in out_keys:
                    # non-reentrant checkpoint saves its inputs through the saved-tensor hooks outside it: an
                    # input that is a recipe's output is kept as the recipe (its arguments) and made again for
                    # the recomputation, held until the backward of the region's first op that saves it, or only
                    # while the recomputation runs when none does
                    if k not in recompute_keys[name] and k not in recompute_transient[name]:
                        inner = [q.idx for q in R[lo:hi + 1] if q.out_rg and k in q.saved]
                        if inner:
                            recompute_keys[name][k] = min(inner)
                            recompute_bytes[name] += sb[k]
                        else:
                            recompute_transient[name][k] = sb[k]
                        for m in group_members.get(rec.recipe_group.get(k), ()):
                            if m != k:  # made with it by the group's run, dropped at once
                                recompute_transient[name][m] = sb[m]
                    for h in recipe_holds[k]:
                        if h != k and created_in.get(h, -1) < lo and base_keys.get(h) is None:
                            saved_until[h] = min(saved_until.get(h, lo), lo)
                    continue
                if k is not None and created_in.get(k, -1) < lo and base_keys.get(k) is None:
                    saved_until[k] = min(saved_until.get(k, lo), lo)
                    if getattr(info, "offload_inputs", False) and k in created_in \
                            and not any(not lo <= i <= hi for i in savers.get(k, ())):
                        # an activation nobody else saves: off the device from the region's end until its backward
                        offloaded[name].add(k)

    # what each recompute region's recomputation holds at its highest, above what it leaves for the backward
    step_end = _step_ends(R)
    recompute_over: dict[str, int] = {}
    for name, info in regions.items():
        if info is not None and info.kind == "recompute":
            high = _recompute_high(R, step_end, region_first[name], region_last[name], info, recompute_keys[name],
                                   recompute_transient[name], sb, base_keys)
            recompute_over[name] = max(0, high - recompute_bytes[name])

    # ---------------------------------------------------------------------------- forward walk
    baseline = est.params + est.buffers + est.inputs + est.optimizer_state
    cur = baseline
    peak, peak_at, peak_phase, peak_mod = cur, "start", "forward", ""
    timeline: list[TimelinePoint] = []
    live: set[int] = set()
    frees_at: dict[int, list[int]] = defaultdict(list)
    for k, i in last_use.items():
        if k in base_keys or k in out_keys or k in saved_until:
            continue
        frees_at[_dies_at(R, step_end, max(i, created_in.get(k, i)), created_in.get(k, i))].append(k)
    offload_free_at: dict[int, list[int]] = defaultdict(list)
    for name, keys in offloaded.items():
        for k in keys:
            offload_free_at[max(region_last[name], last_use.get(k, 0))].append(k)
    saved_by_module: dict[str, int] = defaultdict(int)
    for k, i in saved_until.items():
        saved_by_module[R[created_in.get(k, i)].module or "<root>"] += sb[k]
    for r in R:
        for k in r.new_keys:
            if k not in base_keys:
                live.add(k)
                cur += sb[k]
        node_peak = cur
        if cur > peak:
            peak, peak_at, peak_phase, peak_mod = cur, r.node, "forward", r.module
        for k in frees_at.get(r.idx, ()):
            if k in live:
                live.discard(k)
                cur -= sb[k]
        for k in offload_free_at.get(r.idx, ()):
            if k in live:
                live.discard(k)
                cur -= sb[k]
        _timeline_add(timeline, "forward", r.node, cur, node_peak)
    est.activations = cur - baseline

    if mode == "train":
        off_loss = off_loss_path(R, getattr(rec, "loss_key", None))
        # what ops off the loss's path save stays referenced by the outputs they make (their graph never runs)
        kept_by_outputs = set(out_keys) | {k for r in R if r.idx in off_loss for k in r.saved}
        cur, peak, peak_at, peak_phase, peak_mod = _static_backward(
            R, sb, base_keys, kept_by_outputs, saved_until, live, cur, (peak, peak_at, peak_phase, peak_mod),
            timeline, regions, region_first, region_last, recompute_bytes, offloaded, program, recast_at,
            recompute_keys, (held_from, held_until), created_in, recompute_over, off_loss,
            seed_gradient(R, getattr(rec, "loss_key", None)))
        unmeasured = {f"{r.func} (backward temporaries not measured)" for r in R
                      if r.call is not None and r.call in FORMULA_UNMEASURED}
        est.unknown_ops = sorted(set(est.unknown_ops) | unmeasured)
        # optimizer step: gradients of all trainable parameters are live, plus the step's temporaries
        est.grads = sum(p.numel() * p.element_size() for p in trainable)
        step_peak = cur + optimizer_step_workspace(optimizer, trainable)
        if step_peak > peak:
            peak, peak_at, peak_phase, peak_mod = step_peak, "optimizer.step", "optimizer", ""
        timeline.append(TimelinePoint("optimizer", "optimizer.step", cur, step_peak))
    est.peak = peak
    est.peak_at, est.peak_phase, est.peak_module = peak_at, peak_phase, peak_mod
    est.timeline = timeline
    est.by_module = sorted(saved_by_module.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    return est


def _step_ends(R) -> dict[int, int]:
    """Graph node (step) -> index of the last op record it issued."""
    return {r.step: r.idx for r in R}


def _dies_at(R, step_end: dict, last: int, made: int) -> int:
    """The record after which a storage made at record `made` and last used at record `last` is freed: a value an
    earlier node made is referenced by the graph until the node using it last returns (a composite like matmul
    holds its inputs over all the ops it dispatches); a temporary a node makes itself dies at its last use."""
    if R[made].step == R[last].step:
        return last
    return step_end.get(R[last].step, last)


def _first_unpack(R, lo: int, hi: int) -> int:
    """The record among lo..hi (a recompute region) whose backward runs the recomputation: non-reentrant checkpoint
    recomputes at the first unpack of anything the region saved (parameters too), in the backward of its last op
    that saves; the ops after it save nothing, their backward runs before (hi when none saves)."""
    return max((r.idx for r in R[lo:hi + 1] if r.out_rg and r.saved), default=hi)


def _recomputed(r, stop: int) -> bool:
    """Whether the op of record `r` runs again in its region's recomputation, which stops at record `stop` (the
    last op that saves): non-reentrant checkpoint stops once the last saved tensor is packed, and autograd packs an
    op's saved inputs before the op runs, its saved outputs after (an addmm last runs no more, a relu last does)."""
    return r.idx < stop or r.idx == stop and any(k in r.out_keys for k in r.saved)


def _recompute_high(R, step_end: dict, lo: int, hi: int, info, saved: dict, made_again: dict, sb: dict,
                    base_keys: dict) -> int:
    """The most bytes a recompute region's recomputation (records lo..hi run again in backward) holds at once.

    It makes each op's new storages again, except the outputs of ops the region keeps (cached or held since the
    forward); what no op in it saves is dropped after its last use there, what one saves (`saved`) stays for the
    backward. Region inputs made again (`made_again`, recipes) are held while it runs. Non-reentrant checkpoint
    stops the recomputation once the last saving op has run (early stop), so ops after it do not run. The body
    runs as graph code: a value is dropped as `_dies_at` says (`step_end`: the whole trace's, capped at the stop)."""
    stop = _first_unpack(R, lo, hi)
    last_in: dict[int, int] = {}
    for r in R[lo:stop + 1]:
        for k in r.in_keys + r.out_keys + r.list_keys:
            if k is not None:
                last_in[k] = r.idx
    drop_at: dict[int, list[int]] = defaultdict(list)
    made_here = {k for r in R[lo:stop + 1] for k in r.new_keys}
    live = sum(made_again.values()) + sum(sb[k] for k in saved if k not in made_here)  # inputs made again
    high = live
    for r in R[lo:stop + 1]:
        if not info.keeps(r.func):
            for k in r.new_keys:
                if base_keys.get(k) is None:
                    live += sb[k]
                    if k not in saved:
                        drop_at[min(stop, _dies_at(R, step_end, last_in.get(k, r.idx), r.idx))].append(k)
        high = max(high, live)
        for k in drop_at.pop(r.idx, ()):
            live -= sb[k]
    return high


def _per_trace(rec, name: str, make):
    """`make()` once per trace, kept on its recorder under `name` (a copy of the recorder with other records, as
    `as_recipes` makes, gets its own)."""
    hit = rec.__dict__.get(name)
    if hit is None or hit[0] is not rec.records:
        hit = rec.__dict__[name] = (rec.records, make())
    return hit[1]


class RecomputeWalk:
    """What recomputing a span of a forward trace would hold, for a planner choosing regions before it emits any:
    the same walk as the estimate of an emitted region (`_recompute_high`), with the span run as a recompute region
    that keeps the outputs of the ops `keep_ops` names (as RegionInfo.keep_ops).

    `over(lo, hi, keep_ops)` gives, for records lo..hi:
    - the most the recomputation holds at once above what it leaves for the backward;
    - the bytes it leaves: what the span's ops save of its own making;
    - of those, the ones a step without the region would not hold (recipe saves, region inputs made again), as
      (node of the first op saving it, bytes): each is live in backward until that node's backward.
    `runs_in(lo, hi)` names the node in whose backward the recomputation runs.

    On a program with recipes (fxmem.nn.recast), inside an emitted region the recipe scope steps aside: what the
    span's ops save as recipes they save as tensors there, recomputed and left for the backward, and a region input
    that is a recipe's output is made again for the recomputation (left too if an op in the span saves it, else
    held while it runs)."""

    def __init__(self, traced):
        self.rec, self.base_keys, self.out_keys = traced[0], traced[1], traced[2]
        self.R = self.rec.records
        self.step_end = _step_ends(self.R)
        self.created_in = _RegionIndex.of(self.rec).created_in
        self._memo: dict = {}

    @classmethod
    def of(cls, traced) -> "RecomputeWalk":
        """One walk per trace, kept on its recorder (a planner asks about the same spans for several candidate
        sets)."""
        return _per_trace(traced[0], "_fxmem_recompute_walk", lambda: cls(traced))

    def runs_in(self, lo: int, hi: int) -> str:
        """The node in whose backward the recomputation of records lo..hi runs: its last op that saves a tensor
        (the ops after it save nothing; their backward runs first)."""
        return self.R[_first_unpack(self.R, lo, hi)].node

    def over(self, lo: int, hi: int, keep_ops: frozenset) -> tuple[int, int, list]:
        key = (lo, hi, frozenset(keep_ops))
        if key not in self._memo:
            self._memo[key] = self._over(lo, hi, key[2])
        return self._memo[key]

    def _over(self, lo: int, hi: int, keep_ops: frozenset) -> tuple[int, int, list]:
        R, sb, base = self.R, self.rec.storage_bytes, self.base_keys
        holds = self.rec.recipe_holds
        info = _Keeps(keep_ops)
        made = {k for r in R[lo:hi + 1] for k in r.new_keys}
        kept = {k for r in R[lo:hi + 1] if info.keeps(r.func) for k in r.new_keys}

        def made_again(k) -> bool:  # a region input that is a recipe's output
            return k in holds and self.created_in.get(k, -1) < lo and k not in self.out_keys

        saved: dict[int, int] = {}
        plain: set[int] = set()  # saved as tensors outside a region too
        for r in R[lo:hi + 1]:
            if r.out_rg:
                plain.update(r.saved)
                for k in r.saved + r.recast:  # (recipe saves are plain inside a region)
                    if base.get(k) is None and k not in kept and (k in made or made_again(k)):
                        saved[k] = min(saved.get(k, r.idx), r.idx)
        again = {k: sb[k] for r in R[lo:hi + 1] for k in r.in_keys + r.list_keys
                 if k is not None and base.get(k) is None and k not in saved and made_again(k)}
        leaves = sum(sb[k] for k in saved)
        high = _recompute_high(R, self.step_end, lo, hi, info, saved, again, sb, base)
        extra = [(R[i].node, sb[k]) for k, i in saved.items() if k not in plain or made_again(k)]
        return max(0, high - leaves), leaves, extra


class _Keeps:
    """The one thing `_recompute_high` asks of a region's RegionInfo, answered once per op overload."""
    __slots__ = ("_ops", "_seen")

    def __init__(self, keep_ops: frozenset):
        self._ops, self._seen = keep_ops, {}

    def keeps(self, func) -> bool:
        v = self._seen.get(id(func))  # (overloads live as long as torch; hashing one by id is much cheaper)
        if v is None:
            v = self._seen[id(func)] = names_op(func, self._ops)
        return v


def _shared_spans(R, shared: set, nesting: dict, created_in: dict, groups: dict,
                  members: dict) -> dict[int, tuple[int, int]]:
    """Shared recipe output -> (lowest, highest) record index of its uses in backward, which runs from high to
    low: made at the highest, held until the lowest. A use is a save of it outside regions (an unpack), or a
    recomputation of a recipe holding it nested through its shared value. A recipe is recomputed at each of its
    unpacks and at each recomputation of a recipe holding it otherwise (nested, made again with it); a shared one
    once for its uses, at the first. Outputs of one shared run (`groups`) are made together and held together,
    from the first use of any to the last (`members`: group -> its outputs). A region's input saved as a recipe is
    made again for the region alone."""
    unpacks: dict[int, list[int]] = defaultdict(list)
    for r in R:
        for k in r.recast:
            unpacks[k].append(r.idx)
    made: dict[int, list[int]] = {}  # recipe output -> record indices where backward recomputes it
    spans: dict[int, tuple[int, int]] = {}

    def uses_of(k: int) -> tuple[list[int], list[int]]:
        uses = list(unpacks.get(k, ()))
        private: list[int] = []
        for h, through_shared in nesting.get(k, {}).items():
            (uses if through_shared and k in shared else private).extend(made.get(h, ()))
        return uses, private
    # holders were created after what they hold: latest first, a holder's recomputations are known before
    for k in sorted(set(unpacks) | set(nesting) | set(groups), key=lambda k: -created_in.get(k, -1)):
        if k in made:
            continue  # (a group member, done with the group)
        group = members[groups[k]] if k in groups else [k]
        both = [uses_of(m) for m in group]
        uses = [i for u, _ in both for i in u]
        for m, (_, private) in zip(group, both):
            if m in shared and uses:
                spans[m] = (min(uses), max(uses))
                made[m] = [max(uses)] + private
            else:
                made[m] = uses + private
    return spans


def _timeline_add(tl: list, phase: str, label: str, live: int, peak: int) -> None:
    if tl and tl[-1].phase == phase and tl[-1].label == label:
        tl[-1].live = live
        tl[-1].peak = max(tl[-1].peak, peak)
    else:
        tl.append(TimelinePoint(phase, label, live, peak))


@dataclass(frozen=True)
class TensorMeta:
    """A tensor argument of a recorded call, by what its backward formula depends on."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: str
    requires_grad: bool


def call_signature(func, args, kwargs):
    """An op call as a hashable value, its tensors as `TensorMeta` (None: not reproducible on fresh tensors: a view
    or an in-place op, symbolic sizes, an argument of another kind)."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return None

    def freeze(a):
        if isinstance(a, torch.Tensor):
            return TensorMeta(tuple(map(freeze, a.shape)), tuple(map(freeze, a.stride())), a.dtype, str(a.device),
                              bool(a.requires_grad))
        if isinstance(a, (list, tuple)):
            return tuple(freeze(x) for x in a)
        if isinstance(a, torch.SymInt):  # (a dynamic batch size: its example value, without a guard)
            try:
                return optimization_hint(a)
            except Exception as e:  # noqa: BLE001 - no example value (a data-dependent size)
                raise TypeError from e
        if isinstance(a, (torch.SymFloat, torch.SymBool)):
            raise TypeError
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return a
        raise TypeError
    try:
        return func, freeze(tuple(args)), tuple(sorted((k, freeze(v)) for k, v in kwargs.items()))
    except TypeError:
        return None


_FORMULA_TEMPS: dict = {}
FORMULA_UNMEASURED: set = set()  # calls whose formula did not run on fake tensors


def formula_temps(call, grad_mask: tuple) -> int:
    """Bytes an op's backward formula holds above the input gradients it makes, at its highest: `pow(x, c)` holds
    `x.pow(c - 1)` and `c * x.pow(c - 1)` while it makes `grad * (...)`; `a / b` holds `a / b` and `(a / b) / b`
    for b's gradient; `x * w` with a broadcast `w` makes w's gradient at x's size before it sums it down.

    Measured, not tabled: the op runs once more on fresh fake tensors with the recorded shapes, strides, dtypes and
    requires-grad flags, and its backward (the real formula) runs under the storage tracker, with gradients for the
    outputs in `grad_mask` (those with one in the step). Cached per signature: the 12-layer decoder's 323 calls with
    a backward have 30."""
    if call is None or not any(grad_mask):
        return 0
    key = (call, grad_mask)
    try:
        return _FORMULA_TEMPS[key]
    except KeyError:
        pass
    try:
        n = _measure_formula(*call, grad_mask)
    except Exception:  # noqa: BLE001 - an op whose backward cannot run on fresh fake tensors: none counted, and
        n = 0  # the estimate lists the op among its unknown ops
        FORMULA_UNMEASURED.add(call)
    if len(_FORMULA_TEMPS) > 65536:
        _FORMULA_TEMPS.clear()
    _FORMULA_TEMPS[key] = n
    return n


def _measure_formula(func, args, kwargs, grad_mask: tuple) -> int:
    tracker = StorageTracker()
    try:
        with FakeTensorMode(), torch.enable_grad(), tracker:  # (forward storages tracked: views of them are not new)
            leaves: list = []

            def make(a):
                if isinstance(a, TensorMeta):
                    t = torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=a.device)
                    if a.requires_grad:
                        t.requires_grad_(True)
                        leaves.append(t)
                    return t
                if isinstance(a, tuple):
                    return [make(x) for x in a]
                return a
            out = func(*[make(a) for a in args], **{k: make(v) for k, v in kwargs})
            outs = out if isinstance(out, (tuple, list)) else (out,)
            outs = [o for o, g in zip(outs, grad_mask) if g and isinstance(o, torch.Tensor) and o.requires_grad]
            if not outs or not leaves:
                return 0
            grads = [torch.empty_like(o) for o in outs]
            tracker.reset_peak()
            # (retain_graph: the saved tensors stay, as they do until the op's backward has run)
            made = torch.autograd.grad(outs, leaves, grads, allow_unused=True, retain_graph=True)
            held = tracker.peak - tracker.current  # (`made` still holds the gradients: what stays)
            del made
            return max(0, held)
    finally:
        tracker.close()


def _covers(meta, nbytes: int) -> bool:
    """Whether a tensor (`TensorMeta`) is the whole of a storage of `nbytes`: dense, no element twice, no gap."""
    if not isinstance(meta, TensorMeta) or math.prod(meta.shape) * meta.dtype.itemsize != nbytes:
        return False
    step = 1
    for stride, size in sorted((st, d) for d, st in zip(meta.shape, meta.stride) if d != 1):
        if stride != step:
            return False
        step *= size
    return True


def off_loss_path(R: list, loss_key: int | None) -> set[int]:
    """Records with a backward that the loss does not reach: `loss.backward()` never runs them (an auxiliary head
    whose output the loss ignores). Found backwards from the loss's storage through the storages ops read; storages
    (not tensor versions) make it a superset of the true path, which errs towards running a backward."""
    if loss_key is None:
        return set()
    needed = {loss_key}
    off: set[int] = set()
    for r in reversed(R):
        if not r.out_rg:
            continue
        if any(k is not None and k in needed for k in r.out_keys):
            needed.update(k for k, rg in zip(r.in_keys, r.in_rg) if rg and k is not None)
            needed.update(r.list_keys)
        else:
            off.add(r.idx)
    return off


def seed_gradient(R, loss_key: int | None) -> tuple[int | None, int]:
    """(the loss's storage, bytes of the gradient `loss.backward()` seeds it with): `torch.autograd.backward` makes
    it (ones_like) and holds it in its frame until the whole backward has run; views of it (a sum's expanded
    gradient) add nothing."""
    made = next((b for r in reversed(R) for k, b in zip(r.out_keys, r.out_bytes) if k == loss_key), 0)
    return (loss_key, made) if loss_key is not None else (None, 0)


def _static_backward(R, sb, base_keys, out_keys, saved_until, live, cur, peak_state, timeline, regions,
                     region_first, region_last, recompute_bytes, offloaded, program, recast_at=None,
                     recompute_keys=None, recast_held=None, created_in=None, recompute_over=None,
                     off_loss=frozenset(), seed=(None, 0)):
    """The backward walk. `out_keys`: storages referenced until the step ends (its outputs, and what ops off the
    loss's path saved); `off_loss`: records whose backward never runs; `seed`: the loss's storage and the bytes of
    the gradient backward starts from (`seed_gradient`), live from its start to its end."""
    peak, peak_at, peak_phase, peak_mod = peak_state
    param_keys = {k for k, v in base_keys.items() if v == "param"}
    grad_live: dict[int, int] = {}  # storage key of a forward value -> bytes of its gradient buffer
    if seed[0] is not None:
        grad_live[seed[0]] = 0  # (counted apart: the records' walk neither makes nor frees it)
        cur += seed[1]
    created_in = created_in or {}
    free_saved_at: dict[int, list[int]] = defaultdict(list)
    for k, i in saved_until.items():
        free_saved_at[i].append(k)
    # the loss gradient seeds backward
    recomputed_live: dict[str, int] = {}
    # region -> the record in whose backward it recomputes
    recompute_at = {name: _first_unpack(R, region_first[name], region_last[name]) for name, info in regions.items()
                    if info is not None and info.kind == "recompute"}
    # a recomputed tensor is freed once the last op (in backward order) that saved it has run its backward
    recomputed_free_at: dict[int, list] = defaultdict(list)  # record index -> [(region, bytes)]
    for name, rk in (recompute_keys or {}).items():
        for k, i in rk.items():
            recomputed_free_at[i].append((name, sb[k]))
    reload_at: dict[int, list[int]] = defaultdict(list)
    # offloaded tensors come back one region ahead (prefetch) of the region's backward
    order = sorted(offloaded, key=lambda n: region_first[n])
    for j, name in enumerate(order):
        later = order[j + 1] if j + 1 < len(order) else None
        at = region_last[later] if later is not None else region_last[name]
        reload_at[at].extend(offloaded[name])

    node_high = [0]  # the highest live bytes inside the current op's backward (transients included)
    read_until = {k: r.idx for r in R for k in r.in_keys + r.list_keys if k is not None}  # last forward reader
    # keys whose gradient is a view of another's buffer, which autograd adds into out of place: a slice of a cat's
    # ("sliced" below), a sum's one-element gradient expanded ("expanded")
    grad_views: set[int] = set()
    grad_expanded: set[int] = set()  # of those, the expanded ones: every stride 0, views of them are views

    def expanded_view(k: int) -> None:
        grad_views.add(k)
        grad_expanded.add(k)

    def bump(label, module):
        nonlocal peak, peak_at, peak_phase, peak_mod
        node_high[0] = max(node_high[0], cur)
        if cur > peak:
            peak, peak_at, peak_phase, peak_mod = cur, f"{label} (backward)", "backward", module

    def free_saved(r, cur):
        """What the backward of record r releases: tensors saved until r, recomputed tensors r saved."""
        for k in free_saved_at.get(r.idx, ()):
            if k in out_keys:
                continue  # the step's outputs stay referenced by the caller until the step ends
            if k in live:
                live.discard(k)
                cur -= sb[k]
            elif any(k in s for s in offloaded.values()):
                cur -= sb[k]
        for name, b in recomputed_free_at.get(r.idx, ()):
            if name in recomputed_live:
                recomputed_live[name] -= b
                cur -= b
        return cur

    def recompute(r):
        """Region r.region's recomputation, if it runs in r's backward (`recompute_at`): what it leaves for the
        backward stays, what it holds above that while it runs goes again."""
        nonlocal cur
        if r.region and r.idx == recompute_at.get(r.region) and r.region not in recomputed_live:
            recomputed_live[r.region] = recompute_bytes.get(r.region, 0)
            cur += recomputed_live[r.region]
            during = (recompute_over or {}).get(r.region, 0)
            if during:  # what the recomputation holds while it runs and drops: its own temporaries, inputs it
                cur += during  # makes again that no op in it saves
                bump(r.node, r.module)
                cur -= during

    for r in reversed(R):
        for k in reload_at.get(r.idx, ()):
            cur += sb[k]
        if not r.out_rg or r.idx in off_loss:
            recompute(r)
            # an op without a backward still frees what is held until its position (a region input held until
            # the region's first op, e.g. a mask built there), and a region whose first op needs no grad (e.g.
            # prim.device) still ends its recomputation here
            cur = free_saved(r, cur)
            if r.region and r.idx == region_first.get(r.region) and r.region in recomputed_live:
                cur -= recomputed_live.pop(r.region)
            continue
        node_peak_start = cur
        node_high[0] = cur
        sums: list = []  # (key, bytes): gradients this op adds to a join's gradient slice
        again = (recast_at or {}).get(r.idx, 0)
        cur += again  # parameter copies cast again, recipes recomputed for this op's backward (fxmem.nn.recast)
        if recast_held is not None:
            cur += recast_held[0].get(r.idx, 0)  # a shared recipe, recomputed here for this and earlier savers
        # grad of outputs (allocated by consumers; outputs of the graph get theirs from the loss); an output no
        # later op reads (SDPA's logsumexp, a norm's mean) gets none
        for k, b in zip(r.out_keys, r.out_bytes):
            if k is not None and k not in grad_live and b and k not in r.int_outs and read_until.get(k, -1) > r.idx:
                grad_live[k] = sb.get(k, b)
                cur += grad_live[k]
        grad_mask = tuple(k is not None and k in grad_live for k in r.out_keys)  # (before a view hands one on)
        # the region's recomputation runs in the backward of its last op that saves a tensor (its first unpack),
        # once the gradients of that op's outputs are made: with them live (a dropout's scaling after its mask
        # multiply saves nothing, so its gradient is made before)
        recompute(r)
        info = optable.lookup(r.func)
        passthrough = info is not None and info.grad_passthrough
        handed_over = False
        # a view (or an in-place op whose grad passes through) of its input's storage: the output's grad is the
        # input's, the same buffer, which lives on to the input's producer (not an accumulation, not freed here)
        same = {k for k, rg in zip(r.in_keys, r.in_rg) if rg and k is not None and k in r.out_keys} \
            if passthrough else ()
        ins = list(zip(r.in_keys, r.in_bytes, r.in_rg))
        # add(a, b) hands one gradient tensor to both inputs (same shape as the output, alpha 1): the first input
        # whose path runs last in backward (the earliest created) holds the buffer, the other aliases it (0 bytes)
        shares = r.grad_alias == "shared" and r.out_bytes and \
            sum(1 for k, b, rg in ins if rg and k is not None and b == r.out_bytes[0]) > 1
        if shares:
            ins.sort(key=lambda t: created_in.get(t[0], -1) if t[0] is not None else 0)
        if r.grad_alias == "sliced" and r.list_keys and any(r.in_rg) and r.out_keys and r.out_keys[0] in grad_live \
                and not any(k in param_keys for k in r.list_keys):
            # cat/stack hand each input a slice of their output's gradient (views, no new buffer): the buffer lives
            # until the last slice is consumed, held by the earliest-created input (whose producer runs last)
            buf = grad_live.pop(r.out_keys[0])
            for k in sorted(dict.fromkeys(r.list_keys), key=lambda k: created_in.get(k, -1)):
                if k in grad_live:  # accumulated into an existing gradient: a transient of its size
                    bump(r.node, r.module)
                    cur += sb[k]
                    bump(r.node, r.module)
                    cur -= sb[k]
                    continue
                if buf is not None:
                    grad_live[k], buf = buf, None
                else:
                    grad_live[k] = 0
                grad_views.add(k)
            if buf is not None:
                cur -= buf  # every input had a gradient already
            ins = [t for t in ins if t[0] not in r.list_keys]
        if r.grad_alias == "joined" and r.in_keys[0] in grad_live and r.in_keys[0] not in param_keys:
            # split/unbind: backward joins its outputs' gradients (the views' under the storage's key) into a new
            # gradient of the input's size, alive with them
            k = r.in_keys[0]
            cur += r.in_bytes[0]
            bump(r.node, r.module)
            cur -= grad_live[k]
            grad_live[k] = r.in_bytes[0]
        accumulated = 0
        covered: set = set()  # storages this op made a gradient for that holds its other views' (q, k, v of a qkv)
        renewed: list = []  # (key, bytes): an in-place op's input gradients, new buffers under its output's key
        handed_expanded = False
        if r.grad_alias == "expanded" and r.in_rg and r.in_rg[0] and r.in_keys[0] is not None \
                and r.in_keys[0] not in param_keys \
                and r.in_keys[0] not in grad_live and r.out_keys[0] in grad_live and r.call is not None \
                and _covers(r.call[1][0], sb.get(r.in_keys[0], 0)) \
                and (r.out_keys[0] in grad_expanded or r.out_bytes[0] == r.call[1][0].dtype.itemsize):
            # sum hands its input its own gradient expanded to the input's shape, a view: no new buffer when every
            # stride is 0 (the sum made one element, or its gradient was such a view already), and the input is its
            # whole storage (a slice's backward makes the storage's gradient whole). Between the storage's maker and
            # the sum only views of the whole storage can sit, and those of a tensor whose strides are all 0 are
            # views again; a partial sum's expanded gradient is not (a reshape of it copies): counted whole
            k = r.in_keys[0]
            grad_live[k] = grad_live.pop(r.out_keys[0])
            expanded_view(k)
            ins = ins[1:]
        for k, b, rg in ins:
            if not rg or k is None or k in same:
                continue
            if shares and handed_over and b == r.out_bytes[0] and k not in grad_live and k not in param_keys:
                grad_live[k] = 0  # the same buffer the first input got
                if handed_expanded:
                    expanded_view(k)
                continue
            if k in covered:
                continue
            if k in grad_live:
                # accumulation: new grad + old grad -> a transient of the new one's size, alive with the formula's
                # other gradients and temporaries (it is added once the formula returns)
                bump(r.node, r.module)
                tmp = b
                cur += tmp
                bump(r.node, r.module)
                if k in grad_views:
                    grad_views.discard(k)
                    if k not in r.out_keys:
                        # the old one is a view (a join's slice, a sum's expanded gradient), which autograd does not
                        # add into in place: the sum is a new buffer, made once this op's backward has released
                        # what it held
                        sums.append((k, tmp))
                        continue
                    # an in-place op (dropout's scaling mul_) on a slice of a join (stack): its output's gradient
                    # is that slice, released below; the input's is a new buffer, as for any in-place op
                if k in r.out_keys and written_positions(r.func):
                    # in place: the output's gradient goes below, the input's stays (on a view, CopySlices's copy
                    # of the whole base's gradient, the view's part written into it)
                    renewed.append((k, sb.get(k, tmp) if r.copy_slices else tmp))
                accumulated += tmp
                continue
            if passthrough and not handed_over and r.out_keys and r.out_keys[0] in grad_live \
                    and (b <= grad_live[r.out_keys[0]] or r.out_keys[0] in grad_expanded and k not in param_keys
                         and (k == r.in_keys[0] or shares) and info.grad_view):
                handed_expanded = r.out_keys[0] in grad_expanded
                grad_live[k] = grad_live.pop(r.out_keys[0])  # the output's grad becomes the input's (a view)
                if handed_expanded:
                    expanded_view(k)
                handed_over = True
                continue
            grad_live[k] = sb.get(k, b) if k not in param_keys else b
            cur += grad_live[k]
            if k not in param_keys and sum(b2 for k2, b2, rg2 in ins if k2 == k and rg2) <= grad_live[k]:
                covered.add(k)  # views of one storage, together within it: a gradient each, as many bytes
        # temporaries a backward formula holds with the gradients it makes (pow: x.pow(c - 1) and c * that)
        # (the gradients it makes for inputs that have one already are added to theirs once it returns)
        temps = formula_temps(r.call, grad_mask) + r.copy_slices
        cur += temps
        bump(r.node, r.module)
        cur -= temps + accumulated
        node_peak = max(cur, node_peak_start, node_high[0])  # (node_high: with the temporaries)
        cur -= again
        if recast_held is not None:
            cur -= recast_held[1].get(r.idx, 0)  # a shared recipe's first saver: its last unpack
        # the op's output grads die, and what it saved
        for k in r.out_keys:
            if k is not None and k in grad_live and k not in param_keys and k not in same:
                cur -= grad_live.pop(k)
                grad_views.discard(k)
        for k, b in renewed:
            grad_live[k] = b
            cur += b
        cur = free_saved(r, cur)
        for k, b in sums:
            # old slice + new gradient, a new buffer; then the new gradient and the slice go (with the join's buffer
            # when this input held it: the slices of inputs created later were consumed before, their producers ran
            # first)
            cur += b
            bump(r.node, r.module)
            node_peak = max(node_peak, cur)
            cur -= b + grad_live[k]
            grad_live[k] = b
        if r.region and r.idx == region_first.get(r.region) and r.region in recomputed_live:
            cur -= recomputed_live.pop(r.region)
        _timeline_add(timeline, "backward", r.node, cur, node_peak)
    # end of backward: only parameter grads stay (plus the step's outputs, still referenced by the caller)
    for k in list(grad_live):
        if k not in param_keys:
            cur -= grad_live.pop(k)
    cur -= seed[1]
    return cur, peak, peak_at, peak_phase, peak_mod


# ============================================================================================ traced

def _traced(program: Program, args, kwargs, mode, optimizer, loss_fn) -> MemoryEstimate:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv())
    gm = program.module
    with FakeCopyMode(fake_mode):
        fgm = deep_copy(gm)
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    with fake_mode:
        fflat = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat]
    fargs, fkwargs = pytree.tree_unflatten(fflat, spec)
    fgm.train(mode == "train")
    node_label = {"cur": "<input>"}

    class _Labelled(fx.Interpreter):
        def run_node(self, n):
            node_label["cur"] = n.name
            out = super().run_node(n)
            tag_grad_fns(out, n.name)
            return out

    def label(func):
        if tracker.phase == "backward":
            return backward_label(func) or str(func)
        if tracker.phase == "optimizer":
            return "optimizer.step"
        return node_label["cur"]

    tracker = StorageTracker(label)
    est = MemoryEstimate(mode=mode, optimizer=optimizer, method="traced")
    with fake_mode:
        params = list(fgm.parameters())
        buffers = list(fgm.buffers())
        opt = make_torch_optimizer(optimizer, params) if mode == "train" else None
        est.params = tracker.bytes_of(params)
        est.buffers = tracker.bytes_of(buffers)
        est.inputs = tracker.bytes_of(fflat)
        interp = _Labelled(fgm)

        def run_model(*a, **k):
            flat_in, _ = pytree.tree_flatten((tuple(a), dict(k)))
            with recast_scope(gm):  # what the module's forward hooks would enter (fgm is a fake copy)
                out = interp.run(*flat_in, enable_io_processing=False)
            return fgm.graph.process_outputs(out)

        marks = {}

        def mark(phase):
            if phase == "backward":
                marks["fwd_end"] = tracker.current
            if phase == "optimizer":
                est.grads = sum(int(p.grad.untyped_storage().nbytes()) for p in params if p.grad is not None)
            tracker.phase = phase

        from .step import training_step
        if mode == "train":
            # step 1 creates optimizer state (untracked); step 2 is the steady state
            training_step(run_model, fargs, fkwargs, opt, loss_fn)
            from .measure import _optimizer_state
            state = _optimizer_state(opt) if opt is not None else []
            est.optimizer_state = tracker.bytes_of(state)
            tracker.seed(params)
            tracker.seed(buffers)
            tracker.seed(fflat)
            tracker.seed(state)
            base = tracker.current
            tracker.reset_peak()
            tracker.record = True
            with tracker:
                training_step(run_model, fargs, fkwargs, opt, loss_fn, mark)
        else:
            tracker.seed(params)
            tracker.seed(buffers)
            tracker.seed(fflat)
            base = tracker.current
            tracker.reset_peak()
            tracker.record = True
            tracker.phase = "forward"
            with tracker, torch.no_grad():
                out = run_model(*fargs, **fkwargs)
                marks["fwd_end"] = tracker.current
                del out
    tracker.record = False
    est.activations = max(0, marks.get("fwd_end", base) - base)
    est.peak = tracker.peak
    est.peak_at, est.peak_phase = tracker.peak_label, tracker.peak_phase
    est.timeline = tracker.timeline
    nodes = {n.name: n for n in program.graph.nodes}
    if est.peak_at in nodes:
        est.peak_module = module_path(nodes[est.peak_at])
    tracker.close()
    return est


def tag_grad_fns(out, label: str) -> None:
    """Name, in autograd's node metadata, the graph node that created each backward node (for timelines)."""
    todo = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        try:
            md = fn.metadata
        except Exception:  # noqa: BLE001
            continue
        if "fxmem_label" in md:
            continue
        md["fxmem_label"] = label
        todo.extend(f for f, _ in fn.next_functions if f is not None and type(f).__name__ != "AccumulateGrad")


# ============================================================================================ recompute costs

# CPU machine balance (FLOPs per byte at which an op stops being memory-bound)
CPU_BALANCE = 10.0
# CPU random draws cost far more than their bytes: Bernoulli ~7 ns per element on the 2-core host the benchmarks
# run on, against ~200 GFLOP/s matmuls, i.e. ~1500 FLOP-equivalents; 1000 per byte drawn (a bool mask: per element)
DRAW_COST_PER_BYTE_CPU = 1000.0
# CPU kernels slower per byte written than the roofline says, in FLOP-equivalents as above (`python
# benchmarks/remat_recompute_count.py --kernels`, 2-core host, torch 2.13, U-Net shapes, over three sessions): a
# pointwise addcmul ~12-20, max pooling with its indices ~170-200, average pooling ~190-300, a first convolution over
# 1 channel (3x3) ~170-205, a 2x2 stride-2 transposed convolution ~350-410. The table's values are about the lowest
# of those: poolings 180, convolutions 170 (larger convolutions are above that by their FLOPs anyway)
# (dispatch-level names, as the recorder sees them: conv2d and conv_transpose2d run aten.convolution, max_pool2d runs
# max_pool2d_with_indices)
SLOW_KERNELS_CPU = {**dict.fromkeys(("max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices",
                                     "avg_pool2d", "avg_pool3d"), 180.0),
                    "convolution": 170.0}


def op_cost(r, balance: float | None) -> float:
    """Recompute cost of one recorded op: FLOPs, or with a machine balance the roofline max(FLOPs, balance x bytes
    read and written). Views and metadata ops (prim.device) move no data. On CPU (balance below CUDA's) a random
    draw costs DRAW_COST_PER_BYTE_CPU per byte it writes, a pooling or convolution at least SLOW_KERNELS_CPU's."""
    if balance is None:
        return float(r.flops)
    cat = optable.category(r.func)
    if cat == optable.VIEW or optable.ignored(r.func):  # (prim.device and other queries read no data)
        return float(r.flops)
    moved = sum(b for b in r.in_bytes if b) + sum(b for b in r.out_bytes if b)
    if cat == optable.RANDOM and balance < 100:
        return max(float(r.flops), DRAW_COST_PER_BYTE_CPU * sum(b for b in r.out_bytes if b))
    slow = SLOW_KERNELS_CPU.get(optable.packet(r.func)) if balance < 100 else None
    if slow is not None:
        return max(float(r.flops), balance * moved, slow * sum(b for b in r.out_bytes if b))
    return max(float(r.flops), balance * moved)


def default_balance(program: Program) -> float:
    """FLOPs per byte at which an op stops being memory-bound: ~10 for CPUs, ~100 for datacenter GPUs."""
    p = next(program.module.parameters(), None)
    return 100.0 if p is not None and p.device.type == "cuda" else CPU_BALANCE


# ============================================================================================ node costs

@dataclass
class NodeCost:
    """What one graph node costs: bytes it creates, bytes autograd keeps for it, its FLOPs."""
    name: str
    module: str
    out_bytes: int = 0
    saved_bytes: int = 0  # activations this node's ops save (each storage counted at its first saver)
    kept_bytes: int = 0  # activations this node creates that some op saves: what recomputing the node could drop
    flops: int = 0
    ops: list = field(default_factory=list)


def node_costs(program: Program, mode: str | None = None, loss_fn=None) -> dict[str, NodeCost]:
    """Per-node costs from the static forward trace (for passes deciding what to keep or recompute); with `loss_fn`
    (train mode) the loss's saves count too (logits a cross-entropy keeps)."""
    mode = mode or program.mode
    rec, base_keys, _, _ = with_data_dependent_fallback(
        lambda: trace_forward(program, program.example_args, program.example_kwargs, mode, loss_fn))
    out: dict[str, NodeCost] = {}
    saved_seen: set[int] = set()
    for r in rec.records:
        nc = out.setdefault(r.node, NodeCost(r.node, r.module))
        nc.flops += r.flops
        nc.out_bytes += sum(rec.storage_bytes[k] for k in r.new_keys)
        nc.ops.append(str(r.func))
        for k in r.saved:
            if k not in saved_seen and base_keys.get(k) is None:
                saved_seen.add(k)
                nc.saved_bytes += rec.storage_bytes[k]
    for r in rec.records:
        out[r.node].kept_bytes += sum(rec.storage_bytes[k] for k in r.new_keys if k in saved_seen)
    return out


# ============================================================================================ checkpoint plans
#
# What checkpointing candidate regions does to memory, for the checkpoint pass's planner (Chen et al. 2016 /
# Rotor style, on the static timeline). The pass picks the candidates (module boundaries) and solves; this part says
# what each choice frees and costs and what a plan's peak is.
#
# Recomputing region i frees `freed_i(choice)` bytes: what autograd would save inside the region, less what the
# choice keeps (selective: matmul outputs; full: the kept dropout masks) and what the region must hold (inputs
# nobody else saves) or leaves as plain tensors (recipes saved outside it). A region's outputs count as freed when
# only its own ops save them (a residual stream a segment's norm saves and the next add only reads); another region
# reading such an output, recomputed, holds it. Those bytes are freed at every point after region i's forward and
# before its backward, i.e. every forward or backward point at a node later in the graph than region i; inside its
# own backward the recomputation brings its tensors back, as without checkpointing. With the baseline's live bytes
# `live(p)` the plan's peak is
#
#     peak(plan) = max over points p of  live(p) - sum of freed_i(choice_i) over regions i before p
#
# and, for each recomputed region i, its recomputation's spike: the baseline's live bytes where i recomputes (its
# first unpack: the backward of its last op that saves a tensor), plus spike_i(choice_i), less what the regions
# before i free. spike_i is what the recomputation holds at its highest above what it leaves (temporaries: attention
# scores a block drops in forward are live again at once with what it keeps), plus what it leaves beyond what it
# frees (inputs it held, outputs made again), walked on the trace as the static estimate walks an emitted region
# (`RecomputeWalk`); or, if higher, the baseline's points in i's own backward after that, with its held inputs and
# what the recomputation left that the baseline does not hold (recipe saves, plain inside a region; inputs made
# again) on top. Regions sorted by position make every constraint a nested prefix sum (`RegionModel`), which is
# what the pass's DP and MILP solve over.

@dataclass
class CandidateRegion:
    """A candidate: consecutive nodes of one module call, with what checkpointing it would free and cost."""
    path: str
    nodes: list  # fx.Node, graph order
    first: int = 0  # position of the first / last node in the graph
    last: int = 0
    saved: int = 0  # bytes autograd saves inside the region (created inside)
    kept: int = 0  # bytes selective keeps (outputs of keep ops)
    held: int = 0  # bytes of region inputs the region would hold that nobody saves otherwise
    flops: float = 0.0  # forward cost of the region (recompute cost of `full`)
    flops_sel: float = 0.0  # recompute cost of `selective`
    inputs: list = field(default_factory=list)
    keep_full: frozenset = frozenset()  # ops even `full` keeps: the region's random draws (DRAW_OPS), when all are
    kept_full: int = 0  # bytes of their outputs
    flops_redraw: float = 0.0  # recompute cost of `redraw` (`full` plus drawing the kept masks again)
    lost: int = 0  # bytes of recipe outputs the region makes that stay plain tensors when it is recomputed
    span: tuple = ()  # (first, last) index of its op records in the trace it was measured on
    keep_sel: frozenset = frozenset()  # ops `selective` keeps (the keep ops, and the draws `full` keeps)
    # why `selective` cannot be emitted ("" if it can): a kept op's output written in place afterwards (`h =
    # linear(x); h.relu_()`): torch's selective checkpointing caches that output and refuses a mutated one in
    # backward
    sel_blocked: str = ""
    # choice -> bytes live at its recomputation in backward beyond the baseline there: the recomputation's own
    # temporaries above what it leaves, plus what it leaves beyond what the region frees (its held inputs, its
    # outputs made again), or, if higher, the baseline's highest in the region's own backward after it with the
    # held inputs and what the recomputation left that the baseline does not hold on top (recipe saves made plain,
    # inputs made again); filled by `build_region_model` for the region's choices
    spike: dict = field(default_factory=dict)

    def keeps(self, choice: str) -> tuple[frozenset, int]:
        """(the ops whose outputs a recomputation with `choice` keeps, their bytes): selective the keep ops and
        the draws, full the draws, redraw nothing."""
        if choice == "selective":
            return self.keep_sel, self.kept
        if choice == "full":
            return self.keep_full, self.kept_full
        return frozenset(), 0

    def freed(self, choice: str) -> int:
        if choice == "keep":
            return 0
        return max(0, self.saved - self.keeps(choice)[1] - self.held - self.lost)

    def cost(self, choice: str) -> float:
        return {"keep": 0.0, "selective": self.flops_sel, "full": self.flops, "redraw": self.flops_redraw}[choice]


# the draws a recompute region keeps (on its DrawTape) instead of drawing again: fxmem.nn.checkpoint.DRAW_OPS, of
# these dropouts' bool masks
DROPOUT_FNS = (bool_mask_dropout, bool_mask_dropout_remat)


def value_key(by_node: dict, n: fx.Node) -> int | None:
    """The storage of the value node `n` hands on: its last op record's first output (`by_node`: node name ->
    its op records in a trace). A node whose ops return no tensor while its value is one hands on an input's (a
    dropout with p=0 returns its input as it is): its first tensor argument's."""
    k = next((r.out_keys[0] for r in reversed(by_node.get(n.name, []))
              if r.out_keys and r.out_keys[0] is not None), None)
    if k is None and n.op == "call_function" and isinstance(n.meta.get("fxmem_val"), torch.Tensor):
        a = next((a for a in n.args if isinstance(a, fx.Node) and isinstance(a.meta.get("fxmem_val"), torch.Tensor)),
                 None)
        if a is not None:
            return value_key(by_node, a)
    return k


class _RegionIndex:
    """What `measure_regions` looks up in a forward trace, built once per trace (the pass measures a dozen candidate
    sets against one trace) and kept on the recorder."""

    def __init__(self, rec):
        R = self.records = rec.records
        self.created_in: dict[int, int] = {k: r.idx for r in R for k in r.new_keys}
        self.savers: dict[int, list[int]] = {}  # storage key -> records saving it for backward
        for r in R:
            if r.out_rg:
                for k in r.saved:
                    self.savers.setdefault(k, []).append(r.idx)
        self.by_node: dict[str, list] = {}
        for r in R:
            self.by_node.setdefault(r.node, []).append(r)
        self.recast_savers: dict[int, list[int]] = {}  # recipe output -> records that save it as the recipe
        for r in R:
            for k in r.recast:
                if k in rec.recipe_at:
                    self.recast_savers.setdefault(k, []).append(r.idx)
        self.holders = rec.recipe_holders()  # recipe output -> recipe outputs holding it nested (a cat, its upsampling)
        # records that write storages in place, with those storages (few: relu_, add_, dropout's scaling)
        self.writes: list[tuple[int, list]] = []
        for r in R:
            w = [r.in_keys[i] for i in written_positions(r.func) if i < len(r.in_keys) and r.in_keys[i] is not None]
            if w:
                self.writes.append((r.idx, w))
        self._costs: dict[tuple, float] = {}

    @classmethod
    def of(cls, rec) -> "_RegionIndex":
        return _per_trace(rec, "_fxmem_region_index", lambda: cls(rec))

    def cost(self, r, balance: float | None) -> float:
        key = (r.idx, balance)
        c = self._costs.get(key)
        if c is None:
            c = self._costs[key] = op_cost(r, balance)
        return c


def _kept_then_written(ix: "_RegionIndex", made: dict) -> str:
    """Why a selective recomputation cannot keep the outputs `made` (storage -> the record of the keep op making it;
    "" if it can): one of them is written in place later in the forward (torch's selective checkpointing caches the
    tensor and raises in backward when it finds it changed). Names the op that made it and the op that writes it."""
    if not made:
        return ""
    for i, keys in ix.writes:
        for k in keys:
            m = made.get(k)
            if m is not None and i > m.idx:
                r = ix.records[i]
                return (f"{optable.packet(m.func)} output of node {m.node} is written in place by "
                        f"{optable.packet(r.func)} (node {r.node})")
    return ""


def measure_regions(program: Program, regions: list[CandidateRegion], rec, base_keys, keep_ops: frozenset,
                    node_time: dict[str, float] | None = None, balance: float | None = None) -> None:
    """Fill saved/kept/held bytes and recompute costs of each region from the forward trace."""
    ix = _RegionIndex.of(rec)
    sb = rec.storage_bytes
    created_in, savers, by_node = ix.created_in, ix.savers, ix.by_node
    recipe_at = rec.recipe_at  # recipe output storage -> the node that registered it
    recast_savers, holders = ix.recast_savers, ix.holders

    def keys_of(n: fx.Node) -> set[int]:
        # every storage its ops made (a norm's statistics too) and the one its value hands on (a view's, an in-place
        # op's), not the storages its ops merely pass through (a linear's view of its input, which its mm saves)
        vk = value_key(by_node, n)
        return {k for r in by_node.get(n.name, []) for k in r.new_keys} | ({vk} if vk is not None else set())

    # the region's outputs that nothing outside it keeps: no saver outside, not the graph's output (a residual
    # stream that the next add only reads and a norm inside saves). Recomputing the region frees them with its
    # other saves; a region reading one as an input holds it instead (`held`: when its maker is kept, that
    # counts bytes its saver keeps anyway, the one place this model is conservative)
    bounds = [region_boundary(reg.nodes) for reg in regions]
    spans = [{r.idx for n in reg.nodes for r in by_node.get(n.name, [])} for reg in regions]
    loose: list[set[int]] = []
    loose_in: dict[int, int] = {}  # loose output -> the region it is loose in
    for ri, ((_, outs), idxs) in enumerate(zip(bounds, spans)):
        pinned = {k for o in outs if any(u.op == "output" for u in o.users) for k in keys_of(o)}
        loose.append({k for o in outs for k in keys_of(o) - pinned
                      if base_keys.get(k) is None and all(i in idxs for i in savers.get(k, ()))})
        loose_in.update(dict.fromkeys(loose[ri], ri))
    for ri, (reg, (ins, outs), idxs, own_loose) in enumerate(zip(regions, bounds, spans, loose)):
        names = {n.name for n in reg.nodes}
        recs = [r for n in reg.nodes for r in by_node.get(n.name, [])]
        saved: set[int] = set()
        kept: set[int] = set()
        kept_full: set[int] = set()
        sac_made: dict = {}  # what selective checkpointing caches: storage -> the keep op's record
        flops = flops_sel = draws_cost = 0.0
        # random draws are kept (not drawn again) only if every draw in the region can be: recomputation restores
        # the RNG state and replays the draws in order, so skipping some would shift the others
        draws = [r for r in recs if optable.category(r.func) == optable.RANDOM]
        targets = {n.name: n.target for n in reg.nodes}
        keep_rng = DRAW_OPS if draws and all(optable.packet(r.func) in DRAW_OPS and targets.get(r.node) in DROPOUT_FNS
                                             for r in draws) else frozenset()
        keep_sel = keep_ops | keep_rng
        for r in recs:
            is_keep = names_op(r.func, keep_sel)
            is_keep_full = optable.packet(r.func) in keep_rng
            if node_time is None:
                c = ix.cost(r, balance)
                if not is_keep_full:
                    flops += c
                else:
                    draws_cost += c
                if not is_keep:
                    flops_sel += c
            if r.out_rg:
                for k in r.saved:
                    if base_keys.get(k) is None and created_in.get(k) in idxs:
                        saved.add(k)
            if is_keep:
                kept.update(k for k in r.new_keys if base_keys.get(k) is None)
                if not is_keep_full:
                    sac_made.update(dict.fromkeys(r.new_keys, r))
            if is_keep_full:
                kept_full.update(k for k in r.new_keys if base_keys.get(k) is None)
        if node_time is not None:
            for n in reg.nodes:
                t = node_time.get(n.name, 0.0)
                node_recs = by_node.get(n.name, [])
                if not any(optable.packet(r.func) in keep_rng for r in node_recs):
                    flops += t
                else:
                    draws_cost += t
                if not any(optable.packet(r.func) in keep_sel for r in node_recs):
                    flops_sel += t
        # the other outputs live on outside it (consumers save them): checkpointing cannot free them
        out_keys = {k for o in outs for k in keys_of(o)} - own_loose
        saved -= out_keys
        kept -= out_keys
        kept_full -= out_keys
        held_keys: set[int] = set()
        for a in ins:
            v = a.meta.get("fxmem_val")
            if isinstance(v, torch.Tensor) and a.op != "get_attr" and a.op != "placeholder":
                # an input the region must hold; if autograd saves it anyway, nothing extra (unless only the
                # region making it saves it: see `loose`). Its storage, whoever created it: an in-place op or a
                # view hands on a storage an earlier op made (new_keys is empty)
                keys = {k for k in keys_of(a) if base_keys.get(k) is None}
                if keys & recipe_at.keys():
                    # a recipe's output: checkpoint saves it through fxmem.nn.recast's hooks, as the recipe (if
                    # another region made it and recomputes, that region counts it: see `lost`)
                    continue
                if not (keys & savers.keys()):
                    held_keys |= keys
                elif loose_in.get(vk := value_key(by_node, a), ri) != ri:  # another region's loose output
                    held_keys.add(vk)
        held = sum(sb[k] for k in held_keys)
        # recipes registered inside the region and saved outside it (a batch norm -> ReLU chain closing the
        # region): recomputed (any choice but keep), the body runs with the recipe scope aside
        # (fxmem.nn.recast.aside), so those outputs are plain tensors their savers keep from the region's forward
        # to their backward: the region frees that much less. The same for a recipe output made inside that a
        # recipe made outside holds nested (a cat's upsampling convolution): that recipe holds it as a plain tensor
        def kept_outside(k: int) -> bool:
            return any(i not in idxs for i in recast_savers.get(k, ())) or any(
                recipe_at.get(j) not in names and (recast_savers.get(j) or holders.get(j))
                for j in holders.get(k, ()))
        lost = 0
        for k, at in recipe_at.items():
            if at in names and base_keys.get(k) is None and kept_outside(k):
                lost += sb[k]
        reg.lost = lost
        reg.sel_blocked = _kept_then_written(ix, sac_made)
        reg.saved = sum(sb[k] for k in saved)
        reg.kept = sum(sb[k] for k in kept)
        reg.kept_full = sum(sb[k] for k in kept_full)
        reg.keep_full = keep_rng
        reg.held = held
        reg.flops, reg.flops_sel = float(flops), float(flops_sel)
        reg.flops_redraw = float(flops + draws_cost)
        reg.inputs = ins
        reg.keep_sel = keep_sel
        reg.span = (min(idxs), max(idxs)) if idxs else ()


@dataclass
class RegionModel:
    """Nested prefix constraints: for k = 0..n, sum of freed over regions[:k] >= need[k]."""
    regions: list[CandidateRegion]
    live_by_prefix: list[int]  # max baseline live bytes over points with k regions before them
    floor: int  # peak of points no region can help (optimizer step, ...)
    floor_at: str
    choices: list[tuple[str, ...]]  # allowed choices per region
    # bytes all regions together must free: the activations left at the end of forward (after every region's
    # forward, so the last prefix) above an activation budget
    act_need: int = 0
    # per region: baseline live bytes in backward just before the region's recomputation would run; a recomputed
    # region adds its `spike` there, less what the regions before it free (empty: not modelled)
    spike_base: list = field(default_factory=list)
    # answers a planner finds once per model (the checkpoint pass's lowest planned peak); a copy with another
    # act_need (`dataclasses.replace`) shares them
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def needs(self, budget: int) -> list[int]:
        out = [max(0, lv - budget) for lv in self.live_by_prefix]
        out[-1] = max(out[-1], self.act_need)
        return out

    def spike_needs(self, budget: int) -> list[dict]:
        """Per region: choice -> bytes the regions before it must free for that choice's recomputation to stay
        within `budget` (choices whose recomputation stays within it anyway are left out)."""
        out: list[dict] = [{} for _ in self.regions]
        for k, base in enumerate(self.spike_base):
            for c, extra in self.regions[k].spike.items():
                need = base + extra - budget
                if c != "keep" and extra > 0 and need > 0:
                    out[k][c] = need
        return out

    def freed(self, plan: list[str]) -> int:
        return sum(r.freed(c) for r, c in zip(self.regions, plan))

    def max_freed(self) -> int:
        return sum(max(r.freed(c) for c in ch) for r, ch in zip(self.regions, self.choices))

    def fits(self, plan: list[str], budget: int) -> bool:
        return self.peak(plan) <= budget and self.freed(plan) >= self.act_need

    def peak(self, plan: list[str], spikes: bool = True) -> int:
        """The plan's planned peak (spikes=False: leaving the recomputations' spikes out)."""
        freed = 0
        best = self.floor
        for k, lv in enumerate(self.live_by_prefix):
            if k:
                freed += self.regions[k - 1].freed(plan[k - 1])
            best = max(best, lv - freed)
            if spikes and k < len(self.spike_base) and plan[k] != "keep":  # region k's recomputation, regions[:k] freed
                best = max(best, self.spike_base[k] + self.regions[k].spike.get(plan[k], 0) - freed)
        return best

    def cost(self, plan: list[str]) -> float:
        return sum(r.cost(c) for r, c in zip(self.regions, plan))

    def max_plan(self) -> list[str]:
        return [max(ch, key=lambda c, r=r: r.freed(c)) for r, ch in zip(self.regions, self.choices)]

    def min_peak(self) -> int:
        """The planned peak of the plan freeing the most in every region: the lowest of any plan when no
        recomputation spikes (a planner finds the lowest otherwise: the checkpoint pass's `lowest`)."""
        return self.peak(self.max_plan())


def build_region_model(est, regions: list[CandidateRegion], program: Program, choices, traced=None) -> RegionModel:
    """Map the baseline timeline onto prefixes of the region chain. With `traced` (the trace the regions were
    measured on), also each recomputation's spike: the baseline's live bytes in backward just before it runs, and
    per choice what it adds there (`RecomputeWalk`)."""
    pos = {n.name: i for i, n in enumerate(program.graph.nodes)}
    lasts = [r.last for r in regions]
    n = len(regions)
    live = [0] * (n + 1)
    floor, floor_at = 0, ""
    end = len(pos) + 1

    def at_of(p):  # a timeline point's position in the graph (the loss after every node; None: not a node's)
        return pos.get(p.label, end if p.label == "loss" else None)
    for p in est.timeline:
        if p.phase == "optimizer":
            if p.peak > floor:
                floor, floor_at = p.peak, p.label
            continue
        at = at_of(p)
        if at is None:
            if p.peak > floor:
                floor, floor_at = p.peak, p.label
            continue
        k = bisect.bisect_left(lasts, at)  # regions whose last node is before `at`
        live[k] = max(live[k], p.peak)
    if traced is None or not all(r.span for r in regions):
        return RegionModel(regions, live, floor, floor_at, choices)
    # backward runs from the last node to the first: region k recomputes when it reaches its last node that saves
    # a tensor (the first unpack), with what the backward of the nodes after it left live (gradients made in the
    # region's own nodes after that one too): `spike_base`. And the region's own backward after it (`inner`): the
    # baseline there, with what the recomputation left that the baseline does not hold on top (recipe saves made
    # plain, inputs made again: each until the backward of the first node saving it) and the inputs the region
    # holds until its backward is done
    walk = RecomputeWalk.of(traced)
    runs = [pos[walk.runs_in(*r.span)] for r in regions]
    firsts = [r.first for r in regions]
    spike_base = [0] * n
    inner: list[list] = [[] for _ in range(n)]  # region -> [(position, the baseline's peak there)]
    prev, k = 0, n - 1
    for p in est.timeline:
        at = at_of(p) if p.phase == "backward" else None
        if at is not None:
            while k >= 0 and at <= runs[k]:
                spike_base[k] = prev
                k -= 1
            j = bisect.bisect_right(firsts, at) - 1
            if j >= 0 and at <= runs[j]:
                inner[j].append((at, p.peak))
        if p.phase != "optimizer":
            prev = p.live
    for j in range(k + 1):
        spike_base[j] = prev
    # the draws a region keeps its draw tape holds until the region's backward is done; the baseline frees each in
    # the backward of the first op saving it (the dropout's mask multiply), earlier in the region's backward
    savers = _RegionIndex.of(walk.rec).savers

    def freed_at(key: int) -> int:  # where the baseline frees a saved tensor: its first saver's backward
        return pos[walk.R[savers[key][0]].node] if key in savers else end
    # what region k's recomputation adds there: what it holds at its highest, less what the baseline has live of
    # the region's saves (what it recomputes instead of keeping); its held inputs and kept draws stay on top. (Its
    # "lost" outputs, plain tensors savers after it keep, are gone by then: their backward ran first.)
    for k, (reg, ch) in enumerate(zip(regions, choices)):
        reg.spike = {}
        for c in ch:
            if c != "keep":
                ks, kept = reg.keeps(c)
                over, leaves, extra = walk.over(*reg.span, frozenset(ks))
                tape_ops = frozenset(ks) & DRAW_OPS
                tape = [(freed_at(key), walk.rec.storage_bytes[key])
                        for r in walk.R[reg.span[0]:reg.span[1] + 1] if names_op(r.func, tape_ops)
                        for key in r.new_keys if walk.base_keys.get(key) is None] if tape_ops else []
                after = max((peak + sum(b for node, b in extra if pos[node] < at)
                             + sum(b for saver, b in tape if at < saver) for at, peak in inner[k]), default=0)
                reg.spike[c] = max(0, over + leaves - max(0, reg.saved - kept - reg.held),
                                   after + reg.held - spike_base[k])
    return RegionModel(regions, live, floor, floor_at, choices, spike_base=spike_base)


# ============================================================================================ batch planning

@keeps_model_state
def plan_batch(model_or_program, args=(), kwargs=None, *, budget: int, mode: str | None = None,
               optimizer: str = "adamw", loss_fn=None, batch_dim: int = 0, device: str = "cpu",
               context_bytes: int | None = None, fragmentation: float | None = None, max_batch: int = 1 << 16,
               method: str = "static") -> dict:
    """The largest batch size whose estimated peak fits `budget` bytes.

    Reserve: on CUDA 500 MB for the context and 10% for fragmentation by default; on CPU none.
    Inputs are scaled along `batch_dim` (every tensor input whose size there equals the example's batch).
    Returns {"batch": n, "peak": bytes, "usable": bytes, "per_sample": bytes}.
    """
    if context_bytes is None:
        context_bytes = 500 * 10 ** 6 if str(device).startswith("cuda") else 0
    if fragmentation is None:
        fragmentation = 0.10 if str(device).startswith("cuda") else 0.0
    usable = int((budget - context_bytes) * (1.0 - fragmentation))
    program = _as_program(model_or_program, args, kwargs, mode or "train")
    args, kwargs = (args or program.example_args), (kwargs or program.example_kwargs)
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    b0 = next((t.shape[batch_dim] for t in flat if isinstance(t, torch.Tensor) and t.dim() > batch_dim), None)
    if b0 is None:
        raise ValueError("no tensor input has a batch dim to scale")

    def at(n: int) -> int:
        scaled = []
        for t in flat:
            if isinstance(t, torch.Tensor) and t.dim() > batch_dim and t.shape[batch_dim] == b0:
                idx = torch.arange(n) % b0
                scaled.append(t.index_select(batch_dim, idx))
            else:
                scaled.append(t)
        a, k = pytree.tree_unflatten(scaled, spec)
        return estimate(program, a, k, mode=mode, optimizer=optimizer, method=method, loss_fn=loss_fn).peak

    p1 = at(1)
    if p1 > usable:
        return {"batch": 0, "peak": p1, "usable": usable, "per_sample": None}
    p2 = at(2)
    per = max(1, p2 - p1)
    guess = max(1, min(max_batch, 1 + (usable - p1) // per))
    # verify and walk down if the linear guess was optimistic
    lo, hi = 1, guess
    while hi > lo:
        pk = at(hi)
        if pk <= usable:
            break
        hi = max(lo, int(hi * 0.9) if hi > 20 else hi - 1)
    return {"batch": hi, "peak": at(hi), "usable": usable, "per_sample": per}
