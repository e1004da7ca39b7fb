"""Model -> Program: capture with `torch.export` (non-strict) into a trainable, mode-switchable GraphModule.

What capture adds on top of a bare `ep.module()`:
- `.train()` / `.eval()` work: dropout and batch-norm read the module's own `training` flag (`fxmem.capture_modes`);
- dynamic shapes by default (`Dim.AUTO` on every input dim); dims the model forces static are listed;
- `InputGuard` instead of export's guard function, so a bad call names the input and the dim (or the python value
  the graph holds as a constant);
- the result is called exactly as the model was: what capture adds to the call (`use_cache=False`) is bound inside
  the graph (`fxmem.capture_defaults`), and tensors export lifts out of forward stay out of `state_dict()`;
- `CaptureError` that names the module path and the source line that could not be captured, with a hint
  (`fxmem.capture_hints`); torch's long output goes to a file the message names (`fxmem.capture_output`);
- sizes PyG computes from tensor values (pooling without `size=`) stay symbolic (`fxmem.library_sizes`);
- custom `torch.autograd.Function`s are recorded while export traces: non-strict export inlines a Function's
  forward and drops its custom backward (`fxmem.capture_functions`), so when one was called, the captured module's
  gradients are compared with the model's (`fxmem.capture_checks`): a difference is a `CaptureError`.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import traceback
import warnings
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from .capture_checks import branch_location, check_gradients, check_outputs, mode_difference
from .capture_defaults import capture_defaults, defaults_bound, describe_defaults
from .capture_functions import DROPPED, FunctionCalls, ModuleTracker, is_user_file, record_function_calls
from .capture_hints import hint_for
from .capture_modes import make_mode_switchable
from .capture_output import export_output_kept, write_details
from .errors import CaptureError, first_line
from .guards import CONSTANT_TYPES, DimSpec, InputGuard, InputSpec
from .library_sizes import library_sizes_symbolic
from .mode_graphs import attach_mode_graph, attach_mode_refusal
from .node_value import EXPORT, node_value
from .program import Program, SpecializedDim, copy_buffer_persistence, keep_persistence_when_copied
from .userstate import keeps_model_state, mode_set


@keeps_model_state
def capture(model: nn.Module, args: Any = (), kwargs: dict | None = None, *, mode: str = "train",
            dynamic: bool = True, dynamic_shapes: Any = None, check: bool = True) -> Program:
    """Capture `model(*args, **kwargs)` as a Program.

    mode: "train" keeps dropout and batch statistics (switchable later with `.eval()`); "inference" captures the
    eval behaviour. dynamic: every input dim is dynamic unless the model forces it (listed in
    `Program.specialized`). check: run the captured module and compare outputs with the model, in the captured mode
    and in the other one; where the other mode differs (the model's python reads `self.training`), that mode is
    captured too and `.train()`/`.eval()` switch graphs (`_serve_other_mode`). check=False skips both, so such a
    program's other mode is only as faithful as its train-flag ops.
    """
    if mode not in ("train", "inference"):
        raise CaptureError(f"mode must be 'train' or 'inference', got {mode!r}")
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,) if not isinstance(args, list) else tuple(args)
    kwargs = dict(kwargs or {})
    if check:
        _refuse_meta(model, args, kwargs)
    added = capture_defaults(model, args, kwargs)
    try:
        with defaults_bound(model, added):
            program = _capture_checked(model, args, kwargs, mode, dynamic, dynamic_shapes, check)
    except CaptureError as error:
        _write_details(error, type(model).__name__)
        raise
    if added:
        program.notes.append(describe_defaults(added))
    return program


def _write_details(error: CaptureError, model_name: str) -> None:
    """The long text behind a CaptureError (the first in its chain that has one) goes to a file; the message, one
    line, names it."""
    cause: BaseException | None = error
    while cause is not None and getattr(cause, "details", None) is None:
        cause = cause.__cause__
    if cause is None:
        return
    try:
        path = write_details(model_name, str(error), cause.details)
    except OSError as write_error:
        error.args = (f"{error}; torch's full error could not be written to a file ({write_error})",)
        return
    error.args = (f"{error}; torch's full error, traceback and partial graph: {path}",)


def _capture_checked(model: nn.Module, args: tuple, kwargs: dict, mode: str, dynamic: bool, dynamic_shapes,
                     check: bool) -> Program:
    """Export `model` in `mode` into a Program and, with `check`, compare it with the model (see `capture`)."""
    notes: list[str] = []
    functions = FunctionCalls()
    exported = _export_in_mode(model, args, kwargs, mode, dynamic, dynamic_shapes, functions, notes)
    program = _program_from_export(exported, model, args, kwargs, mode, notes)
    if check:
        check_outputs(program, model, args, kwargs, mode)
    if functions.uses:
        if check:
            check_gradients(program, model, args, kwargs, mode, functions)
        else:
            program.notes.append(
                f"the model uses {functions.describe()}; {DROPPED}, and check=False skipped the gradient "
                "comparison: the captured module's gradients may differ from the model's")
    if check:
        _serve_other_mode(program, model, args, kwargs, dynamic, dynamic_shapes)
    keep_persistence_when_copied(program.module)
    return program


def _export_in_mode(model, args, kwargs, mode: str, dynamic: bool, dynamic_shapes, functions: FunctionCalls,
                    notes: list[str]):
    """Export `model` in `mode`: with dynamic dims when asked (static shapes, with a note, when that fails)."""
    with mode_set(model, mode == "train"):
        if dynamic and dynamic_shapes is None:
            try:
                return _export(model, args, kwargs, _auto_dynamic_shapes(model, args, kwargs), functions)
            except CaptureError as error:
                notes.append(f"dynamic-shape capture failed, captured with static shapes instead: {error}")
        return _export(model, args, kwargs, dynamic_shapes, functions)


# --------------------------------------------------------------------------------------------- export helpers

def _bound_arguments(model: nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        return inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None


def _auto_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict):
    def leaf(item):
        if isinstance(item, torch.Tensor):
            return {i: Dim.AUTO for i in range(item.dim())} if item.dim() else None
        return None

    bound = _bound_arguments(model, args, kwargs)
    if bound is None:
        return None
    sig = inspect.signature(model.forward)
    out = {}
    for name, value in bound.arguments.items():
        parameter = sig.parameters[name]
        if parameter.kind == inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: pytree.tree_map(leaf, v) for k, v in value.items()}
        elif parameter.kind == inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(pytree.tree_map(leaf, v) for v in value)
        else:
            out[name] = pytree.tree_map(leaf, value)
    return out


def first_meta_tensor(model: nn.Module, args, kwargs) -> str | None:
    """The first parameter, buffer or example input on the meta device, described for a message; None if none."""
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in items:
            if tensor.device.type == "meta":
                return f"{kind} '{name}'"
    for position, leaf in enumerate(pytree.tree_leaves((args, kwargs))):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
            return f"example input {position} (flattened)"
    return None


def _refuse_meta(model: nn.Module, args, kwargs) -> None:
    """A model or input on the meta device has no values: capture's check runs the model and compares its outputs,
    and the passes measure and verify real steps. Said up front, naming the first such tensor. (`check=False`
    captures a meta model; `fxmem.estimate` and `fxmem.plan_batch` take one as it is.)"""
    where = first_meta_tensor(model, args, kwargs)
    if where is None:
        return
    if where.startswith("example input"):
        raise CaptureError(f"{where} is on the meta device (no values): give real example inputs")
    raise CaptureError(f"{where} is on the meta device (no values): fxmem runs the model; materialize it first "
                       "(model.to_empty(device=...) and initialise, or load weights); fxmem.estimate and "
                       "fxmem.plan_batch take it as it is (estimates only)")


def _export(model, args, kwargs, dynamic_shapes, functions: FunctionCalls | None = None):
    tracker = ModuleTracker(model)
    functions = functions if functions is not None else FunctionCalls()
    functions.tracker = tracker
    output = None
    try:
        with export_output_kept() as output, warnings_quiet(), record_function_calls(functions), \
                library_sizes_symbolic():
            exported = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
        output.replay()
        return exported
    except Exception as failure:  # noqa: BLE001 - translated into a CaptureError that says where
        path = _failing_module(failure, model)
        error = _capture_error(failure, [path] if path else (tracker.deepest or tracker.stack), model)
        error.details = output.details(failure) if output is not None else None
        raise error from failure
    finally:
        functions.tracker = None
        tracker.close()


@contextlib.contextmanager
def warnings_quiet():
    """export warns about 0/1-specialised dims; fxmem reports specialised dims itself (Program.specialized)."""
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
    current: BaseException | None = exc
    seen = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        trace = current.__traceback__
        while trace is not None:
            slf = trace.tb_frame.f_locals.get("self")
            if isinstance(slf, nn.Module) and id(slf) in names:
                found = names[id(slf)]
            trace = trace.tb_next
        current = current.__cause__ or current.__context__
    return found


def _user_frame(exc: BaseException) -> str | None:
    """The deepest traceback frame outside torch and fxmem: the model code that failed."""
    best = None
    current: BaseException | None = exc
    seen = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame in traceback.extract_tb(current.__traceback__):
            if not is_user_file(frame.filename):
                continue
            best = f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
        current = current.__cause__ or current.__context__
    return best


def _capture_error(error: Exception, module_stack: list[str], model: nn.Module) -> CaptureError:
    first = first_line(str(error)) or type(error).__name__
    where = _user_frame(error)
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
    parts.append(f"{type(error).__name__}: {first[:300]}")
    parts.append(f"hint: {hint_for(error)}")
    return CaptureError("; ".join(parts))


# --------------------------------------------------------------------------------------------- program build

def _flat_input_names(model, args, kwargs) -> list[str]:
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _ in flat:
        key = pytree.keystr(path)  # like "[0][1]" or "[1]['attention_mask']"
        if key.startswith("[0]"):
            rest = key[3:]
            names.append("args" + rest)
        else:
            names.append("kwargs" + key[3:])
    return names


def _program_from_export(exported, model, args, kwargs, mode, notes, *, switchable: bool = True) -> Program:
    """switchable=False keeps export's literal train flags: a graph that only ever runs in the mode it was captured
    in (`fxmem.nn.modes.ModeGraph`)."""
    unlifted = exported.module()
    graph = unlifted.graph
    graph_module = torch.fx.GraphModule(unlifted, graph, class_name=type(model).__name__)
    # pytree codegen reads these
    graph_module._in_spec = unlifted._in_spec
    graph_module._out_spec = unlifted._out_spec

    # input specs for the guard and the list of specialised dims
    names = _flat_input_names(model, args, kwargs)
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    ranges = {str(k): v for k, v in exported.range_constraints.items()}
    specs, specialized = [], []
    for placeholder, name in zip(placeholders, names):
        val = node_value(placeholder, source=EXPORT)
        if not isinstance(val, torch.Tensor):
            specs.append(InputSpec(name, None, constant=(val,) if type(val) in CONSTANT_TYPES else ()))
            continue
        dims = []
        for dim_index, size in enumerate(val.shape):
            if is_concrete_int(size):
                dims.append(DimSpec(static=int(size)))
                specialized.append(SpecializedDim(name, dim_index, int(size)))
            else:
                sym = str(size)
                value_range = ranges.get(sym)
                lower = _as_int(getattr(value_range, "lower", None))
                if lower == 2:
                    lower = 1  # export's 0/1 specialisation: the graph is valid for size 1 (tested per model kind)
                upper = _as_int(getattr(value_range, "upper", None))
                dims.append(DimSpec(static=None, symbol=sym, lower=lower, upper=upper))
        specs.append(InputSpec(name, tuple(dims), str(val.dtype)))

    copy_buffer_persistence(model, graph_module)
    _keep_constants_out_of_state(exported, graph_module)
    _replace_guards(graph_module, specs)
    if switchable:
        make_mode_switchable(graph_module, training=mode == "train")
    graph_module.graph.lint()
    graph_module.recompile()
    graph_module.train(mode == "train")
    return Program(module=graph_module, example_args=args, example_kwargs=kwargs, mode=mode, input_names=names,
                   input_specs=specs, specialized=specialized, notes=notes, model_name=type(model).__name__)


def _keep_constants_out_of_state(exported, graph_module: nn.Module) -> None:
    """Tensors export lifts out of forward (a `torch.tensor(...)` the model makes, a plain tensor attribute) are
    constants of the graph, not the model's state: GraphModule holds them as buffers, made non-persistent here, so
    `state_dict()` has exactly the model's keys and checkpoints load both ways with strict=True."""
    for name in exported.graph_signature.lifted_tensor_constants:
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = graph_module.get_submodule(owner_path) if owner_path else graph_module
        except AttributeError:
            continue
        if leaf in owner._buffers:
            owner._non_persistent_buffers_set.add(leaf)


def _as_int(value):
    try:
        if value is None:
            return None
        number = float(value)
        if number != number or number in (float("inf"), float("-inf")) or abs(number) > 2 ** 62:
            return None
        return int(number)
    except (TypeError, ValueError):
        return None


def _replace_guards(graph_module: torch.fx.GraphModule, specs: list[InputSpec]) -> None:
    for node in list(graph_module.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph_module.graph.erase_node(node)
    if hasattr(graph_module, "_guards_fn"):
        delattr(graph_module, "_guards_fn")
    graph_module.add_submodule("input_guard", InputGuard(specs))
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    ctx = (graph_module.graph.inserting_after(anchor) if anchor is not None
           else graph_module.graph.inserting_before(None))
    with ctx:
        graph_module.graph.call_module("input_guard", tuple(placeholders))


def _serve_other_mode(program: Program, model: nn.Module, args, kwargs, dynamic: bool, dynamic_shapes) -> None:
    """Every train-flag op follows `.train()`/`.eval()` (`fxmem.capture_modes`); when the captured module still
    differs from the model in the other mode, the model's python reads `self.training` (a branch, noise added in
    training only, a mode-dependent value passed to an op without a train flag), which export evaluated once.
    Models without such a branch pay one call per mode, no second capture.

    A train capture then captures eval mode too, served by a graph of its own (`fxmem.mode_graphs`); when that
    fails or does not reproduce the model, a CaptureError. An inference capture (whose passes, int8 weights or
    pruning, would leave a train graph nothing it can run on) makes a call in train mode raise a CaptureError that
    says why (`fxmem.nn.modes.ModeRefusal`)."""
    other = "inference" if program.mode == "train" else "train"
    diff = mode_difference(program.module, model, args, kwargs, other, buffers=True)
    if diff is None:
        return
    name, word = type(model).__name__, _MODE_WORDS[other]
    found = (f"captured in {_MODE_WORDS[program.mode]} mode, {name} computes something else than {name} in {word} "
             f"mode ({diff}): its python reads self.training, which torch.export evaluates once")
    if program.mode == "inference":
        child = attach_mode_refusal(program, True, f"this result of {name} runs in eval mode only: {found}. Train "
                                                   f"{name} itself, or transform it with a train-mode policy")
        program.notes.append(f"{found}: .train() makes a call of the result raise a CaptureError that says so (the "
                             f"submodule '{child}'); train {name} itself, or transform it with a train-mode policy")
        return
    second, where = _capture_other_mode(program, model, args, kwargs, other, found, dynamic, dynamic_shapes)
    child = attach_mode_graph(program, second, {n for n, _ in model.named_parameters(remove_duplicate=False)}
                              | {n for n, _ in model.named_buffers(remove_duplicate=False)})
    program.specialized.extend(s for s in second.specialized if s not in program.specialized)
    program.notes.extend(f"{word}-mode capture: {n}" for n in second.notes)
    program.notes.append(
        f"{found}{where}. fxmem captured {word} mode too: .train()/.eval() switch between the two graphs "
        f"(.{word}() runs the submodule '{child}'). "
        f"Passes rewrite the {_MODE_WORDS[program.mode]}-mode graph; the {word}-mode graph runs as captured, on the "
        "same parameters and buffers, and is checked after every pass")


def _capture_other_mode(program: Program, model: nn.Module, args, kwargs, other: str, found: str, dynamic: bool,
                        dynamic_shapes) -> tuple[Program, str]:
    """The capture of `other` mode, checked against the model, and where it parts from the program's graph (for
    messages); a CaptureError that starts with `found` when it fails or differs."""
    word = _MODE_WORDS[other]
    functions = FunctionCalls()
    notes: list[str] = []
    try:
        exported = _export_in_mode(model, args, kwargs, other, dynamic, dynamic_shapes, functions, notes)
    except CaptureError as error:
        raise CaptureError(f"{found}; capturing {word} mode as well failed: {error}") from error
    second = _program_from_export(exported, model, args, kwargs, other, notes, switchable=False)
    where = branch_location(program.module, second.module)
    err = mode_difference(second.module, model, args, kwargs, other, buffers=True)
    if err is not None:
        raise CaptureError(f"{found}{where}; a capture in {word} mode does not reproduce the model either ({err})")
    if functions.uses:
        try:
            check_gradients(second, model, args, kwargs, other, functions)
        except CaptureError as error:
            raise CaptureError(f"{found}{where}; its {word}-mode capture: {error}") from error
    return second, where


_MODE_WORDS = {"train": "train", "inference": "eval"}
