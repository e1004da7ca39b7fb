"""Remat recipes: graph calls whose outputs backward recomputes instead of keeping (`fxmem.nn.recast` keeps them).

`remat(output, 'aten.op.overload', *args)` hands on `output`, which is `op(*args)`, registered as that recipe:
consumers' saves keep the recipe and backward runs the op again (once for all saves when `_fxmem_share`).
`remat_call('aten.op', *args)` runs the op itself, for ops that save their own output (ReLU) and chains (batch
norm -> ReLU): its own saves become the recipe too, and arguments that are recipes are held nested. A training-mode
batch norm is recomputed without running statistics (on CPU from its batch statistics, `batch_norm_affine`, where
that gives the kernel's bits); max pooling's indices (`INTERNAL_SAVES`) are a recipe too. Under torch.compile both
become checkpoints the partitioner recomputes. `op_call` looks through remat_call for graph analyses. Design:
docs/design/recast.md.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .compiled_recompute import recompute_compiled
from .recast import active_scope, any_stored_in, arg_tensors, map_args


def op_named(op: str):
    """'aten.gelu.default' (`str` of an overload) -> torch.ops.aten.gelu.default; no cache, dynamo traces it."""
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


class _OpInfo:
    """What remat_call needs of an op, worked out once per name (eager only: forward's hot path). `overload`: the
    OpOverload (a recipe's function, named in errors); `run`: its C++ callable, which the overload's `__call__`
    forwards to; `batch_norm`: recomputable from its batch statistics (`_affine_recomputable`); `internal`: its
    INTERNAL_SAVES entry."""
    __slots__ = ("name", "overload", "run", "batch_norm", "internal")

    def __init__(self, op: str):
        self.name, self.overload = op, op_named(op)
        self.run = getattr(self.overload, "_op", self.overload)
        self.batch_norm = op == "aten.batch_norm.default"
        self.internal = INTERNAL_SAVES.get(op)


_OPS: dict[str, _OpInfo] = {}


def _op_info(op: str) -> _OpInfo:
    info = _OPS.get(op)
    if info is None:
        info = _OPS[op] = _OpInfo(op)
    return info


def _resolve(op: str):
    """op_named, cached (eager only)."""
    return _op_info(op).overload


def register_recompute(out: torch.Tensor, recompute, args: tuple, kwargs: dict | None = None,
                       share: bool = False) -> None:
    """Inside an active RecastScope, save `out` as the recipe recompute(*args, **kwargs) (run again in backward;
    `share`: once for all its saves, see `remat`)."""
    if torch.compiler.is_compiling():
        return
    scope = active_scope()
    if scope is not None and isinstance(out, torch.Tensor):
        scope.register_recipe(out, recompute, tuple(args), dict(kwargs or {}), share)


def remat(output: torch.Tensor, op: str, *args, _fxmem_share: bool = False, **kwargs) -> torch.Tensor:
    """`output`, which is `op(*args, **kwargs)` (an aten overload by name): saved for backward as that recipe.

    `_fxmem_share` (the checkpoint pass sets it when the ops that save `output` run their backward one after another):
    backward runs the op once for all of them, the value held from the first unpack to the last, instead of once
    per save. A save that is never unpacked (a partial backward) leaves the value held until autograd frees the
    graph.

    Under torch.compile (training) the op runs again inside a one-op non-reentrant checkpoint instead: that tags
    its output for recomputation, so the compiler's partitioner recomputes it in backward (fused into the backward
    kernels) rather than deciding alone at its own memory budget, which kept it; `output` goes dead and the compiler
    drops it. The checkpoint carries the remat sites' shared region id (`compiled_recompute`)."""
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled():
            # (output's op already updated any running statistics: the checkpointed one must not again)
            return recompute_compiled(op_named(op), *_stats_free(op, args), **kwargs)
        return output
    if active_scope() is not None:
        register_recompute(output, *recompute_form(op, args, kwargs), share=_fxmem_share)
    return output


torch.fx.wrap("remat")


def recompute_form(op: str, args: tuple, kwargs: dict) -> tuple:
    """How backward recomputes `op(*args, **kwargs)`: a training-mode batch norm without running statistics
    (they are updated once, in forward; the output depends only on the batch statistics, bit-identical with or
    without them)."""
    return _resolve(op), _stats_free(op, args), kwargs


def _stats_free(op: str, args: tuple) -> tuple:
    """A training-mode batch norm's arguments without its running statistics (the same output); `args` itself when
    there are none to leave out (callers test identity: not `args` means the op updates statistics)."""
    if op.startswith("aten.batch_norm.") and len(args) > 5 and args[5] is True and \
            (args[3] is not None or args[4] is not None):
        return args[:3] + (None, None) + args[5:]
    return args


def batch_norm_affine(batch: torch.Tensor, weight, bias, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """A training-mode batch norm's output from its batch statistics, as the CPU kernel forms it: per channel
    alpha = invstd * weight and beta = bias - mean * alpha, then x * alpha + beta, each a fused multiply-add
    (addcmul; weight 1 and bias 0 when absent). One pass over x, where recomputing the norm passes over x twice
    more for the statistics (mean, then variance). Used only where `_affine_reproduces` has seen it give the
    kernel's output bit for bit."""
    shape = (1, -1) + (1,) * (batch.dim() - 2)
    alpha = invstd if weight is None else invstd * weight
    beta = torch.addcmul(torch.zeros_like(mean) if bias is None else bias, mean, alpha, value=-1)
    return torch.addcmul(beta.view(shape), batch, alpha.view(shape))


_native_batch_norm = torch.ops.aten.native_batch_norm.default._op


def _affine_recomputable(op: str, args: tuple, kwargs: dict) -> bool:
    """A training-mode `aten.batch_norm` on plain CPU tensors: its output can be recomputed from the batch
    statistics (`batch_norm_affine`) instead of by the norm. On CPU `batch_norm` runs `native_batch_norm`, which
    returns those statistics; elsewhere (cuDNN) the kernels differ, so the norm is recomputed as before."""
    if op != "aten.batch_norm.default" or kwargs or len(args) != 9 or args[5] is not True:
        return False
    batch = args[0]
    if not (isinstance(batch, torch.Tensor) and batch.device.type == "cpu" and batch.dim() >= 2 and batch.numel()):
        return False
    for arg in args[1:5]:  # (a loop, not all() over a generator: forward's hot path)
        if arg is not None and not isinstance(arg, torch.Tensor):
            return False
    return True


# (device, dtypes, shape, strides, affine) -> whether batch_norm_affine gave the kernel's output bit for bit
_AFFINE_EXACT: dict[tuple, bool] = {}


def _affine_reproduces(output, batch, weight, bias, mean, invstd) -> bool:
    """Whether `batch_norm_affine` reproduces `output` exactly for tensors laid out as these: checked once per layout on
    the real output (the kernel's arithmetic, fused multiply-adds or not, depends on the build and the CPU; a
    layout it does not cover, e.g. a non-contiguous input, takes another code path). Under a fake-tensor trace
    (the cost model) nothing can be compared and the recipe's memory is the same either way: taken as reproduced."""
    if isinstance(output, FakeTensor):
        return True
    if type(output) is not torch.Tensor or type(batch) is not torch.Tensor:
        return False
    key = (batch.device.type, batch.dtype, mean.dtype, batch.shape, batch.stride(),
           None if weight is None else weight.dtype, None if bias is None else bias.dtype)
    ok = _AFFINE_EXACT.get(key)
    if ok is None:
        with torch.no_grad():
            ok = _AFFINE_EXACT[key] = bool(torch.equal(batch_norm_affine(batch, weight, bias, mean, invstd), output))
    return ok


def remat_call(op: str, *args, _fxmem_chain=None, _fxmem_share: bool = False, _fxmem_nest: tuple = (),
               _fxmem_group: bool = False, _fxmem_defer: bool = True, **kwargs) -> torch.Tensor:
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
    `_fxmem_defer` False (the pass sets it where the trace shows the op saving neither its output nor an
    INTERNAL_SAVES output, e.g. a batch norm): the op's saves are not held back until its output is a recipe, which
    costs a Python call per save (a batch norm saves six tensors).

    Under torch.compile the chain's last node recomputes the whole chain (`_fxmem_chain`: each member's op, its
    arguments with "@i" for member i's output, and kwargs) inside one checkpoint, whose values the partitioner
    then recomputes; the members before it run as plain ops (their outputs go dead). Every site's checkpoint shares
    one region id (`compiled_recompute`), so a site that reads another site's value recomputes through it, as its
    eager recipe nests the other's."""
    if torch.compiler.is_compiling():
        op_function = op_named(op)
        if _fxmem_chain is None or not torch.is_grad_enabled():
            return op_function(*args, **kwargs)  # a member before the chain's last, or no backward to plan for
        if _stats_free(op, args) is not args:
            op_function(*args, **kwargs)  # a batch norm's running-statistics update, once (the output goes dead)
        return recompute_compiled(_run_chain, _fxmem_chain)
    scope = active_scope()
    info = _OPS.get(op) or _op_info(op)
    if scope is None:
        return info.run(*args, **kwargs)
    # before the op: an in-place op's output reuses its input's storage
    rargs = scope.as_recipe_args(args, _fxmem_nest)
    stats = None
    previous, pending = scope.defer_saves() if _fxmem_defer else (None, ())
    try:
        if info.batch_norm and _affine_recomputable(op, args, kwargs):
            output, mean, invstd = _native_batch_norm(*args[:8])  # what batch_norm runs on CPU
            stats = (mean, invstd)
        else:
            output = info.run(*args, **kwargs)
    finally:
        if _fxmem_defer:
            scope.stop_deferring(previous)
    if isinstance(output, torch.Tensor) and not any_stored_in(rargs, (output.untyped_storage()._cdata,)):
        # (an op that wrote its plain input in place would be recomputed from its own output: saved as usual)
        _register(scope, info, output, _Ran(args, rargs, kwargs, stats, pending), _fxmem_share, _fxmem_group)
    if pending:
        scope.pack_deferred(pending)  # the op's own saves, packed now that its output is a recipe
    return output


class _Ran(NamedTuple):
    """One run of remat_call's op: its arguments, their recipe form (registered outputs as nested recipes), its
    keyword arguments, a training batch norm's batch statistics (None: not recomputed from them) and the saves it
    deferred."""
    args: tuple
    rargs: tuple
    kwargs: dict
    stats: tuple | None
    pending: list | tuple


def _register(scope, info: _OpInfo, output: torch.Tensor, ran: _Ran, share: bool, group: bool) -> None:
    """Register remat_call's `output` (of `info`'s op) as its recipe: from the batch statistics where they reproduce
    it, and an INTERNAL_SAVES output the op saved as a recipe too (`group`: one shared run of the full op for both;
    `share`: as for `remat`)."""
    args, rargs, kwargs, stats = ran.args, ran.rargs, ran.kwargs, ran.stats
    if stats is not None and _affine_reproduces(output, args[0], args[1], args[2], *stats):
        recipe_function, rargs, rkwargs = batch_norm_affine, (rargs[0], args[1], args[2]) + stats, {}
    else:
        recipe_function, rargs, rkwargs = recompute_form(info.name, rargs, dict(kwargs))
    internal = info.internal
    own = _internal_output(scope, internal, output, ran) if internal is not None else None
    if own is not None and group:
        # one run of the full op for both, shared: each output a pick of it
        scope.register_picks(_resolve(internal[0]), rargs, dict(kwargs), ((0, output), (internal[1], own)))
        return
    scope.register_recipe(output, recipe_function, rargs, rkwargs, share)
    if own is not None:
        scope.register_recipe(own, _output_of(internal[0], internal[1]), rargs, dict(kwargs))


def _internal_output(scope, internal: tuple, output: torch.Tensor, ran: _Ran):
    """A composite op's own save of a tensor it made besides its output (max pooling's indices, `internal` its
    INTERNAL_SAVES entry) among the saves it deferred, None if none: a recipe too, the op's full form run again."""
    known = {a.untyped_storage()._cdata for a in (output, *arg_tensors(ran.args))}
    for deferred in ran.pending:
        tensor = deferred.value
        if isinstance(tensor, torch.Tensor) and tensor.dtype == internal[2] and tensor.shape == output.shape and \
                tensor.untyped_storage()._cdata not in known and scope.recipe_for(tensor) is None:
            return tensor
    return None


# ops whose backward saves a tensor of their own making besides the output: op -> (the full op, which output,
# its dtype); max pooling keeps its argmax indices (int64: twice a float32 output's bytes)
INTERNAL_SAVES = {
    "aten.max_pool2d.default": ("aten.max_pool2d_with_indices.default", 1, torch.int64),
    "aten.max_pool3d.default": ("aten.max_pool3d_with_indices.default", 1, torch.int64),
}


class _output_of:
    """Output `i` of the op named `op` (a recipe's function: the indices of max_pool2d_with_indices)."""
    __slots__ = ("op", "i", "__name__")

    def __init__(self, op: str, index: int):
        self.op, self.i, self.__name__ = op, index, f"{op}[{index}]"

    def __call__(self, *args, **kwargs):
        return _resolve(self.op)(*args, **kwargs)[self.i]


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
        args = map_args(args, lambda a: outs[int(a[1:])] if isinstance(a, str) and a[:1] == "@" else a)
        outs.append(op_named(op)(*_stats_free(op, args), **kwargs))
    return outs[-1]
