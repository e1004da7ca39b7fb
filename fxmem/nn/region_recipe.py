"""A checkpoint region recomputed as recipes: only the values its backward reads, under no_grad, once.

torch's non-reentrant checkpoint refills a region's saves by running the region's forward again with autograd
on, up to its last save: every op before that runs again whether backward reads its output or not (a block's
second MLP matmul, whose output only a dropout and a residual add consume, neither saving it), and each records
autograd's graph again. Run as recipes, the region's forward runs once as plain graph code inside the module's
`RecastScope`, its saves deferred; every value a save holds is then registered as one output of a shared recipe,
the region's *needed closure*: the body cut down to the nodes those values need (`needed_nodes`), run in backward
under no_grad at the first unpack, each value held until its own last unpack. What is kept is what the checkpoint
kept: the region's inputs (nested as recipes where they are remat outputs, made again with the closure) and, where
the plan keeps them, its dropout masks; where it draws them again ("redraw"), the recipe holds the generators'
states from before the forward and the masks' layouts, and draws all of them again, in order, before the closure
runs. Values, gradients and the generators' states after the step are the checkpoint's.

    CheckpointRegion(body, keep_ops, recipes=True)      # the checkpoint pass, where `recipe_compatible` admits it
    outputs = run_as_recipes(region, scope, args)       # its training forward; None: run the checkpoint instead

The pass admits full and redraw regions whose ops save only graph values or inputs (`recipe_compatible`: no
buffer update, no input written in place, no random op but bool-mask dropout's draw, no composite op that could
save a tensor of its own making) and writes a layer norm's statistics and matmul's operand copies as graph values
first (`explicit_values`). The cost model walks the same closure op by op (`fxmem.costmodel.recipe_closure`).
A draw no tape can replay (a dropout of a strided input, drawn by aten.dropout) makes that call keep its saves as
they are and the region run as torch's checkpoint from then on. Design: docs/design/checkpoint.md, "Regions
recomputed as recipes".
"""
from __future__ import annotations

import operator
import warnings
import weakref

import torch
from torch import fx

from .. import ops as optable
from ..matmul_operands import batched as _batched, materialize_matmul_operands
from ..node_value import node_value
from . import dropout as dropout_module
from .dropout import bool_mask_dropout, bool_mask_dropout_remat
from .recast import aside, cast_param, is_recipe
from .remat import op_call, op_named, remat, remat_call

_CALLS = ("call_function", "call_method", "call_module")
# what a region's recipe run returns, in this order: the closure's values, masks drawn again, inputs made again
_KINDS = ("value", "mask", "input")
# the dropouts whose draws a region's tape records (inside a region `bool_mask_dropout_remat` registers nothing)
_DROPOUTS = (bool_mask_dropout, bool_mask_dropout_remat)
_LAYER_NORM = torch.ops.aten.layer_norm.default
_NATIVE_LAYER_NORM = torch.ops.aten.native_layer_norm.default

# what runs inside a recipe region as it runs inside a checkpoint (plainly: the scope steps aside)
_PLAIN_FUNCTIONS = (remat, remat_call, cast_param, operator.getitem)
# norms that update the running statistics they are given (in training)
_STATISTICS_UPDATES = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)
# region module -> its RegionRecipes (built at the first training forward; nothing is stored on the module, so
# state dicts, saved results and deep copies are as before)
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def run_as_recipes(region, scope, args: tuple):
    """The region's forward, its saves kept as recipes of its needed closure (module docstring); None when the
    region does not run so (`region.fxmem_region.as_recipes` False: the caller checkpoints it)."""
    if not region.fxmem_region.as_recipes:
        return None
    plan = _PLANS.get(region)
    if plan is None:
        plan = _PLANS[region] = RegionRecipes(region.body, keep_masks=bool(region.keep_ops & DRAWS))
    if not plan.applicable:
        return None
    outputs, replayable = plan.run(scope, args)
    if not replayable or plan.unknown_saves:
        # (this call kept those saves as they were; the next ones checkpoint, as the plan's bytes assume)
        plan.applicable = False
        if plan.unknown_saves:
            warnings.warn(f"fxmem: checkpoint region {region.label!r} saved {plan.unknown_saves} tensor(s) of its "
                          "own making that are no graph value, which its recipes cannot make again: kept this step, "
                          "recomputed by torch's checkpoint from the next", RuntimeWarning, stacklevel=3)
    return outputs


