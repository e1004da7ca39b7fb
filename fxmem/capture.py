"""Model -> Program: capture with `torch.export` (non-strict) into a trainable, mode-switchable GraphModule.

What capture adds on top of a bare `ep.module()`:
- `.train()` / `.eval()` work: dropout and batch-norm read the module's own `training` flag (`fxmem.nn.modes`);
- dynamic shapes by default (`Dim.AUTO` on every input dim); dims the model forces static are listed;
- `InputGuard` instead of export's guard function, so a bad call names the input and the dim;
- `CaptureError` that names the module path and the source line that could not be captured, with a hint.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from .errors import CaptureError
from .guards import DimSpec, InputGuard, InputSpec
from .nn.modes import ModeFlag, count_batch
from .program import Program, SpecializedDim

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXMEM_DIR = os.path.dirname(os.path.abspath(__file__))

# ops whose `train` argument (by position) export bakes in as a literal
MODE_ARGS = {
    torch.ops.aten.dropout.default: 2,
    torch.ops.aten.feature_dropout.default: 2,
    torch.ops.aten.alpha_dropout.default: 2,
    torch.ops.aten.feature_alpha_dropout.default: 2,
    torch.ops.aten.batch_norm.default: 5,
}


def capture(model: nn.Module, args: Any = (), kwargs: dict | None = None, *, mode: str = "train",
            dynamic: bool = True, dynamic_shapes: Any = None, check: bool = True) -> Program:
    """Capture `model(*args, **kwargs)` as a Program.

    mode: "train" keeps dropout and batch statistics (switchable later with `.eval()`); "inference" captures the
    eval behaviour. dynamic: every input dim is dynamic unless the model forces it (listed in
    `Program.specialized`). check: run the captured module once and compare outputs with the model.
    """
    if mode not in ("train", "inference"):
        raise CaptureError(f"mode must be 'train' or 'inference', got {mode!r}")
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,) if not isinstance(args, list) else tuple(args)
    kwargs = dict(kwargs or {})
    _disable_hf_cache(model, kwargs)

    was_training = model.training
    model.train(mode == "train")
    notes: list[str] = []
    try:
        ep = None
        if dynamic and dynamic_shapes is None:
            try:
                ds = _auto_dynamic_shapes(model, args, kwargs)
                ep = _export(model, args, kwargs, ds)
            except CaptureError as e:
                notes.append(f"dynamic-shape capture failed, captured with static shapes instead: {e}")
        if ep is None:
            ep = _export(model, args, kwargs, dynamic_shapes)
    finally:
        model.train(was_training)

    program = _program_from_export(ep, model, args, kwargs, mode, notes)
    if check:
        _check_outputs(program, model, args, kwargs, mode)
    return program


# --------------------------------------------------------------------------------------------- export helpers

def _disable_hf_cache(model: nn.Module, kwargs: dict) -> None:
    """HF models return a DynamicCache when use_cache is on, which export cannot output."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "use_cache", False):
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        if "use_cache" in params and "use_cache" not in kwargs:
            kwargs["use_cache"] = False


def _bound_arguments(model: nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        return inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None


def _auto_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict):
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(x.dim())} if x.dim() else None
        return None

    bound = _bound_arguments(model, args, kwargs)
    if bound is None:
        return None
    sig = inspect.signature(model.forward)
    out = {}
    for name, value in bound.arguments.items():
        p = sig.parameters[name]
        if p.kind == inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: pytree.tree_map(leaf, v) for k, v in value.items()}
        elif p.kind == inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(pytree.tree_map(leaf, v) for v in value)
        else:
            out[name] = pytree.tree_map(leaf, value)
    return out


class _ModuleTracker:
    """Forward hooks that keep the stack of module paths being run, to say where capture failed."""

    def __init__(self, model: nn.Module):
        self.stack: list[str] = []
        self.deepest: list[str] = []
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._pre(name or "<root>")))
            self.handles.append(mod.register_forward_hook(self._post(), always_call=True))

    def _pre(self, name):
        def hook(mod, inp):
            self.stack.append(name)
            self.deepest = list(self.stack)
        return hook

    def _post(self):
        def hook(mod, inp, out):
            if self.stack:
                self.stack.pop()
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _export(model, args, kwargs, dynamic_shapes):
    tracker = _ModuleTracker(model)
    try:
        with warnings_quiet():
            return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    except Exception as e:  # noqa: BLE001 - translated into a CaptureError that says where
        path = _failing_module(e, model)
        raise _capture_error(e, [path] if path else (tracker.deepest or tracker.stack), model) from e
    finally:
        tracker.close()


