"""The saved-tensor scope of a transformed module: what its forward's saves keep for backward.

While the module's forward runs (hooks `install` puts on it), a `RecastScope` is the innermost
`saved_tensors_hooks`. A parameter (or input) cast by `cast_param` is saved as the parameter and cast again in
backward (the precision pass); an output registered as a recipe (`fxmem.nn.remat`: remat, remat_call, bool-mask
dropout) is saved as the recipe and recomputed in backward, once for all its saves when shared, nested recipes
first. Values are bit-identical, and an input changed in place in between is an error. Inside checkpoint and
offload regions the scope steps aside (`aside`); under torch.compile the hooks step aside too. The cost model reads
`installed(module)` and the recipes (`recipe_tensors`, `nested_recipes`, `group_of`). Design:
docs/design/recast.md.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from typing import NoReturn

import torch
from torch import nn

_state = threading.local()


def _stack() -> list:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def _leave(entry) -> None:
    """Pop `entry` (a scope, or None for `aside`) if it is the innermost: leaving what was entered."""
    stack = _stack()
    if stack and stack[-1] is entry:
        stack.pop()


def active_scope():
    """The scope registrations go to: the innermost entered one, None outside forward or inside a region."""
    stack = _stack()
    return stack[-1] if stack else None


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
    callback = getattr(_state, "observer", None)
    if callback is not None:
        callback([t for t in tensors if isinstance(t, torch.Tensor)])


def observed() -> bool:
    return getattr(_state, "observer", None) is not None


def _observe(packed) -> None:
    """Tell the observer (if any) what a finished pack keeps."""
    callback = getattr(_state, "observer", None)
    if callback is None or isinstance(packed, _Deferred):
        return
    if isinstance(packed, _Remat):
        callback(recipe_tensors(packed.recipe))
    elif isinstance(packed, _Recast):
        callback([packed.param])
    elif isinstance(packed, torch.Tensor):
        callback([packed])


def _calls() -> list:
    """Scopes entered by forward pre-hooks on this thread, innermost last (nested fxmem modules)."""
    calls = getattr(_state, "calls", None)
    if calls is None:
        calls = _state.calls = []
    return calls


def cast_param(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`param.to(dtype)`; inside an active RecastScope the copy is recast in backward instead of being saved."""
    out = param.to(dtype)
    if torch.compiler.is_compiling():
        return out  # a compiled graph's partitioner decides what it saves (and recomputes casts itself)
    scope = active_scope()
    if scope is not None and out is not param:
        scope.register(out, param, dtype)
    return out


torch.fx.wrap("cast_param")

class _Pick:
    """Output `index` of a tuple (a recipe's function: one output of a shared run of a multi-output op)."""
    __slots__ = ("i", "__name__")

    def __init__(self, index: int):
        self.i, self.__name__ = index, f"output {index}"

    def __call__(self, outputs):
        return outputs[self.i]


class _Take:
    """Item `index` of a list, which it leaves empty (a recipe's function: one value of a region's shared run
    `whole`, recomputed once for all its saves, so that the list does not hold it past its own last use). A save
    unpacked again after its last counted use (a backward through a graph a create_graph backward kept) finds its
    item taken: the run is made again for it."""
    __slots__ = ("i", "whole", "__name__")

    def __init__(self, index: int, whole):
        self.i, self.whole, self.__name__ = index, whole, f"value {index}"

    def __call__(self, values: list):
        value, values[self.i] = values[self.i], None
        return value if value is not None else _recompute(self.whole)[self.i]


def _storage_died(scope_ref, key: int, _storage_ref) -> None:
    """A registered storage died: its entry goes, and the scope's hooks too when nothing else needs them."""
    scope = scope_ref()
    if scope is not None:
        scope._entries.pop(key, None)
        scope._unhook_saves()


def group_of(recipe: "_Recipe"):
    """The shared recipe whose outputs `recipe` picks one of (a grouped max pooling's), None if none."""
    if isinstance(recipe.fn, _Pick) and isinstance(recipe.args[0], _Remat) and recipe.args[0].how == "shared":
        return recipe.args[0].recipe
    return None


