"""Is the captured module faithful to the model? Its outputs (and buffers) in a mode (`check_outputs`,
`mode_difference`), where a capture of the other mode parts from it (`branch_location`), and, when the model
called a custom autograd.Function or registered a gradient hook, its gradients (`check_gradients`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .capture_functions import DROPPED, FunctionCalls, TensorHook, is_user_file
from .compare import compare_outputs
from .errors import CaptureError, first_line
from .program import Program, buffers_kept, module_stack
from .userstate import mode_set


def check_outputs(program: Program, model: nn.Module, args, kwargs, mode: str) -> None:
    """The captured module must compute what the model computes in the captured mode (train mode with the same RNG
    seed, so dropout draws the same masks)."""
    err = mode_difference(program.module, model, args, kwargs, mode, buffers=False)
    if err is not None:
        raise CaptureError(
            f"captured {type(model).__name__} does not reproduce the model's outputs in {mode} mode "
            f"({err}); the model may depend on python state that torch.export specialised")


def mode_difference(captured: nn.Module, model: nn.Module, args, kwargs, mode: str, *, buffers: bool) -> str | None:
    """How `captured` differs from `model` in `mode` on the example inputs (outputs, and with `buffers` the buffers
    after the call, e.g. a counter only training advances), or None. Each runs from the same buffers, with the same
    seed."""
    ref_out, ref_buffers = _seeded_call(model, mode, args, kwargs)
    got_out, got_buffers = _seeded_call(captured, mode, args, kwargs)
    err = compare_outputs(ref_out, got_out, atol=1e-5, rtol=1e-4)
    if err is None and buffers:
        for name, value in got_buffers.items():
            ref = ref_buffers.get(name)
            if ref is not None and compare_outputs(ref, value, atol=1e-5, rtol=1e-4) is not None:
                return f"buffer '{name}' differs after the call"
    return err


def _seeded_call(module: nn.Module, mode: str, args, kwargs) -> tuple[Any, dict]:
    """Outputs and buffers of one no-grad call in `mode` with seed 1234; the buffers, mode and RNG are put back."""
    with mode_set(module, mode == "train"), buffers_kept(module), torch.no_grad(), \
            torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        out = module(*args, **kwargs)
        out = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)
        after = {name: b.detach().clone() for name, b in module.named_buffers()}
    return out, after


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in [^\n]*\n(?P<code>[^\n]*)')


def _user_line(node: torch.fx.Node) -> str | None:
    """file:line and code of the innermost model-code frame that made `node` (its stack trace), or None."""
    found = None
    for frame in _FRAME.finditer(node.meta.get("stack_trace") or ""):
        if is_user_file(frame["file"]):
            found = f"{frame['file']}:{frame['line']}: {frame['code'].strip()}"
    return found


def branch_location(first: torch.fx.GraphModule, second: torch.fx.GraphModule) -> str:
    """Where the two captures part (for the message): the first model source line that made ops in one graph and
    none in the other, else the first op whose target or constant arguments differ; '' when neither is found."""
    ops = [[n for n in g.graph.nodes if n.op == "call_function"] for g in (first, second)]
    lines = [[_user_line(n) for n in nodes] for nodes in ops]
    for mine, theirs, nodes in ((lines[0], lines[1], ops[0]), (lines[1], lines[0], ops[1])):
        other_lines = set(theirs)
        for line, node in zip(mine, nodes):
            if line is not None and line not in other_lines:
                return _located(node, line)
    for first_op, second_op in zip(*ops):
        if first_op.target != second_op.target or _constants(first_op) != _constants(second_op):
            return _located(first_op, _user_line(first_op))
    return ""


def _constants(node: torch.fx.Node) -> list:
    """The constant arguments of an op, train flags (bools) left out: one graph has them routed to the mode flag."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [x for x in leaves if not isinstance(x, (torch.fx.Node, bool))]