# the ops a recipe region's keep_ops may name: its dropout draws (kept as masks, or drawn again)
DRAWS = frozenset({"bernoulli"})
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


def recipe_compatible(nodes: list, keep_ops: frozenset, restores: bool) -> str:
    """Why a region of `nodes` (graph order; its inputs are the nodes outside) cannot run as recipes ("" when it
    can): it keeps op outputs (selective), restores buffers it updates, writes an input in place, draws random
    numbers other than bool-mask dropout's, calls a submodule, a method or a function with effects, or runs a
    composite op that could save a tensor of its own making (not a graph value a closure recomputes)."""
    if keep_ops - DRAWS:
        return "selective recomputation"
    if restores:
        return "updates buffers"
    inside = set(nodes)
    for node in nodes:
        why = _node_incompatible(node, inside)
        if why:
            return why
    return ""


def _node_incompatible(node: fx.Node, inside: set) -> str:
    if node.op in ("call_module", "call_method"):
        return f"{node.op} {node.target}"
    if node.op == "call_function" and node.target in _DROPOUTS:
        return _dropout_incompatible(node)
    if node.op != "call_function" or node.target in _PLAIN_FUNCTIONS:
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
    name = str(target)
    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd") and \
            (name not in SAFE_COMPOSITES or not _folds_without_copy(target, args)):
        return f"{target} may save a tensor of its own making"
    return ""


def _dropout_incompatible(node: fx.Node) -> str:
    """A bool-mask dropout without the graph's own scale in its input's dtype makes its scale, a tensor it saves,
    inside (no graph value a closure could make again)."""
    args = list(node.args) + [node.kwargs.get(k) for k in ("scale", "scale_dtype")][len(node.args) - 3:]
    value = node_value(args[0], tensor_only=True) if args else None
    if len(args) < 5 or args[3] is None or value is None or value.dtype != args[4]:
        return "a dropout makes its scale inside"
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


