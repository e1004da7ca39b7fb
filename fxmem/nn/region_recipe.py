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

Which regions may, and the graph work that needs, is `fxmem.nn.region_graph`'s (`recipe_compatible`,
`explicit_values`, `needed_nodes`). The cost model walks the same closure op by op
(`fxmem.costmodel.recipe_closure`). A draw no tape can replay (a dropout of a strided input, drawn by aten.dropout), or a save of a storage that is no
graph value, makes that call keep its saves as they are and the region run as torch's checkpoint from then on. Design: docs/design/checkpoint.md, "Regions
recomputed as recipes".
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch import fx
from torch.utils import _pytree as pytree

from . import dropout as dropout_module
from .recast import aside, is_recipe
from .dropout import DRAW_OPS
from .region_graph import DROPOUTS, needed_nodes, recipe_effects

_CALLS = ("call_function", "call_method", "call_module")
# what a region's recipe run returns, in this order: the closure's values, masks drawn again, inputs made again
_KINDS = ("value", "mask", "input")
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
        plan = _PLANS[region] = RegionRecipes(region.body, keep_masks=bool(region.keep_ops & DRAW_OPS))
        why = recipe_effects([n for n in region.body.graph.nodes if n.op in _CALLS])
        if why:  # (a region marked so by a saved file or by hand, not by the pass)
            plan.applicable = False
            warnings.warn(f"fxmem: checkpoint region {region.label!r} is marked to run as recipes, but {why}: it "
                          "runs as torch's checkpoint", RuntimeWarning, stacklevel=3)
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


def _keyed_graph(body: fx.GraphModule) -> fx.Graph:
    """A copy of the body's graph with each dropout keyed by its position among the draws (`_keyed_dropout`)."""
    graph = fx.Graph()
    out = graph.graph_copy(body.graph, {})
    graph.output(out)
    for key, node in enumerate(n for n in graph.nodes if n.target in DROPOUTS):
        node.target, node.args = _keyed_dropout, (key, DROPOUTS.index(node.target), *node.args)
    return graph


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
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def _keyed_dropout(key: int, kind: int, tensor, probability: float, train: bool, *args, **kwargs):
    """`DROPOUTS[kind](tensor, probability, train, *args, **kwargs)`, its draw (if any) recorded or replayed under
    `key`; a draw that took another way (aten.dropout's own, for an input with gaps) is noted on the tape."""
    function = DROPOUTS[kind]
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
    """The draws of one forward of a region, by key: the packed masks and their sizes, devices and probabilities (to
    be drawn again). A draw without a key (another dropout form) is noted."""

    def __init__(self):
        self.key = None
        self.masks: dict[int, torch.Tensor] = {}
        self.layouts: list[tuple] = []
        self.other_draws = False

    def draw(self, tensor: torch.Tensor, probability: float) -> torch.Tensor:
        if self.key is None:
            self.other_draws = True
        packed = self.masks[self.key] = dropout_module._draw(tensor, probability)
        self.layouts.append((self.key, tensor.numel(), tensor.device, probability))
        self.key = None
        return packed


class _Replay:
    """The draw tape of a recomputation: each keyed draw answered with the forward's packed mask."""

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
        return {key: dropout_module.draw_mask(numel, device, probability)
                for key, numel, device, probability in layouts}
    finally:
        for device, state in now.items():
            _generator(device).set_state(state)
