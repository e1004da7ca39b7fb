"""Low-precision copies of parameters (and inputs) that autograd does not keep: backward casts them again.

With fp32 master parameters and bf16/fp16 compute (autocast semantics), every matmul saves the low-precision copy
of its weight for backward, so a training step holds a second, half-size copy of the weights from forward to
backward. Those copies are a pure function of the parameter, which stays alive anyway: saving the parameter and
casting it again in backward frees the copies at once, for the cost of one cast per use, with bit-identical
gradients (the cast is deterministic and the parameter does not change between forward and backward: checked
with its version counter, an in-place change in between is an error, as autograd's own saved tensors would be).
The same holds for the step's inputs, which the caller holds during the step: a cast of a graph input is
recast too (otherwise the low-precision copy of an image batch would be a new activation the fp32 graph never
had).

How: the precision pass emits `cast_param(weight, dtype)` instead of `aten._to_copy` for parameter casts and
calls `install(module)`. While the module's forward runs, a `RecastScope` is the innermost
`saved_tensors_hooks`: a tensor whose storage is one that `cast_param` created in this forward is packed as
(parameter, dtype, view geometry) and unpacked by casting again; every other tensor is saved as usual. The
scope is entered by a forward pre-hook and left by an always-called forward hook (also when forward raises).
Inside regions with their own hooks (checkpoint, offload) those hooks are innermost and decide, as they should.
Under torch.compile the hooks and the registration step aside (no graph breaks): the compiled graph's
partitioner decides what it saves and recomputes casts by itself. `remat` and `remat_call` (below) are the
exception: there they become checkpoints, which tag their outputs for the partitioner to recompute.

The cost model reads `installed(module)` and leaves the outputs of `cast_param` nodes out of what is saved.

Rematerialisation (`remat`), the same mechanism for activations. Some activations are cheap functions of
tensors autograd keeps anyway: GELU's output (its input is saved by GELU itself), dropout's output (its input,
a softmax output, is saved by the softmax, and its bool mask by the multiply), a layer norm's output (input,
weight and bias are saved by the norm). A matmul that consumes such an activation saves it, holding a second
tensor of the same size from forward to backward. The checkpoint pass rewrites `y = op(*args)` as
`y = remat(op(*args), 'aten.op.overload', *args)`: the consumer's saved copy of `y` is packed as the recipe (op,
args, view geometry) and unpacked by running the op again under no_grad, for the cost of one cheap op per use in
backward (once for all uses when the pass marks them as running back to back), with bit-identical values (the op is
deterministic; an input changed in place in between is an error, as for casts). This is what torch.compile's
partitioner does for pointwise ops, without a compiler and without the dispatch-mode overhead of selective
checkpointing in eager mode. Under torch.compile, `remat` runs the op again inside a one-op non-reentrant
checkpoint; the partitioner recomputes what checkpoint tags, so the compiled module keeps what the pass planned
instead of what the compiler's own budget keeps (benchmarks/checkpoint_pareto.py, gpt at 0.7: 61.2 vs 77.8 MiB
saved, same step time). A `remat_call` chain is recomputed in one checkpoint at its last node (one checkpoint per
member would not do: the partitioner keeps any value passed from one checkpoint to the next); a training-mode batch
norm is checkpointed without running statistics, which the graph's own op updates once (U-Net at 0.7: 12.0 vs 16.8
MiB saved). `fxmem.nn.dropout` registers its masked outputs the same way (`register_recompute`).

`remat_call(op, *args)` is the form for ops that save their own output (ReLU keeps its result) and for chains: it
runs the op while the scope defers the op's own saves, registers the recipe, then packs those saves as it. A tensor
argument that is itself a recipe's output is held as that recipe (nested), so conv -> batch norm -> ReLU keeps
neither the norm's nor the ReLU's output: backward recomputes ReLU(batch_norm(conv output)) from the conv output,
which the norm saves anyway. A training-mode batch norm is recomputed without running statistics (updated once, in
forward; the output is bit-identical); on CPU, from the batch statistics the forward computed (`batch_norm_affine`:
x * alpha + beta per channel, one pass over x instead of three), wherever that was seen to give the kernel's output
bit for bit. Max pooling's own save of its argmax indices (`INTERNAL_SAVES`) becomes a recipe too, the full op run
again for that output; where the pooled output's unpack and the pooling's own run back to back (`_fxmem_group`),
one shared run of the full op makes both, held from the first unpack to the last. A nested recipe that is shared
can be used through its shared value (`_fxmem_nest`, where the pass saw the holder's unpacks next to the nested
recipe's saves): each recomputation of the holder counts as one more use, so a max pooling's output, its indices,
its input and the ReLU's result make the ReLU once. A registered output changed in place afterwards is saved as it
is (the recipe would give the old values). Inside checkpoint and offload regions the scope steps aside (`aside`):
the region's hooks decide there, and a recipe would hold arguments the region frees. Inputs of a non-reentrant
checkpoint region are saved through the hooks outside it, so a region input that is a recipe's output is kept as
the recipe, made again by and for the region's recomputation alone (never through a shared value, which it would
hold from the region's backward to some other save's).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

_state = threading.local()


def _stack() -> list:
    s = getattr(_state, "stack", None)
    if s is None:
        s = _state.stack = []
    return s


def _leave(entry) -> None:
    """Pop `entry` (a scope, or None for `aside`) if it is the innermost: leaving what was entered."""
    s = _stack()
    if s and s[-1] is entry:
        s.pop()


def active_scope():
    """The scope registrations go to: the innermost entered one, None outside forward or inside a region."""
    s = _stack()
    return s[-1] if s else None


class aside:
    """While a checkpoint or offload region's body runs, its own saved-tensor hooks decide what is kept, and
    nothing registers here: a recipe holds its arguments, which inside a region are not kept otherwise (the
    cost model likewise leaves regions' insides to the region)."""

    def __enter__(self):
        _stack().append(None)
        return self

    def __exit__(self, *exc):
        _leave(None)
        return False


class observing:
    """While active (this thread), `callback(tensors)` is called with what each save a RecastScope packs keeps: the
    tensor itself, a parameter cast's parameter, or a recipe's tensor arguments (nested recipes' too). A scope's
    hooks are the innermost saved-tensor hooks in its forward, so hooks outside never see those saves;
    `fxmem.measure.saved_tensors` counts them through this."""

    def __init__(self, callback):
        self.callback = callback

    def __enter__(self):
        self._prev = getattr(_state, "observer", None)
        _state.observer = self.callback
        return self

    def __exit__(self, *exc):
        _state.observer = self._prev
        return False


def observe_held(tensors) -> None:
    """For modules that keep tensors for backward outside saved-tensor hooks (a checkpoint region's cached
    selective outputs and dropout masks): report them to the observer, if one is active."""
    cb = getattr(_state, "observer", None)
    if cb is not None:
        cb([t for t in tensors if isinstance(t, torch.Tensor)])


def observed() -> bool:
    return getattr(_state, "observer", None) is not None


def _observe(packed) -> None:
    """Tell the observer (if any) what a finished pack keeps."""
    cb = getattr(_state, "observer", None)
    if cb is None or isinstance(packed, _Deferred):
        return
    if isinstance(packed, _Remat):
        cb(recipe_tensors(packed.recipe))
    elif isinstance(packed, _Recast):
        cb([packed.param])
    elif isinstance(packed, torch.Tensor):
        cb([packed])


def _calls() -> list:
    """Scopes entered by forward pre-hooks on this thread, innermost last (nested fxmem modules)."""
    c = getattr(_state, "calls", None)
    if c is None:
        c = _state.calls = []
    return c


def cast_param(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`p.to(dtype)`; inside an active RecastScope the copy is recast in backward instead of being saved."""
    out = p.to(dtype)
    if torch.compiler.is_compiling():
        return out  # a compiled graph's partitioner decides what it saves (and recomputes casts itself)
    scope = active_scope()
    if scope is not None and out is not p:
        scope.register(out, p, dtype)
    return out


torch.fx.wrap("cast_param")

def op_named(op: str):
    """'aten.gelu.default' (`str` of an overload) -> torch.ops.aten.gelu.default; no cache, dynamo traces it."""
    ns, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


_OPS: dict[str, object] = {}


def _resolve(op: str):
    """op_named, cached (eager only)."""
    fn = _OPS.get(op)
    if fn is None:
        fn = _OPS[op] = op_named(op)
    return fn


def register_recompute(out: torch.Tensor, fn, args: tuple, kwargs: dict | None = None, share: bool = False) -> None:
    """Inside an active RecastScope, save `out` as the recipe fn(*args, **kwargs) (run again in backward; `share`:
    once for all its saves, see `remat`)."""
    if torch.compiler.is_compiling():
        return
    scope = active_scope()
    if scope is not None and isinstance(out, torch.Tensor):
        scope.register_recipe(out, fn, tuple(args), dict(kwargs or {}), share)


def remat(y: torch.Tensor, op: str, *args, _fxmem_share: bool = False, **kwargs) -> torch.Tensor:
    """`y`, which is `op(*args, **kwargs)` (an aten overload by name): saved for backward as that recipe.

    `_fxmem_share` (the checkpoint pass sets it when the ops that save `y` run their backward one after another):
    backward runs the op once for all of them, the value held from the first unpack to the last, instead of once
    per save. A save that is never unpacked (a partial backward) leaves the value held until autograd frees the
    graph.

    Under torch.compile (training) the op runs again inside a one-op non-reentrant checkpoint instead: that tags
    its output for recomputation, so the compiler's partitioner recomputes it in backward (fused into the backward
    kernels) rather than deciding alone at its own memory budget, which kept it; `y` goes dead and the compiler
    drops it."""
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled():
            # (y's op already updated any running statistics: the checkpointed one must not again)
            return checkpoint(op_named(op), *_stats_free(op, args), use_reentrant=False, **kwargs)
        return y
    if active_scope() is not None:
        register_recompute(y, *recompute_form(op, args, kwargs), share=_fxmem_share)
    return y


torch.fx.wrap("remat")


def recompute_form(op: str, args: tuple, kwargs: dict) -> tuple:
    """How backward recomputes `op(*args, **kwargs)`: a training-mode batch norm without running statistics
    (they are updated once, in forward; the output depends only on the batch statistics, bit-identical with or
    without them)."""
    return _resolve(op), _stats_free(op, args), kwargs


def _stats_free(op: str, args: tuple) -> tuple:
    """A training-mode batch norm's arguments without its running statistics (the same output); `args` itself when
    there are none to leave out (callers test identity: not `args` means the op updates statistics)."""
    if op.split(".")[1] == "batch_norm" and len(args) > 5 and args[5] is True and \
            (args[3] is not None or args[4] is not None):
        return args[:3] + (None, None) + args[5:]
    return args


def batch_norm_affine(x: torch.Tensor, weight, bias, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """A training-mode batch norm's output from its batch statistics, as the CPU kernel forms it: per channel
    alpha = invstd * weight and beta = bias - mean * alpha, then x * alpha + beta, each a fused multiply-add
    (addcmul; weight 1 and bias 0 when absent). One pass over x, where recomputing the norm passes over x twice
    more for the statistics (mean, then variance). Used only where `_affine_reproduces` has seen it give the
    kernel's output bit for bit."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    alpha = invstd if weight is None else invstd * weight
    beta = torch.addcmul(torch.zeros_like(mean) if bias is None else bias, mean, alpha, value=-1)
    return torch.addcmul(beta.view(shape), x, alpha.view(shape))


def _affine_recomputable(op: str, args: tuple, kwargs: dict) -> bool:
    """A training-mode `aten.batch_norm` on plain CPU tensors: its output can be recomputed from the batch
    statistics (`batch_norm_affine`) instead of by the norm. On CPU `batch_norm` runs `native_batch_norm`, which
    returns those statistics; elsewhere (cuDNN) the kernels differ, so the norm is recomputed as before."""
    if op != "aten.batch_norm.default" or kwargs or len(args) != 9 or args[5] is not True:
        return False
    x = args[0]
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() >= 2 and x.numel() > 0 and \
        all(a is None or isinstance(a, torch.Tensor) for a in args[1:5])


# (device, dtypes, shape, strides, affine) -> whether batch_norm_affine gave the kernel's output bit for bit
_AFFINE_EXACT: dict[tuple, bool] = {}


def _affine_reproduces(y, x, weight, bias, mean, invstd) -> bool:
    """Whether `batch_norm_affine` reproduces `y` exactly for tensors laid out as these: checked once per layout on
    the real output (the kernel's arithmetic, fused multiply-adds or not, depends on the build and the CPU; a
    layout it does not cover, e.g. a non-contiguous input, takes another code path). Under a fake-tensor trace
    (the cost model) nothing can be compared and the recipe's memory is the same either way: taken as reproduced."""
    if isinstance(y, FakeTensor):
        return True
    if type(y) is not torch.Tensor or type(x) is not torch.Tensor:
        return False
    key = (x.device.type, x.dtype, mean.dtype, tuple(x.shape), tuple(x.stride()), None if weight is None else
           weight.dtype, None if bias is None else bias.dtype)
    ok = _AFFINE_EXACT.get(key)
    if ok is None:
        with torch.no_grad():
            ok = _AFFINE_EXACT[key] = bool(torch.equal(batch_norm_affine(x, weight, bias, mean, invstd), y))
    return ok


def remat_call(op: str, *args, _fxmem_chain=None, _fxmem_share: bool = False, _fxmem_nest: tuple = (),
               _fxmem_group: bool = False, **kwargs) -> torch.Tensor:
    """`op(*args, **kwargs)` (an aten overload by name) whose output autograd keeps as a recipe, every save of it:
    the op's own (ReLU saves its result), made while it runs, and later consumers'. Tensor arguments that are
    themselves recipes are kept as recipes, not tensors, so a chain such as batch norm -> ReLU recomputes from the
    batch norm's input (which the norm saves anyway) and neither output is kept. `remat(y, ...)` is the cheaper
    form for ops that save only their inputs. An in-place op (relu_) on a chained output stays in place, in
    forward and in the recomputation, which writes into the member's freshly recomputed output. `_fxmem_share`:
    as for `remat`. `_fxmem_nest`: positions among the flattened `args` (list elements in their place) of nested
    recipes this one uses through their shared value (the pass sets it where this recipe is recomputed right next to
    the nested one's own saves, so the nested one runs once for all of them; see `RecastScope.as_recipe_args`).
    `_fxmem_group` (an op with INTERNAL_SAVES whose output's and own saves are unpacked back to back): the full op
    runs once for both, its outputs held from the first unpack to the last (`_Pick` of a shared recipe).

    Under torch.compile the chain's last node recomputes the whole chain (`_fxmem_chain`: each member's op, its
    arguments with "@i" for member i's output, and kwargs) inside one checkpoint, whose values the partitioner
    then recomputes; the members before it run as plain ops (their outputs go dead). One checkpoint per member
    would not do: the partitioner keeps a value passed from one checkpoint to the next."""
    if torch.compiler.is_compiling():
        fn = op_named(op)
        if _fxmem_chain is None or not torch.is_grad_enabled():
            return fn(*args, **kwargs)  # a member before the chain's last, or no backward to plan for
        if _stats_free(op, args) is not args:
            fn(*args, **kwargs)  # a batch norm's running-statistics update, once (the output goes dead)
        return checkpoint(_run_chain, _fxmem_chain, use_reentrant=False)
    scope = active_scope()
    if scope is None:
        return _resolve(op)(*args, **kwargs)
    # before the op: an in-place op's output reuses its input's storage
    rargs = scope.as_recipe_args(args, _fxmem_nest)
    pending: list = []
    prev, scope._pending = scope._pending, pending
    stats = None
    try:
        if _affine_recomputable(op, args, kwargs):
            y, mean, invstd = torch.ops.aten.native_batch_norm.default(*args[:8])  # what batch_norm runs on CPU
            stats = (mean, invstd)
        else:
            y = _resolve(op)(*args, **kwargs)
    finally:
        scope._pending = prev
    if isinstance(y, torch.Tensor) and not any(
            isinstance(a, torch.Tensor) and a.untyped_storage()._cdata == y.untyped_storage()._cdata for a in rargs):
        # (an op that wrote its plain input in place would be recomputed from its own output: saved as usual)
        if stats is not None and _affine_reproduces(y, args[0], args[1], args[2], *stats):
            fn, rargs, rkwargs = batch_norm_affine, (rargs[0], args[1], args[2]) + stats, {}
        else:
            fn, rargs, rkwargs = recompute_form(op, rargs, dict(kwargs))
        internal = INTERNAL_SAVES.get(op)
        own = []
        if internal is not None:
            # a composite op's own save of a tensor it made besides its output (max pooling's indices): a recipe
            # too, the op's full form run again for that output
            known = {a.untyped_storage()._cdata for a in (y, *_arg_tensors(args))}
            own = [t for t in (d.value for d in pending)
                   if isinstance(t, torch.Tensor) and t.dtype == internal[2] and t.shape == y.shape and
                   t.untyped_storage()._cdata not in known and scope.recipe_for(t) is None][:1]
        if own and _fxmem_group:
            # one run of the full op for both, shared: each output a pick of it
            whole = _Recipe(_resolve(internal[0]), rargs, dict(kwargs),
                            tuple(a._version for a in _arg_tensors(rargs)), None, share=True)
            for i, t in ((0, y), (internal[1], own[0])):
                part = _Remat(whole, None, None, None)
                part.how = "shared"
                scope.register_recipe(t, _Pick(i), (part,), {})
        else:
            scope.register_recipe(y, fn, rargs, rkwargs, _fxmem_share)
            for t in own:
                scope.register_recipe(t, _output_of(internal[0], internal[1]), rargs, dict(kwargs))
    for d in pending:  # the op's own saves, packed now that its output is a recipe
        d.value = scope._pack_now(d.value, count=True)
        _observe(d.value)
    return y


# ops whose backward saves a tensor of their own making besides the output: op -> (the full op, which output,
# its dtype); max pooling keeps its argmax indices (int64: twice a float32 output's bytes)
INTERNAL_SAVES = {
    "aten.max_pool2d.default": ("aten.max_pool2d_with_indices.default", 1, torch.int64),
    "aten.max_pool3d.default": ("aten.max_pool3d_with_indices.default", 1, torch.int64),
}


class _output_of:
    """Output `i` of the op named `op` (a recipe's function: the indices of max_pool2d_with_indices)."""
    __slots__ = ("op", "i", "__name__")

    def __init__(self, op: str, i: int):
        self.op, self.i, self.__name__ = op, i, f"{op}[{i}]"

    def __call__(self, *args, **kwargs):
        return _resolve(self.op)(*args, **kwargs)[self.i]


class _Pick:
    """Output `i` of a tuple (a recipe's function: one output of a shared run of a multi-output op)."""
    __slots__ = ("i", "__name__")

    def __init__(self, i: int):
        self.i, self.__name__ = i, f"output {i}"

    def __call__(self, outputs):
        return outputs[self.i]


def group_of(recipe: "_Recipe"):
    """The shared recipe whose outputs `recipe` picks one of (a grouped max pooling's), None if none."""
    if isinstance(recipe.fn, _Pick) and isinstance(recipe.args[0], _Remat) and recipe.args[0].how == "shared":
        return recipe.args[0].recipe
    return None


torch.fx.wrap("remat_call")


def op_call(target, args: tuple) -> tuple:
    """(op, args) a graph call of `target` with `args` runs: `remat_call('aten.relu_.default', x)` runs aten.relu_
    on (x,), which writes x in place; other targets run themselves. Graph analyses that read an op's schema (does
    it write an input in place?) look through remat_call with this."""
    if target is remat_call:
        return _resolve(args[0]), tuple(args[1:])
    return target, tuple(args)


def _run_chain(chain: tuple) -> torch.Tensor:
    """A remat_call chain's ops in order ("@i" arguments: member i's output), batch norms without running
    statistics; the last member's output."""
    outs: list = []
    for op, args, kwargs in chain:
        args = _map_args(args, lambda a: outs[int(a[1:])] if isinstance(a, str) and a[:1] == "@" else a)
        outs.append(op_named(op)(*_stats_free(op, args), **kwargs))
    return outs[-1]


class RecastScope:
    """saved_tensors_hooks that save registered parameter casts as their parameter (see the module docstring)."""

    def __init__(self):
        # storage id -> (weakref to the storage, parameter, dtype) or (weakref, _Recipe)
        self._entries: dict[int, tuple] = {}
        self._hooks = None
        self._pending: list | None = None  # while remat_call runs its op: that op's saves, packed after it

    def _add(self, out: torch.Tensor, entry: tuple) -> None:
        st = out.untyped_storage()
        key = st._cdata
        entries = self._entries
        # the storage object is preserved while the storage lives; when it dies the entry goes with it, so a
        # later tensor that reuses the address is never mistaken for the cast
        ref = weakref.ref(st, lambda _r, key=key: entries.pop(key, None))
        entries[key] = (ref,) + entry

    def register(self, out: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> None:
        self._add(out, (p, dtype))

    def register_recipe(self, out: torch.Tensor, fn, args: tuple, kwargs: dict, share: bool = False) -> None:
        """`out` saved as fn(*args, **kwargs). An in-place op's output (the storage of a recipe registered before,
        e.g. relu_ on a batch norm's output) replaces that entry: `args` hold the earlier recipe, nested."""
        self._add(out, (_Recipe(fn, args, kwargs, tuple(t._version for t in _arg_tensors(args)), out._version,
                                share),))

    def recipe_for(self, t: torch.Tensor):
        """The recipe t would be saved as (None: saved as it is, or a parameter cast)."""
        p = self._pack_now(t)
        return p.recipe if isinstance(p, _Remat) else None

    def recipe_of_storage(self, key: int):
        """The recipe registered for the storage with this `_cdata` (None: none)."""
        e = self._entries.get(key)
        return e[1] if e is not None and len(e) == 2 and e[0]() is not None else None

    def as_recipe_args(self, args: tuple, nest: tuple = ()) -> tuple:
        """`args` with every tensor that is a registered recipe's output replaced by that recipe (nested), also
        inside list arguments (cat, stack). A nested shared recipe at a flat position in `nest` is used through its
        shared value (made once for its saves and these uses, see `remat`), counted when the holder's saves are."""
        if not self._entries:
            return tuple(args)
        at = itertools.count()  # flat positions, in `_map_args`'s order

        def one(a):
            i = next(at)
            p = self._pack_now(a) if isinstance(a, torch.Tensor) else a
            if not isinstance(p, _Remat):
                return a
            if i in nest and p.recipe.share:
                p.how = "shared"
            return p
        return _map_args(args, one)

    def _pack(self, t: torch.Tensor):
        if self._pending is not None:
            d = _Deferred(t)
            self._pending.append(d)
            return d  # (observed once remat_call packs it)
        if active_scope() is None:
            # inside a checkpoint or offload region (`aside`): non-reentrant checkpoint saving the region's inputs.
            # A recipe there is made again by and for the region's recomputation alone, not through a shared value
            # (held from the region's recomputation to some other save's unpack, far from both)
            p = self._pack_now(t)
            if isinstance(p, _Remat):
                p.how = "private"
        else:
            p = self._pack_now(t, count=True)
        _observe(p)
        return p

    def _pack_now(self, t: torch.Tensor, count: bool = False):
        """What `t` is saved as; `count`: a save autograd will unpack (shared recipes count their uses)."""
        if not self._entries:
            return t
        st = t.untyped_storage()
        e = self._entries.get(st._cdata)
        if e is None or e[0]() is not st:
            return t
        if len(e) == 2:  # a recipe
            r = e[1]
            if t._version != r.out_version:
                return t  # changed in place since (the recipe would give the old values): saved as it is
            if count:
                _count_use(r)
            return _Remat(r, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        return _Recast(e[1], e[2], tuple(t.shape), tuple(t.stride()), t.storage_offset(), e[1]._version)

    @staticmethod
    def _unpack(x):
        if isinstance(x, _Deferred):
            x = x.value
        if isinstance(x, _Remat):
            r = x.recipe
            with torch.no_grad():
                if x.how == "private":
                    return _recompute(r, private=True).as_strided(x.shape, x.stride, x.offset)
                if not r.share:
                    return _materialize(x)
                return _shared_value(r).as_strided(x.shape, x.stride, x.offset)
        if isinstance(x, _Recast):
            if x.param._version != x.version:
                raise RuntimeError(
                    "fxmem recast: a parameter or input whose low-precision copy backward needs was modified in "
                    "place between forward and backward (e.g. optimizer.step() before loss.backward()); "
                    f"shape {tuple(x.param.shape)}, version {x.version} -> {x.param._version}")
            with torch.no_grad():
                full = x.param.to(x.dtype)
                return full.as_strided(x.shape, x.stride, x.offset)
        return x

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _leave(self)
        hooks, self._hooks = self._hooks, None
        self._entries = {}
        if hooks is not None:
            hooks.__exit__(*exc)
        return False


class _Recast:
    __slots__ = ("param", "dtype", "shape", "stride", "offset", "version")

    def __init__(self, param, dtype, shape, stride, offset, version):
        self.param, self.dtype, self.shape, self.stride, self.offset = param, dtype, shape, stride, offset
        self.version = version


class _Recipe:
    __slots__ = ("fn", "args", "kwargs", "versions", "out_version", "share", "saves", "value")

    def __init__(self, fn, args, kwargs, versions, out_version, share=False):
        self.fn, self.args, self.kwargs, self.versions = fn, args, kwargs, versions
        self.out_version = out_version  # the output's version when registered
        self.share = share  # recomputed once for all its saves (see `remat`)
        self.saves = 0  # shared: saves not unpacked yet
        self.value = None  # shared: the recomputed output, between the first unpack and the last


class _Remat:
    """A saved (or nested) recipe's output, viewed as the tensor was (shape None: every output of a multi-output
    recipe, as they are). `how`: "" recomputed (through the shared value when the recipe is shared), "shared" a
    nested use of a shared recipe's value, "private" made again for a region's recomputation alone (nested recipes
    too)."""
    __slots__ = ("recipe", "shape", "stride", "offset", "how")

    def __init__(self, recipe, shape, stride, offset):
        self.recipe, self.shape, self.stride, self.offset = recipe, shape, stride, offset
        self.how = ""


class _Deferred:
    """A save made while remat_call's op runs; `value` becomes what the scope packs once the output is a recipe."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def recipe_tensors(recipe: _Recipe) -> list[torch.Tensor]:
    """The tensors a recipe holds: its tensor arguments and, through nested recipes, theirs."""
    out: list[torch.Tensor] = []
    for a in flat_args(recipe.args):
        if isinstance(a, _Remat):
            out.extend(recipe_tensors(a.recipe))
        elif isinstance(a, torch.Tensor):
            out.append(a)
    return out


def nested_recipes(recipe: _Recipe, shared: bool | None = None) -> list[_Recipe]:
    """The recipes `recipe` holds as arguments (its arguments that are recipes' outputs), not through them; `shared`
    True: only those it uses through their shared value, False: only the others."""
    return [a.recipe for a in flat_args(recipe.args) if isinstance(a, _Remat)
            and (shared is None or (a.how == "shared") == shared)]


def _count_use(r: _Recipe) -> None:
    """Backward will use r's output once more: a shared recipe counts the use (made once, held until its last);
    a recomputation of r uses its nested recipes, so theirs are counted with r's first."""
    if r.share:
        r.saves += 1
        if r.saves > 1:
            return
    _count_nested(r)


def _count_nested(r: _Recipe) -> None:
    """One recomputation of r: its nested shared uses count, its other nested recipes are recomputed with it."""
    for a in flat_args(r.args):
        if isinstance(a, _Remat):
            if a.how == "shared":
                _count_use(a.recipe)
            else:
                _count_nested(a.recipe)


def _shared_value(r: _Recipe) -> torch.Tensor:
    """A shared recipe's output: recomputed at its first use, held until its last (`saves` counts them down)."""
    value = r.value if r.value is not None else _recompute(r)
    r.saves -= 1
    r.value = value if r.saves > 0 else None
    return value


def flat_args(args: tuple) -> list:
    """Arguments with the elements of list arguments (cat, stack) in their place."""
    out: list = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _arg_tensors(args: tuple) -> list[torch.Tensor]:
    return [a for a in flat_args(args) if isinstance(a, torch.Tensor)]


def _map_args(args: tuple, f) -> tuple:
    """`args` with `f` applied to each argument, and inside list arguments (cat, stack) to each element."""
    return tuple(type(a)(f(t) for t in a) if isinstance(a, (list, tuple)) else f(a) for a in args)


def _materialize(x: _Remat) -> torch.Tensor:
    """Run x's recipe again (nested recipes first) and view the result as the saved tensor was viewed."""
    return _recompute(x.recipe).as_strided(x.shape, x.stride, x.offset)


def _recompute(r: _Recipe, private: bool = False) -> torch.Tensor:
    """r's output, computed again (nested recipes first: those used through a shared value take it, unless
    `private`, a region's recomputation, which makes every nested recipe again for itself)."""
    if any(a._version != v for a, v in zip(_arg_tensors(r.args), r.versions)):
        raise RuntimeError(
            f"fxmem remat: an input of {getattr(r.fn, '__name__', r.fn)}, whose output backward recomputes, "
            "was modified in place between forward and backward")

    def arg(a):
        if not isinstance(a, _Remat):
            return a
        value = _shared_value(a.recipe) if a.how == "shared" and not private else _recompute(a.recipe, private)
        return value if a.shape is None else value.as_strided(a.shape, a.stride, a.offset)  # (None: all outputs)
    return r.fn(*_map_args(r.args, arg), **r.kwargs)


class _Enter:
    """Forward pre-hook: a fresh scope per call (picklable, so saved modules keep it)."""

    def __call__(self, module, args):
        if torch.compiler.is_compiling():
            return  # under torch.compile the compiled graph's partitioner decides what is saved
        scope = RecastScope()
        scope.__enter__()
        _calls().append(scope)


class _Exit:
    """Forward hook, always called: leaves the scope the matching pre-hook entered."""

    def __call__(self, module, args, output):
        if torch.compiler.is_compiling():
            return
        calls = _calls()
        if calls:
            calls.pop().__exit__(None, None, None)


class _Reinstall:
    """GraphModule deepcopy hook: `GraphModule.__deepcopy__` drops forward hooks; put ours back on the copy."""

    def __call__(self, copied: nn.Module) -> None:
        install(copied)


def install(module: nn.Module) -> None:
    """Run `module`'s forward inside a RecastScope (idempotent; survives deepcopy and Program.snapshot)."""
    if not installed(module):
        module.register_forward_pre_hook(_Enter())
        module.register_forward_hook(_Exit(), always_call=True)
    hooks = getattr(module, "_deepcopy_hooks", None)
    if hooks is not None and not any(isinstance(h, _Reinstall) for h in hooks):
        module._register_deepcopy_hook(_Reinstall())


def installed(module: nn.Module) -> bool:
    return any(isinstance(h, _Enter) for h in module._forward_pre_hooks.values())


def scope_for(module: nn.Module):
    """The scope forward would enter, for callers that run the graph through an fx.Interpreter."""
    return RecastScope() if installed(module) else contextlib.nullcontext()


def copy_hooks(src: nn.Module, dst: nn.Module) -> None:
    """Carry the recast hooks over to a module rebuilt from `src`'s graph (Program.snapshot)."""
    if installed(src) and not installed(dst):
        install(dst)
