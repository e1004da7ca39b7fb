"""Which checkpoint regions can run as recipes, and the graph work that needs (`fxmem.nn.region_recipe` runs them).

    recipe_compatible(nodes, keep_ops, restores)   # "" or why the region cannot (the planner and the emitter ask)
    explicit_values(body.graph)                    # at emission: what the region's ops save made graph values
    needed_nodes(nodes, wanted)                    # the closure a recomputation of `wanted` runs

A region runs as recipes when its ops save only graph values or its inputs: no buffer update, no input written in
place, no random op but bool-mask dropout's draw (with the graph's own scale), no submodule, method or other
function call, and composite ops only where what they save is a value (`SAFE_COMPOSITES`; a layer norm and a batched
matmul's operand copies made values by `explicit_values`). The cost model finds the same closure op by op
(`fxmem.costmodel.recipe_closure`). Design: docs/design/checkpoint.md, "Regions recomputed as recipes".
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from .. import ops as optable
from ..matmul_operands import batched as _batched, materialize_matmul_operands
from ..node_value import node_value
from .dropout import DRAW_OPS, bool_mask_dropout, bool_mask_dropout_remat
from .recast import cast_param
from .remat import op_call, op_named, remat, remat_call

# the dropouts whose draws a region's tape records (inside a region `bool_mask_dropout_remat` registers nothing)
DROPOUTS = (bool_mask_dropout, bool_mask_dropout_remat)
_LAYER_NORM = torch.ops.aten.layer_norm.default
_NATIVE_LAYER_NORM = torch.ops.aten.native_layer_norm.default
# what runs inside a recipe region as it runs inside a checkpoint (plainly: the scope steps aside)
_PLAIN_FUNCTIONS = (remat, remat_call, cast_param, operator.getitem)
# norms that update the running statistics they are given (in training)
_STATISTICS_UPDATES = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)

# composite ops (CompositeImplicitAutograd) whose saves are their inputs' storages or their own value's, so that a
# needed closure recomputes all of them; layer_norm's statistics become graph values first (`explicit_values`),
# matmul's and linear's operands only where folding them is a view or the copy is made a value
# (`_folds_without_copy`)
SAFE_COMPOSITES = frozenset({
    "aten.softmax.int", "aten.log_softmax.int", "aten.contiguous.default", "aten.reshape.default",
    "aten.flatten.using_ints", "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
    "aten.conv_transpose1d.default", "aten.conv_transpose2d.input", "aten.conv_transpose3d.input",
    "aten.layer_norm.default", "aten.matmul.default", "aten.linear.default",
})


def recipe_compatible(nodes: list, keep_ops: frozenset, restores: bool, own_saves: dict | None = None) -> str:
    """Why a region of `nodes` (graph order; its inputs are the nodes outside) cannot run as recipes ("" when it
    can): it keeps op outputs (selective), restores buffers it updates, has an effect a closure would repeat or a
    draw it could not replay (`recipe_effects`), or runs an op that could save a tensor of its own making (not a
    graph value a closure recomputes; a composite op). `own_saves`: node -> why it may
    save a tensor of its own making ("" when it cannot), filled as asked (a question of the node alone: a planner
    asking about many regions of one graph passes one dict)."""
    if keep_ops - DRAW_OPS:
        return "selective recomputation"
    if restores:
        return "updates buffers"
    inside = set(nodes)
    known = {} if own_saves is None else own_saves
    for node in nodes:
        why = _effect(node, inside)
        if not why:
            why = known.get(node)
            if why is None:
                why = known[node] = _own_saves(node)
        if why:
            return why
    return ""


def recipe_effects(nodes: list) -> str:
    """The part of `recipe_compatible` that needs no example values: a submodule, method or other function call, a
    random op but bool-mask dropout's draw, an input written in place, running statistics updated ("" when none). A
    region loaded or built with `recipes=True` is held to it at its first run."""
    inside = set(nodes)
    for node in nodes:
        why = _effect(node, inside)
        if why:
            return why
    return ""


def _effect(node: fx.Node, inside: set) -> str:
    if node.op in ("call_module", "call_method"):
        return f"{node.op} {node.target}"
    if node.op != "call_function" or node.target in DROPOUTS or node.target in _PLAIN_FUNCTIONS:
        return ""
    target, args = op_call(node.target, node.args)
    if not isinstance(target, torch._ops.OpOverload):
        return f"calls {getattr(target, '__name__', target)}"
    if torch.Tag.nondeterministic_seeded in target.tags:
        return f"{target} draws random numbers"
    if any(_base(arg) not in inside for arg in optable.written_args(target, args) if isinstance(arg, fx.Node)):
        return f"{target} writes an input in place"
    if target in _STATISTICS_UPDATES and any(isinstance(arg, fx.Node) for arg in args[3:5]):
        return f"{target} updates running statistics"
    return ""


def _own_saves(node: fx.Node) -> str:
    """Why `node` could save a tensor of its own making that is no graph value ("" if it cannot)."""
    if node.op != "call_function":
        return ""
    if node.target in DROPOUTS:
        return ""  # (its one save of its own making, the packed mask, is the tape's: kept or drawn again)
    target, args = op_call(node.target, node.args)
    if isinstance(target, torch._ops.OpOverload) and \
            torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd") and \
            (str(target) not in SAFE_COMPOSITES or not _folds_without_copy(target, args)):
        return f"{target} may save a tensor of its own making"
    return ""


def _folds_without_copy(target, args) -> bool:
    """A linear's input, or a matmul's operands unless batched (whose copies become graph values), fold to 2-D or
    3-D as views (no copy inside the op that its product would save)."""
    if str(target) not in ("aten.matmul.default", "aten.linear.default"):
        return True
    values = [node_value(a, tensor_only=True) if isinstance(a, fx.Node) else None for a in args[:2]]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    if str(target) == "aten.matmul.default" and _batched(*values):
        return True
    operands = values[:1] if str(target) == "aten.linear.default" else values
    return all(v.dim() <= 2 or v.reshape(-1, v.shape[-1])._is_view() for v in operands)


def _base(node):
    """The node whose storage `node` views, following the first argument of view ops (a placeholder: an input)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and \
            isinstance(node.target, torch._ops.OpOverload) and node.target.is_view and node.args:
        node = node.args[0]
    return node