@contextlib.contextmanager
def warnings_quiet():
    """export warns about 0/1-specialised dims; fxmem reports specialised dims itself (Program.specialized)."""
    import logging
    import warnings
    log = logging.getLogger("torch._export.non_strict_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _failing_module(exc: BaseException, model: nn.Module) -> str | None:
    """The innermost module whose forward was on the stack when capture failed (from the traceback)."""
    names = {id(m): (n or "<root>") for n, m in model.named_modules()}
    found = None
    e: BaseException | None = exc
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            slf = tb.tb_frame.f_locals.get("self")
            if isinstance(slf, nn.Module) and id(slf) in names:
                found = names[id(slf)]
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return found


def _user_frame(exc: BaseException) -> str | None:
    """The deepest traceback frame outside torch and fxmem: the model code that failed."""
    best = None
    e: BaseException | None = exc
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for fr in traceback.extract_tb(e.__traceback__):
            f = os.path.abspath(fr.filename)
            if f.startswith(_TORCH_DIR) or f.startswith(_FXMEM_DIR) or "<" in fr.filename:
                continue
            best = f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
        e = e.__cause__ or e.__context__
    return best


def _hint(msg: str) -> str:
    m = msg.lower()
    if "cache" in m:
        return "pass use_cache=False (Hugging Face models) so the model does not return a cache object"
    if "data-dependent" in m or "datadependent" in m or "guardondatadependent" in m or ".item()" in m:
        return ("the model branches on a tensor's value; make the branch static (python values), use "
                "torch.cond, or move it out of forward")
    if "constraint" in m or "specializ" in m or "dynamic" in m:
        return "a dynamic dim conflicts with the model; pass dynamic=False to capture static shapes"
    if "unsupported" in m or "not supported" in m:
        return "an operation torch.export cannot trace; rewrite it with torch ops"
    return "see the underlying error below (raise ... from) for the full torch traceback"


def _capture_error(e: Exception, module_stack: list[str], model: nn.Module) -> CaptureError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = _user_frame(e)
    path = module_stack[-1] if module_stack else "<root>"
    mod_type = ""
    try:
        mod = model if path == "<root>" else model.get_submodule(path)
        mod_type = f" ({type(mod).__name__})"
    except AttributeError:
        pass
    parts = [f"could not capture {type(model).__name__}: in module '{path}'{mod_type}"]
    if where:
        parts.append(f"at {where}")
    parts.append(f"{type(e).__name__}: {first[:300]}")
    parts.append(f"hint: {_hint(str(e))}")
    return CaptureError("; ".join(parts))


# --------------------------------------------------------------------------------------------- program build

def _flat_input_names(model, args, kwargs) -> list[str]:
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _ in flat:
        s = pytree.keystr(path)  # like "[0][1]" or "[1]['attention_mask']"
        if s.startswith("[0]"):
            rest = s[3:]
            names.append("args" + rest)
        else:
            names.append("kwargs" + s[3:])
    return names


def _program_from_export(ep, model, args, kwargs, mode, notes) -> Program:
    unlifted = ep.module()
    graph = unlifted.graph
    gm = torch.fx.GraphModule(unlifted, graph, class_name=type(model).__name__)
    # pytree codegen reads these
    gm._in_spec = unlifted._in_spec
    gm._out_spec = unlifted._out_spec

    # input specs for the guard and the list of specialised dims
    names = _flat_input_names(model, args, kwargs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    specs, specialized = [], []
    for ph, name in zip(placeholders, names):
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor):
            specs.append(InputSpec(name, None))
            continue
        dims = []
        for i, s in enumerate(val.shape):
            if is_concrete_int(s):
                dims.append(DimSpec(static=int(s)))
                specialized.append(SpecializedDim(name, i, int(s)))
            else:
                sym = str(s)
                r = ranges.get(sym)
                lo = _as_int(getattr(r, "lower", None))
                if lo == 2:
                    lo = 1  # export's 0/1 specialisation: the graph is valid for size 1 (tested per model kind)
                hi = _as_int(getattr(r, "upper", None))
                dims.append(DimSpec(static=None, symbol=sym, lower=lo, upper=hi))
        specs.append(InputSpec(name, tuple(dims), str(val.dtype)))

    _copy_buffer_persistence(model, gm)
    _replace_guards(gm, specs)
    _make_mode_switchable(gm)
    gm.graph.lint()
    gm.recompile()
    gm.train(mode == "train")
    return Program(module=gm, example_args=args, example_kwargs=kwargs, mode=mode, input_names=names,
                   input_specs=specs, specialized=specialized, notes=notes, model_name=type(model).__name__)


def _copy_buffer_persistence(model: nn.Module, gm: nn.Module) -> None:
    """Buffers registered with persistent=False stay out of state_dict(), as in the user's model."""
    for path, mod in model.named_modules():
        names = getattr(mod, "_non_persistent_buffers_set", None)
        if not names:
            continue
        try:
            target = gm.get_submodule(path) if path else gm
        except AttributeError:
            continue
        for n in names:
            if n in target._buffers:
                target._non_persistent_buffers_set.add(n)


def _as_int(v):
    try:
        if v is None:
            return None
        f = float(v)
        if f != f or f in (float("inf"), float("-inf")) or abs(f) > 2 ** 62:
            return None
        return int(f)
    except (TypeError, ValueError):
        return None


def _replace_guards(gm: torch.fx.GraphModule, specs: list[InputSpec]) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.add_submodule("input_guard", InputGuard(specs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    ctx = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(None)
    with ctx:
        gm.graph.call_module("input_guard", tuple(placeholders))


def _make_mode_switchable(gm: torch.fx.GraphModule) -> None:
    """Route literal train flags of dropout/batch-norm to the module's `training` flag."""
    users = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in MODE_ARGS]
    bn_counters = [n for n in gm.graph.nodes
                   if n.op == "call_function" and n.target == torch.ops.aten.add_.Tensor
                   and n.args[0].op == "get_attr" and str(n.args[0].target).endswith("num_batches_tracked")]
    if not users and not bn_counters:
        return
    gm.add_submodule("mode", ModeFlag())
    guard = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "input_guard")
    with gm.graph.inserting_after(guard):
        flag = gm.graph.call_module("mode", ())
        flag.meta["fxmem_mode_flag"] = True
    for n in users:
        i = MODE_ARGS[n.target]
        a = list(n.args)
        if i < len(a) and isinstance(a[i], bool):
            a[i] = flag
            n.args = tuple(a)
        elif "train" in n.kwargs or "training" in n.kwargs:
            key = "train" if "train" in n.kwargs else "training"
            n.kwargs = {**n.kwargs, key: flag}
    for n in bn_counters:
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(count_batch, (n.args[0], flag))
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)