class RecastScope:
    """saved_tensors_hooks that save registered parameter casts as their parameter and registered recipes as the
    recipe (see the module docstring)."""

    def __init__(self):
        # storage id -> (weakref to the storage, parameter, dtype) or (weakref, _Recipe)
        self._entries: dict[int, tuple] = {}
        self._pushed_pack = None  # our pack hook while our saved-tensor hooks are on the stack
        self._whole_forward = False  # hooks for the whole forward (nested in another scope, or observed)
        self._pending: list | None = None  # while remat_call runs its op: that op's saves, packed after it
        self._ref = weakref.ref(self)  # (made once: each registration's storage callback holds it)

    def _add(self, out: torch.Tensor, entry: tuple) -> None:
        storage = out.untyped_storage()
        key = storage._cdata
        # the storage object is preserved while the storage lives; when it dies the entry goes with it, so a
        # later tensor that reuses the address is never mistaken for the cast
        ref = weakref.ref(storage, functools.partial(_storage_died, self._ref, key))
        self._entries[key] = (ref,) + entry
        self._hook_saves()

    def _hook_saves(self) -> None:
        """Put our hooks on the saved-tensor hook stack (called at the top level of our forward: registrations,
        remat_call's deferral). Saves of storages nothing is registered for need no hook, so the hooks are on
        only while some registered storage lives (`_unhook_saves`): most saves then cost no Python call."""
        if self._pushed_pack is None:
            self._pushed_pack = self._pack
            torch._C._autograd._push_saved_tensors_default_hooks(self._pushed_pack, self._unpack)

    def _unhook_saves(self) -> None:
        """Take our hooks off when nothing needs them and it is safe: at the top level of our own forward (the
        innermost scope, not inside a region), with our hooks the innermost."""
        if self._pushed_pack is None or self._whole_forward or self._entries or self._pending is not None:
            return
        stack = _stack()
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if stack and stack[-1] is self and top is not None and top[0] is self._pushed_pack:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._pushed_pack = None

    def register(self, out: torch.Tensor, param: torch.Tensor, dtype: torch.dtype) -> None:
        self._add(out, (param, dtype))

    def register_recipe(self, out: torch.Tensor, function, args: tuple, kwargs: dict, share: bool = False) -> None:
        """`out` saved as function(*args, **kwargs). An in-place op's output (the storage of a recipe registered before,
        e.g. relu_ on a batch norm's output) replaces that entry: `args` hold the earlier recipe, nested."""
        self._add(out, (_Recipe(function, args, kwargs, out._version, share),))

    def register_picks(self, function, args: tuple, kwargs: dict, outputs) -> None:
        """One shared run of function(*args, **kwargs), a multi-output op, for several of its outputs (`outputs`:
        (index, tensor) pairs): each saved as a pick of that run (a grouped max pooling's output and indices)."""
        whole = _Recipe(function, args, kwargs, None, share=True)
        for index, tensor in outputs:
            part = _Remat(whole, None, None, None)
            part.how = "shared"
            self.register_recipe(tensor, _Pick(index), (part,), {})

    def register_region_values(self, function, args: tuple, values: list) -> list:
        """One shared run of function(*args), which returns a list, for `values` (its items, in order): each saved as
        its item, recomputed with the others at the first unpack of any and held until its own last unpack
        (`fxmem.nn.region_recipe`: a checkpoint region's needed closure). Returns what to `unregister` once the
        region's saves are packed."""
        whole = _Recipe(function, args, {}, None, share=True)
        replaced = []
        for index, tensor in enumerate(values):
            part = _Remat(whole, None, None, None)
            part.how = "shared"
            key = tensor.untyped_storage()._cdata
            replaced.append((key, self._entries.get(key)))
            self.register_recipe(tensor, _Take(index, whole), (part,), {}, share=True)
        return replaced

    def unregister(self, replaced: list) -> None:
        """Undo `register_region_values` (what it returned): each storage's registration as it was before, or none
        (saves packed in between keep their recipes)."""
        for key, entry in replaced:
            if entry is None:
                self._entries.pop(key, None)
            else:
                self._entries[key] = entry
        self._unhook_saves()

    def defer_saves(self) -> tuple:
        """(previous, pending): from now until `stop_deferring(previous)`, saves are deferred into `pending` until
        `pack_deferred`: remat_call runs its op so, registering its output as a recipe before the op's own saves
        of it are packed. (Two calls, not a context manager: forward's hot path.)"""
        self._hook_saves()
        previous, self._pending = self._pending, []
        return previous, self._pending

    def stop_deferring(self, previous) -> None:
        """End the deferral that `defer_saves` began, `previous` the one it was inside (None: none)."""
        self._pending = previous

    def pack_deferred(self, pending: list) -> None:
        """Pack the saves deferred while an op ran (`defer_saves`), now that its outputs are registered."""
        entries, observer = self._entries, getattr(_state, "observer", None)
        for deferred in pending:
            tensor = deferred.value
            if tensor.untyped_storage()._cdata in entries:  # (else saved as it is: most saves)
                deferred.value = self._pack_now(tensor, count=True)
            if observer is not None:
                _observe(deferred.value)

    def recipe_for(self, tensor: torch.Tensor):
        """The recipe `tensor` would be saved as (None: saved as it is, or a parameter cast)."""
        packed = self._pack_now(tensor)
        return packed.recipe if isinstance(packed, _Remat) else None

    def recipe_of_storage(self, key: int):
        """The recipe registered for the storage with this `_cdata` (None: none)."""
        entry = self._entries.get(key)
        return entry[1] if entry is not None and len(entry) == 2 and entry[0]() is not None else None

    def as_recipe_args(self, args: tuple, nest: tuple = ()) -> tuple:
        """`args` with every tensor that is a registered recipe's output replaced by that recipe (nested), also
        inside list arguments (cat, stack). A nested shared recipe at a flat position in `nest` is used through its
        shared value (made once for its saves and these uses, see `remat`), counted when the holder's saves are."""
        entries = self._entries
        if not entries or not any_stored_in(flat_args(args), entries):
            return args if type(args) is tuple else tuple(args)  # no argument is a registered storage (most calls)
        positions = itertools.count()  # flat positions, in `map_args`'s order

        def one(arg):
            position = next(positions)
            packed = self._pack_now(arg) if isinstance(arg, torch.Tensor) else arg
            if not isinstance(packed, _Remat):
                return arg
            if position in nest and packed.recipe.share:
                packed.how = "shared"
            return packed
        return map_args(args, one)

    def _pack(self, tensor: torch.Tensor):
        pending = self._pending
        if pending is not None:
            deferred = _Deferred(tensor)
            pending.append(deferred)
            return deferred  # (observed once remat_call packs it)
        entries = self._entries
        if (not entries or tensor.untyped_storage()._cdata not in entries) and \
                getattr(_state, "observer", None) is None:
            return tensor  # most saves: nothing registered for this storage and nobody watching (the hot path)
        if active_scope() is None:
            # inside a checkpoint or offload region (`aside`): non-reentrant checkpoint saving the region's inputs.
            # A recipe there is made again by and for the region's recomputation alone, not through a shared value
            # (held from the region's recomputation to some other save's unpack, far from both)
            packed = self._pack_now(tensor)
            if isinstance(packed, _Remat):
                packed.how = "private"
        else:
            packed = self._pack_now(tensor, count=True)
        _observe(packed)
        return packed

    def _pack_now(self, tensor: torch.Tensor, count: bool = False):
        """What `tensor` is saved as; `count`: a save autograd will unpack (shared recipes count their uses)."""
        if not self._entries:
            return tensor
        storage = tensor.untyped_storage()
        entry = self._entries.get(storage._cdata)
        if entry is None or entry[0]() is not storage:
            return tensor
        if len(entry) == 2:  # a recipe
            recipe = entry[1]
            if tensor._version != recipe.out_version:
                return tensor  # changed in place since (the recipe would give the old values): saved as it is
            if count:
                _count_use(recipe)
            return _Remat(recipe, tensor.shape, tensor.stride(), tensor.storage_offset())
        return _Recast(entry[1], entry[2], tensor.shape, tensor.stride(), tensor.storage_offset(),
                       entry[1]._version)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed  # saved as it was (the hot path)
        if isinstance(packed, _Deferred):
            packed = packed.value
        if isinstance(packed, _Remat):
            if torch.is_grad_enabled():  # (a backward with create_graph=True; off in a plain backward)
                with torch.no_grad():
                    return _remade(packed)
            return _remade(packed)
        if isinstance(packed, _Recast):
            if packed.param._version != packed.version:
                raise RuntimeError(
                    "fxmem recast: a parameter or input whose low-precision copy backward needs was modified in "
                    "place between forward and backward (e.g. optimizer.step() before loss.backward()); "
                    f"shape {tuple(packed.param.shape)}, version {packed.version} -> {packed.param._version}")
            with torch.no_grad():
                full = packed.param.to(packed.dtype)
                return full.as_strided(packed.shape, packed.stride, packed.offset)
        return packed

    def __enter__(self):
        # nested in another fxmem module's forward, our hooks stay the innermost for the whole forward (as the
        # outer scope's are not meant to see our saves); an observer (fxmem.measure) is told of every save
        self._whole_forward = bool(_calls()) or observed()
        if self._whole_forward:
            self._hook_saves()
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _leave(self)
        self._entries = {}
        if self._pushed_pack is not None:
            self._pushed_pack = None
            torch._C._autograd._pop_saved_tensors_default_hooks()
        return False