def needed_nodes(nodes: list, wanted: set) -> set:
    """The nodes of `nodes` (graph order) a closure making `wanted` runs: those and, transitively, the nodes among
    `nodes` their arguments come from, and every op that writes in place into a needed node's storage (with what it
    reads). The cost model finds the same set op by op (`fxmem.costmodel.recompute.needed_records`)."""
    inside = set(nodes)
    needed: set = set()
    stack = list(wanted)
    while True:
        while stack:
            node = stack.pop()
            if node in needed or node not in inside:
                continue
            needed.add(node)
            stack.extend(node.all_input_nodes)
        writers = [n for n in nodes if n not in needed and _writes_into(n, needed)]
        if not writers:
            return needed
        stack.extend(writers)


def _writes_into(node: fx.Node, needed: set) -> bool:
    if node.op != "call_function":
        return False
    target, args = op_call(node.target, node.args)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(_base(arg) in needed for arg in optable.written_args(target, args) if isinstance(arg, fx.Node))


def explicit_values(graph: fx.Graph) -> None:
    """Write what a region's ops save as graph values, in place (the pass does so when it emits a recipe region,
    where the graph's example values tell which matmul operands are copied): remat calls as their plain ops (what
    they run inside a region anyway), a layer norm as `native_layer_norm`
    (its mean and reciprocal deviation as getitems), matmul operands that its reshape copies as `contiguous` nodes
    right before it, every tensor a multi-output op returns as a getitem. The same ops, bit for bit, in the same
    order."""
    for node in list(graph.nodes):
        _plain(graph, node)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _LAYER_NORM and len(node.args) >= 2:
            _native_layer_norm(graph, node)
    for matmul in materialize_matmul_operands(graph):
        _copies_next_to(graph, matmul)
    for node in list(graph.nodes):
        _every_item(graph, node)
    graph.lint()


def _plain(graph: fx.Graph, node: fx.Node) -> None:
    """`remat(y, op, ...)` as y and `remat_call(op, *args)` as op(*args): inside a region the scope steps aside and
    they run so (under torch.compile too, the region's checkpoint recomputes them with the rest)."""
    if node.op != "call_function" or node.target not in (remat, remat_call):
        return
    if node.target is remat:
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        return
    kwargs = {k: v for k, v in node.kwargs.items() if not k.startswith("_fxmem_")}
    with graph.inserting_before(node):
        plain = graph.call_function(op_named(node.args[0]), tuple(node.args[1:]), kwargs)
    plain.meta.update(node.meta)
    node.replace_all_uses_with(plain)
    graph.erase_node(node)


def _every_item(graph: fx.Graph, node: fx.Node) -> None:
    """A getitem for each tensor a multi-output op returns that no node takes yet (max pooling's indices, which it
    saves): a graph value too, dropped at once where nothing uses it."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or \
            len(node.target._schema.returns) < 2:
        return
    taken = {u.args[1] for u in node.users if u.target is operator.getitem}
    with graph.inserting_after(node):
        for index in reversed(range(len(node.target._schema.returns))):
            if index not in taken and str(node.target._schema.returns[index].type) == "Tensor":
                graph.call_function(operator.getitem, (node, index))


def _copies_next_to(graph: fx.Graph, name: str) -> None:
    """Move the operand copies `materialize_matmul_operands` put after the operands of matmul `name` to right before
    it, where matmul itself made them: a copy lives no longer in the forward than it did."""
    matmul = next(n for n in graph.nodes if n.name == name)
    for operand in matmul.args:
        if isinstance(operand, fx.Node) and operand.target is torch.ops.aten.contiguous.default:
            matmul.prepend(operand)


def _native_layer_norm(graph: fx.Graph, node: fx.Node) -> None:
    """`aten.layer_norm(x, shape, w, b, eps)` as `native_layer_norm(x, shape, w, b, eps)[0]`, with the statistics
    as getitems too: what layer_norm runs, its saves now graph values."""
    args = list(node.args) + [None] * (5 - len(node.args))
    eps = node.kwargs.get("eps", args[4] if args[4] is not None else 1e-5)
    with graph.inserting_before(node):
        native = graph.call_function(_NATIVE_LAYER_NORM, (args[0], args[1], node.kwargs.get("weight", args[2]),
                                                          node.kwargs.get("bias", args[3]), eps))
        out = graph.call_function(operator.getitem, (native, 0))
        for index in (1, 2):
            graph.call_function(operator.getitem, (native, index))
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