class RegionRecipes:
    """One region's body with its dropouts keyed (`graph`), its forward noting each value as it is made
    (`forward`), and its needed closures per set of values backward reads (built at first need)."""

    def __init__(self, body: fx.GraphModule, keep_masks: bool):
        self.keep_masks = keep_masks
        self.applicable = True
        self.graph = _keyed_graph(body)
        self.values = [n for n in self.graph.nodes if n.op in _CALLS]
        self.forward = _forward_module(body, self.graph, self.values)
        self.closures: dict[tuple, fx.GraphModule] = {}
        self.root = body
        self.constants = [getattr(body, n.target) for n in body.graph.nodes if n.op == "get_attr"]
        self.constants = [t for t in self.constants if isinstance(t, torch.Tensor)]
        self.unknown_saves = 0  # saves of a storage the region made that is no graph value (kept as they are)

    def run(self, scope, args: tuple) -> tuple:
        """The forward (see `run_as_recipes`): (outputs, whether its draws can be replayed; if not, every save was
        kept as it was)."""
        held = scope.as_recipe_args(args)  # (before the body: an in-place op must not turn an input into its output)
        tape = _Tape()
        states = None if self.keep_masks else _generator_states(args)
        previous, pending = scope.defer_saves()
        token = dropout_module._TAPE.set(tape)
        try:
            with aside():  # (remat and casts inside run plainly, as in a checkpoint; the saves still defer)
                notes: list = []
                outputs = self.forward(*args, notes)
        finally:
            dropout_module._TAPE.reset(token)
            scope.stop_deferring(previous)
        if tape.other_draws:
            scope.pack_deferred(pending)  # (a draw the tape could not replay: every save kept as it is)
            return outputs, False
        indices, keys, positions, read = self._read(notes, tape, pending, args, held)
        replaced = []
        if read:
            draws = tape.masks if self.keep_masks else (states, tape.layouts)
            run = _ClosureRun(self.closure(indices), draws, keys, positions)
            replaced = scope.register_region_values(run, held, read)
        scope.pack_deferred(pending)
        # (the outputs' saves outside the region keep them, as a checkpoint's do; an input that is a recipe's
        # output is that recipe again for the saves after the region)
        scope.unregister(replaced)
        return outputs, True

    def _read(self, notes: list, tape: "_Tape", pending: list, args: tuple, held: tuple) -> tuple:
        """What the region's deferred saves hold that the run makes: (indices of the values, keys of the masks,
        positions of the inputs, the saved tensors, one per storage, in that order). Per storage the last value made
        in it (an in-place op's output is its final content, which a save holds; `notes`: (value index, weak
        reference to its storage), so a storage is never taken for a dead one at the same address); masks where
        they are drawn again (kept masks are saved as they are); inputs that are recipes' outputs (`held`), which
        the run makes again anyway (other inputs are saved as they are)."""
        made: dict[int, tuple] = {}
        for index, ref in notes:
            storage = ref()
            if storage is not None:
                made[storage._cdata] = ("value", index, ref)
        if not self.keep_masks:
            for key, mask in tape.masks.items():
                storage = mask.untyped_storage()
                made[storage._cdata] = ("mask", key, weakref.ref(storage))
        for position, (arg, kept) in enumerate(zip(args, held)):
            if isinstance(arg, torch.Tensor):
                storage = arg.untyped_storage()
                if is_recipe(kept):
                    made[storage._cdata] = ("input", position, weakref.ref(storage))
                else:
                    made.pop(storage._cdata, None)  # (an input's storage: kept by the recipe, saved as it is)
        known = {t.untyped_storage()._cdata for t in (*_tensors(args), *tape.masks.values(), *self.constants)}
        found: dict[tuple, torch.Tensor] = {}
        for deferred in pending:
            tensor = deferred.value
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                item = made.get(storage._cdata)
                if item is not None and item[2]() is storage:
                    found.setdefault(item[:2], tensor)
                elif storage._cdata not in known:
                    self.unknown_saves += 1
        # (values, then masks, then inputs: the order the run returns them in)
        ordered = sorted(found, key=lambda item: (_KINDS.index(item[0]), item[1]))
        parts = tuple(tuple(index for kind, index in ordered if kind == name) for name in _KINDS)
        return (*parts, [found[item] for item in ordered])

    def closure(self, indices: tuple) -> fx.GraphModule:
        """The forward graph cut down to the values at `indices` (returned in that order, `needed_nodes`); its
        dropouts replay their draws by key (`_Tape`)."""
        closure = self.closures.get(indices)
        if closure is None:
            graph = fx.Graph()
            copied: dict = {}
            graph.graph_copy(self.graph, copied)
            wanted = [copied[self.values[index]] for index in indices]
            calls = [n for n in graph.nodes if n.op in _CALLS]
            needed = needed_nodes(calls, set(wanted))
            graph.output(tuple(wanted))
            for node in reversed(calls):
                if node not in needed:
                    graph.erase_node(node)
            closure = self.closures[indices] = fx.GraphModule(self.root, graph)
        return closure


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


def _keyed_graph(body: fx.GraphModule) -> fx.Graph:
    """A copy of the body's graph with each dropout keyed by its position among the draws (`_keyed_dropout`)."""
    graph = fx.Graph()
    out = graph.graph_copy(body.graph, {})
    graph.output(out)
    for key, node in enumerate(n for n in graph.nodes if n.target in _DROPOUTS):
        node.target, node.args = _keyed_dropout, (key, _DROPOUTS.index(node.target), *node.args)
    return graph


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


def _forward_module(body: fx.GraphModule, graph: fx.Graph, values: list) -> fx.GraphModule:
    """The region's forward with one more argument, a list to which it notes each value's index and a weak reference
    to its storage as it is made (`_note`): no value lives longer than in the body."""
    forward = fx.Graph()
    copied: dict = {}
    out = forward.graph_copy(graph, copied)
    last_input = list(forward.find_nodes(op="placeholder"))[-1]
    with forward.inserting_after(last_input):
        notes = forward.placeholder("_fxmem_notes")
    for index, value in enumerate(values):
        with forward.inserting_after(copied[value]):
            forward.call_function(_note, (notes, index, copied[value]))
    forward.output(out)
    return fx.GraphModule(body, forward)