def any_stored_in(args, keys) -> bool:
    """Whether a tensor among `args` has its storage (`_cdata`) in `keys` (a plain loop: forward's hot path)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.untyped_storage()._cdata in keys:
            return True
    return False


class _Recast:
    __slots__ = ("param", "dtype", "shape", "stride", "offset", "version")

    def __init__(self, param, dtype, shape, stride, offset, version):
        self.param, self.dtype, self.shape, self.stride, self.offset = param, dtype, shape, stride, offset
        self.version = version


class _Recipe:
    __slots__ = ("fn", "args", "kwargs", "tensors", "versions", "plain", "out_version", "share", "saves", "value",
                 "private")

    def __init__(self, function, args, kwargs, out_version, share=False):
        self.fn, self.args, self.kwargs = function, args, kwargs
        # plain: no nested recipes, recomputed as fn(*args) (one loop: forward's hot path)
        tensors, versions, plain = [], [], True
        for arg in flat_args(args):
            if isinstance(arg, torch.Tensor):
                tensors.append(arg)
                versions.append(arg._version)
            elif isinstance(arg, _Remat):
                plain = False
        self.plain = plain
        self.tensors = tuple(tensors)  # the tensor arguments, in order
        self.versions = tuple(versions)  # their versions when registered
        self.out_version = out_version  # the output's version when registered
        self.share = share  # recomputed once for all its saves (see `remat`)
        self.saves = 0  # shared: saves not unpacked yet
        self.value = None  # shared: the recomputed output, between the first unpack and the last
        # (a weak reference to the storage of the output last made for a region's recomputation, its dtype):
        # `_private_value`
        self.private = None


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


def is_recipe(packed) -> bool:
    """Whether `packed` (an argument `as_recipe_args` returned) is a recipe's output held as the recipe."""
    return isinstance(packed, _Remat)