def _located(node: torch.fx.Node, line: str | None) -> str:
    stack = module_stack(node)
    path = stack[-1][0] if stack else ""
    kind = f" ({stack[-1][1]})" if stack and path else ""
    return f" (in module '{path or '<root>'}'{kind}" + (f" at {line}" if line else "") + ")"


def check_gradients(program: Program, model: nn.Module, args, kwargs, mode: str,
                    functions: FunctionCalls) -> None:
    """The model called custom autograd.Functions, whose backward export dropped: the captured module's gradients
    (parameters and floating inputs) must equal the model's on the example inputs, in the captured mode with the
    same RNG seed as `check_outputs`, for one fixed random cotangent per output. Only run when a Function was
    recorded: a graph of aten ops has the aten ops' derivatives, which is what the model has too."""
    graph_module = program.module
    gparams = dict(graph_module.named_parameters())
    params = [(n, p, gparams[n]) for n, p in model.named_parameters() if p.requires_grad and n in gparams]
    used = f"the model uses {functions.describe()}"
    try:
        with buffers_kept(model, graph_module), mode_set(model, mode == "train"):
            graph_module.train(mode == "train")
            try:
                ref = _gradients(model, args, kwargs, [p for _, p, _ in params], inputs=True)
            except Exception:  # noqa: BLE001 - e.g. the model writes into an input in place: parameters only
                try:
                    ref = _gradients(model, args, kwargs, [p for _, p, _ in params], inputs=False)
                except Exception as error:  # noqa: BLE001 - the model's own backward fails: said in a note
                    program.notes.append(
                        f"{used} ({DROPPED}): the captured module's gradients are autograd's "
                        "derivative of the inlined forward, not the Function's backward; they could not be compared "
                        f"because the model's backward raised {_error_summary(error)}")
                    return
            if not ref.outputs:
                program.notes.append(f"{used} ({DROPPED}); gradients were "
                                     "not compared: no output of the model requires grad")
                return
            try:
                got = _gradients(graph_module, args, kwargs, [q for _, _, q in params], inputs=bool(ref.inputs),
                                 cotangents=ref.cotangents)
            except Exception as error:  # noqa: BLE001 - reported in the CaptureError below
                got = error
    finally:
        graph_module.train(mode == "train")

    diff = None
    if isinstance(got, Exception):
        diff = f"the captured module's backward fails ({_error_summary(got)})"
    elif got.outputs != ref.outputs:
        leaf = min(set(ref.outputs) ^ set(got.outputs))
        where, other = ("the model", "the captured module") if leaf in ref.outputs else ("the captured module",
                                                                                         "the model")
        diff = (f"output leaf {leaf} requires grad in {where} but not in {other} (a Function's forward runs "
                "under no_grad, and export keeps that)")
    else:
        labels = [f"parameter '{n}'" for n, _, _ in params]
        labels += [f"input '{program.input_names[i]}'" for i in ref.inputs]
        for label, expected, actual in zip(labels, ref.grads, got.grads):
            difference = _grad_diff(expected, actual)
            if difference is not None:
                diff = f"the gradient of {label} differs ({difference})"
                break
    if diff is not None:
        hint = ("register the operation with torch.library.custom_op and give it its backward with "
                "register_autograd (plus register_fake): export keeps a custom op as one node with its backward")
        if TensorHook in functions.uses:
            hint = ("register gradient hooks on the captured module's parameters after capture, or make what the hook "
                    "does part of the computation; for a Function: " + hint)
        if any(u.name.endswith(" torch.utils.checkpoint.CheckpointFunction") for u in functions.uses.values()):
            hint = ("use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or no checkpoint call at all "
                    "(fxmem's checkpoint pass chooses what to recompute); or " + hint)
        raise CaptureError(
            f"captured {type(model).__name__} computes different gradients from the model: {diff}. {used[0].upper()}"
            f"{used[1:]}; {DROPPED}. hint: {hint}")
    gap = _largest_gap(ref.grads, got.grads)
    agreement = "the same gradients" if gap == 0 else \
        f"gradients within the tolerance but not bit-identical (max abs diff {gap:.3g})"
    program.notes.append(
        f"{used}: {DROPPED}; autograd's derivative of the "
        f"inlined forward gives {agreement} on the example inputs (parameters"
        + (" and inputs" if ref.inputs else "") + f", {mode} mode), so the capture is kept")