def _note(notes: list, index: int, value) -> None:
    """Note a tensor value's index and its storage (weakly) while the region's forward runs."""
    if isinstance(value, torch.Tensor):
        notes.append((index, weakref.ref(value.untyped_storage())))




def _tensors(values) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _tensors(v)]
    return []


def _keyed_dropout(key: int, kind: int, tensor, probability: float, train: bool, *args, **kwargs):
    """`_DROPOUTS[kind](tensor, probability, train, *args, **kwargs)`, its draw (if any) recorded or replayed under
    `key`; a draw that took another way (aten.dropout's own, for an input with gaps) is noted on the tape."""
    function = _DROPOUTS[kind]
    tape = dropout_module._TAPE.get()
    if tape is None:
        return function(tensor, probability, train, *args, **kwargs)
    tape.key = key
    out = function(tensor, probability, train, *args, **kwargs)
    if tape.key is not None and train and 0 < probability < 1 and tensor.numel():
        tape.other_draws = True
    tape.key = None
    return out




class _Tape:
    """The draws of one forward of a region, by key: the masks and their layouts and probabilities (to be drawn
    again). A draw without a key (another dropout form) is noted."""

    def __init__(self):
        self.key = None
        self.masks: dict[int, torch.Tensor] = {}
        self.layouts: list[tuple] = []
        self.other_draws = False

    def draw(self, tensor: torch.Tensor, probability: float) -> torch.Tensor:
        if self.key is None:
            self.other_draws = True
        keep = self.masks[self.key] = dropout_module._draw(tensor, probability)
        self.layouts.append((self.key, tensor.shape, tensor.stride(), tensor.device, probability))
        self.key = None
        return keep


class _Replay:
    """The draw tape of a recomputation: each keyed draw answered with the forward's mask."""

    def __init__(self, masks: dict):
        self.masks, self.key = masks, None
        self.other_draws = False

    def draw(self, tensor: torch.Tensor, probability: float) -> torch.Tensor:
        key, self.key = self.key, None
        return self.masks[key]


class _ClosureRun:
    """A recipe's function: the needed closure on the region's inputs (recipes' outputs among them made again), its
    draws replayed from the forward's masks (a dict) or drawn again (generator states and layouts). Returns a list:
    the closure's values, the masks at `keys`, the inputs at `positions` (`fxmem.nn.recast` drops each item at its
    last use)."""
    __slots__ = ("closure", "draws", "keys", "positions", "__name__")

    def __init__(self, closure: fx.GraphModule, draws, keys: tuple, positions: tuple):
        self.closure, self.draws, self.keys, self.positions = closure, draws, keys, positions
        self.__name__ = "checkpoint region (needed values)"

    def __call__(self, *args) -> list:
        masks = self.draws if isinstance(self.draws, dict) else _draw_again(*self.draws)
        token = dropout_module._TAPE.set(_Replay(masks))
        try:
            values = list(self.closure(*args))
        finally:
            dropout_module._TAPE.reset(token)
        return values + [masks[key] for key in self.keys] + [args[position] for position in self.positions]


def _generator_states(args: tuple) -> dict:
    """The default generators' states of the devices the region's inputs are on (what its draws will use)."""
    states = {}
    for tensor in _tensors(args):
        device = tensor.device
        if device not in states and device.type != "meta":
            states[device] = _generator(device).get_state()
    return states


def _generator(device: torch.device):
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


def _draw_again(states: dict, layouts: list) -> dict:
    """The forward's masks, drawn again from the generators' states before it, in its order; the generators are
    left as they were."""
    now = {device: _generator(device).get_state() for device in states}
    try:
        for device, state in states.items():
            _generator(device).set_state(state)
        return {key: dropout_module.draw_mask(shape, stride, device, probability)
                for key, shape, stride, device, probability in layouts}
    finally:
        for device, state in now.items():
            _generator(device).set_state(state)