def recipe_tensors(recipe: _Recipe) -> list[torch.Tensor]:
    """The tensors a recipe holds: its tensor arguments and, through nested recipes, theirs."""
    out: list[torch.Tensor] = []
    for arg in flat_args(recipe.args):
        if isinstance(arg, _Remat):
            out.extend(recipe_tensors(arg.recipe))
        elif isinstance(arg, torch.Tensor):
            out.append(arg)
    return out


def nested_recipes(recipe: _Recipe, shared: bool | None = None) -> list[_Recipe]:
    """The recipes `recipe` holds as arguments (its arguments that are recipes' outputs), not through them; `shared`
    True: only those it uses through their shared value, False: only the others."""
    return [a.recipe for a in flat_args(recipe.args) if isinstance(a, _Remat)
            and (shared is None or (a.how == "shared") == shared)]


def _count_use(recipe: _Recipe) -> None:
    """Backward will use the recipe's output once more: a shared recipe counts the use (made once, held until its
    last); a recomputation of the recipe uses its nested recipes, so theirs are counted with its first."""
    if recipe.share:
        recipe.saves += 1
        if recipe.saves > 1:
            return
    _count_nested(recipe)


def _count_nested(recipe: _Recipe) -> None:
    """One recomputation of the recipe: its nested shared uses count, its other nested recipes are recomputed
    with it."""
    for arg in flat_args(recipe.args):
        if isinstance(arg, _Remat):
            if arg.how == "shared":
                _count_use(arg.recipe)
            else:
                _count_nested(arg.recipe)