def _check_outputs(program: Program, model: nn.Module, args, kwargs, mode: str) -> None:
    """The captured module must compute what the model computes.

    Compared in the captured mode (train mode with the same RNG seed, so dropout draws the same masks) and, for
    a train capture, in eval mode too: a difference there means python-level `if self.training` branches that
    the graph cannot switch, which is recorded as a note rather than an error.
    """
    from .compare import compare_outputs
    was = model.training
    # running the model changes buffers (batch-norm statistics): the user's state is restored afterwards
    saved_buffers = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()
                     if not isinstance(v, nn.Parameter)}
    try:
        for check_mode in ([mode] if mode == "inference" else ["train", "inference"]):
            model.train(check_mode == "train")
            program.module.train(check_mode == "train")
            with torch.no_grad():
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(1234)
                    ref = model(*args, **kwargs)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(1234)
                    got = program.module(*args, **kwargs)
            err = compare_outputs(ref, got, atol=1e-5, rtol=1e-4)
            if err is None:
                continue
            if check_mode == mode:
                raise CaptureError(
                    f"captured {type(model).__name__} does not reproduce the model's outputs in {mode} mode "
                    f"({err}); the model may depend on python state that torch.export specialised")
            program.notes.append(
                f"eval() of this train-mode capture differs from model.eval() ({err}): the model has "
                "python-level train/eval branches; capture with mode='inference' for inference")
    finally:
        with torch.no_grad():
            state = model.state_dict(keep_vars=True)
            for k, v in saved_buffers.items():
                state[k].copy_(v)
        model.train(was)
        program.module.train(mode == "train")