def _largest_gap(expected: list, actual: list) -> float:
    """The largest absolute difference between paired gradients (`_as_pair`); 0.0 when all are equal."""
    pairs = [pair for pair in map(_as_pair, expected, actual) if pair is not None and pair[0].numel()]
    return max((float((ref - got).abs().max()) for ref, got in pairs), default=0.0)


def _error_summary(error: BaseException) -> str:
    line = first_line(str(error))
    return f"{type(error).__name__}: {line[:200]}" if line else type(error).__name__


@dataclass
class _Grads:
    grads: list            # of the parameters, then of the floating inputs (None: no gradient)
    inputs: list[int]      # flat indices of the floating inputs that got requires_grad
    outputs: list[int]     # flat indices of the output leaves that require grad
    cotangents: list       # the fixed random cotangent of each of those outputs


def _gradients(module, args, kwargs, params, *, inputs: bool, cotangents=None) -> _Grads:
    """One forward with a fixed RNG seed from the buffers as they are (put back after it: the model and the
    captured module share them), then a backward of fixed random cotangents."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    idx = [i for i, x in enumerate(flat) if inputs and isinstance(x, torch.Tensor) and x.is_floating_point()]
    flat = list(flat)
    for index in idx:
        flat[index] = flat[index].detach().clone().requires_grad_(True)
    call_args, call_kwargs = pytree.tree_unflatten(flat, spec)
    with torch.enable_grad(), torch.random.fork_rng(devices=[]), buffers_kept(module):
        torch.manual_seed(1234)
        out = module(*call_args, **call_kwargs)
    leaves = pytree.tree_leaves(out)
    out_idx = [i for i, o in enumerate(leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
    outs = [leaves[i] for i in out_idx]
    if cotangents is None:
        generator = torch.Generator().manual_seed(4321)
        # drawn on the CPU generator (the same numbers on any device), then put where the output is
        cotangents = [torch.randn(o.shape, generator=generator, dtype=torch.float32).to(o.device, o.dtype)
                      for o in outs]
    if not outs or [o.shape for o in outs] != [c.shape for c in cotangents]:
        return _Grads([], idx, out_idx, cotangents)
    # backward() rather than autograd.grad(): reentrant checkpoint (a Function too) refuses the latter. The
    # parameters' .grad are the user's: kept aside and put back
    wrt = list(params) + [flat[i] for i in idx]
    saved = [(p, p.grad) for p in {id(p): p for p in [*module.parameters(), *params]}.values()]
    try:
        for param, _ in saved:
            param.grad = None
        torch.autograd.backward(outs, grad_tensors=cotangents)
        grads = [t.grad for t in wrt]
    finally:
        for param, grad in saved:
            param.grad = grad
    return _Grads(grads, idx, out_idx, cotangents)


def _as_pair(expected: torch.Tensor | None, actual: torch.Tensor | None) -> tuple | None:
    """The model's and the capture's gradient as doubles, a missing one as zeros; None when both are missing."""
    if expected is None and actual is None:
        return None
    ref = torch.zeros_like(actual) if expected is None else expected
    got = torch.zeros_like(expected) if actual is None else actual
    return ref.detach().double(), got.detach().double()


def _grad_diff(expected: torch.Tensor | None, actual: torch.Tensor | None) -> str | None:
    pair = _as_pair(expected, actual)
    if pair is None:
        return None
    ref_double, got_double = pair
    tol = 1e-5 + 1e-4 * float(ref_double.abs().max()) if ref_double.numel() else 0.0
    if torch.allclose(ref_double, got_double, atol=tol, rtol=1e-4, equal_nan=True):
        return None
    return (f"max abs diff {float((ref_double - got_double).abs().max()):.3g}, "
            f"model's max abs {float(ref_double.abs().max()):.3g}")