def _shared_value(recipe: _Recipe) -> torch.Tensor:
    """A shared recipe's output: recomputed at its first use, held until its last (`saves` counts them down)."""
    value = recipe.value if recipe.value is not None else _recompute(recipe)
    recipe.saves -= 1
    recipe.value = value if recipe.saves > 0 else None
    return value


def flat_args(args: tuple) -> list | tuple:
    """Arguments with the elements of list arguments (cat, stack) in their place (`args` itself when it has none)."""
    for arg in args:
        if isinstance(arg, (list, tuple)):
            break
    else:
        return args
    out: list = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            out.extend(arg)
        else:
            out.append(arg)
    return out


def arg_tensors(args: tuple) -> list[torch.Tensor]:
    return [a for a in flat_args(args) if isinstance(a, torch.Tensor)]


def map_args(args: tuple, function) -> tuple:
    """`args` with `function` applied to each argument, and inside list arguments (cat, stack) to each element."""
    return tuple(type(a)(function(t) for t in a) if isinstance(a, (list, tuple)) else function(a) for a in args)


def _remade(packed: _Remat) -> torch.Tensor:
    """A saved recipe's output for its unpack (grad mode off), viewed as the saved tensor was: run again (nested
    recipes first), or a shared recipe's value, or made again for a region's recomputation alone."""
    recipe = packed.recipe
    if packed.how == "private":
        return _private_value(packed)
    if recipe.share:
        value = _shared_value(recipe)
    else:
        value = _recompute(recipe)
    return value.as_strided(packed.shape, packed.stride, packed.offset)


def _private_value(packed: _Remat) -> torch.Tensor:
    """A recipe's output made again for a region's recomputation, viewed as `packed` was: once for all the region's
    inputs it makes while one of them is alive (an attention region's q, k and v, three views of one linear's
    output, are unpacked together: one linear run, one output held, not three)."""
    recipe = packed.recipe
    storage = recipe.private[0]() if recipe.private is not None else None
    if storage is not None and packed.shape is not None:
        # (autograd keeps the unpacked views as tensors of its own: the storage's Python object lives as long as
        # the storage does, the views' do not)
        return torch.empty(0, dtype=recipe.private[1], device=storage.device).set_(
            storage, packed.offset, packed.shape, packed.stride)
    view = _recompute(recipe, private=True).as_strided(packed.shape, packed.stride, packed.offset)
    recipe.private = (weakref.ref(view.untyped_storage()), view.dtype)
    return view


def _recompute(recipe: _Recipe, private: bool = False) -> torch.Tensor:
    """The recipe's output, computed again (nested recipes first: those used through a shared value take it, unless
    `private`, a region's recomputation, which makes every nested recipe again for itself)."""
    for tensor, version in zip(recipe.tensors, recipe.versions):
        if tensor._version != version:
            _changed_in_place(recipe)
    if recipe.plain:
        return recipe.fn(*recipe.args, **recipe.kwargs)

    def arg(item):
        if not isinstance(item, _Remat):
            return item
        value = (_shared_value(item.recipe) if item.how == "shared" and not private
                 else _recompute(item.recipe, private))
        # (shape None: all outputs)
        return value if item.shape is None else value.as_strided(item.shape, item.stride, item.offset)
    return recipe.fn(*map_args(recipe.args, arg), **recipe.kwargs)


def _changed_in_place(recipe: _Recipe) -> NoReturn:
    raise RuntimeError(
        f"fxmem remat: an input of {getattr(recipe.fn, '__name__', recipe.fn)}, whose output backward recomputes, "
        "was modified in place between forward and backward")


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
