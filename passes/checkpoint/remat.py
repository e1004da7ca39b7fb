"""Remat: activations that are cheap functions of tensors autograd keeps anyway are recomputed, not saved.

`remat_sites` finds them in a forward trace (a GELU, dropout or norm output a matmul saves while the op's inputs
are saved too; ReLU and batch norm -> ReLU chains; poolings; a CNN's first convolution), cheapest recompute per
byte first. `apply_remat` rewrites each as `fxmem.nn.remat.remat(y, 'aten.op', *args)` or
`remat_call('aten.op', *args)`: consumers' saved-tensor hooks keep a recipe and backward runs the op again, bit
for bit. `remat_plan` says which recipes are recomputed once for all their saves and which hold which nested.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import fx

from fxmem import ops as optable
from fxmem.costmodel import CPU_BALANCE, RecipeLayout, TraceIndex, as_recipes, op_cost, smallest_fitting_prefix, value_key
from fxmem.nn.dropout import bool_mask_dropout, bool_mask_dropout_remat
from fxmem.nn.recast import flat_args, install as install_recast
from fxmem.nn.remat import INTERNAL_SAVES, op_named, remat, remat_call
from fxmem.node_value import node_value
from fxmem.pass_api import Change
from fxmem.program import Program

from .candidates import module_paths

REMAT_NORMS = frozenset({"layer_norm", "group_norm", "rms_norm", "native_layer_norm", "native_group_norm",
                         "batch_norm"})
# copies that join tensors: a remat site (a U-Net's skip concatenation), its inputs held or chained
REMAT_JOINS = frozenset({"cat", "stack"})
# pooling (a CNN's down-sampling): max pooling also keeps its int64 argmax indices, recomputed with it
# (fxmem.nn.remat.INTERNAL_SAVES)
REMAT_POOLS = frozenset({"max_pool2d", "max_pool3d", "avg_pool2d"})
# producers a join may recompute as a chain member when nobody else keeps their output (a U-Net's upsampling
# convolution, whose input it saves anyway): dearer than pointwise ops, so never sites of their own
REMAT_CHAIN_ONLY = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
# an input-fed matmul or convolution (a CNN's first convolution, on few input channels) is a site when its
# recompute costs at most this many times balance per byte of its output (roofline cost per byte / balance; with
# FLOPs alone, per byte / CPU_BALANCE): it admits a short-reduction convolution at the cost model's
# SLOW_KERNELS_CPU rate; it is ranked by that cost, after the cheap sites
REMAT_INPUT_MATMUL_PASSES = 20.0
# matrix products and convolutions that are sites when their inputs are held anyway (remat_sites(products=True)),
# at most REMAT_INPUT_MATMUL_PASSES dear per byte
REMAT_PRODUCTS = frozenset({"linear", "mm", "addmm", "bmm", "matmul", "convolution", "conv1d", "conv2d", "conv3d"})
# normalizations over a dim that save their output, sites among product sites (an attention softmax, recomputed
# with its scores)
REMAT_SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
# how many producers deep a chain may reach back to held tensors (softmax <- masked_fill <- scale <- q @ k^T)
REMAT_CHAIN_DEPTH = 4
# a softmax site's recipe may keep tensors nobody saves (a mask or position bias built in the graph, often one for
# all layers): their bytes, each shared among the sites keeping it, at most this share of the bytes the site frees
REMAT_KEPT_SHARE = 0.5
# cheaper sites tried, each with one estimate, in place of the one completing the cheapest-per-byte prefix
REMAT_LAST_SITE_TRIES = 8
# the keyword arguments apply_remat adds to a node (left out of a chain member's kwargs under torch.compile)
_REMAT_KWARGS = ("_fxmem_chain", "_fxmem_share", "_fxmem_nest", "_fxmem_group", "_fxmem_defer")


@dataclass
class RematSite:
    """An activation a consumer saves that is a cheap function of tensors autograd keeps anyway."""
    node: fx.Node
    key: int  # storage key of its output in the trace
    bytes: int  # what the consumers' saves hold
    cost: float  # recompute cost (roofline): once per saving op in backward, once in all if `share`
    path: str
    chain: tuple = ()  # cheap producers recomputed with it (their outputs are not kept either): batch norm -> ReLU
    call: bool = False  # emitted as remat_call: the op saves its own output, runs in place, or has a chain
    share: bool = False  # its savers run their backward back to back: recomputed once, for all of them
    internal: tuple = ()  # storage keys of what else the op saves of its own making (max pooling's indices)
    holds: tuple = ()  # names of the sites whose outputs it holds nested, when applied (its inputs, its chain's)
    # names of the sites holding it nested that backward recomputes right next to its own saves (a max pooling of
    # this ReLU): their recomputations can take its value shared with its saves (`remat_plan`)
    adjacent: tuple = ()
    contiguous: bool = True  # its own saves are unpacked back to back (or there is one)
    # its output's and internal saves are unpacked back to back: one run of the full op makes both (`_fxmem_group`)
    group: bool = False
    call_with: tuple = ()  # names of the sites it holds nested, when applied with it: then a call too
    # storage keys its recipe keeps that nothing saves (a softmax's mask; a dropout's on an input without gradient)
    kept: tuple = ()
    via: tuple = ()  # (input name, site name) per input holding another site's output (`holds`): it, or a view of it
    # names of its nodes (chain members, itself) whose ops save their own output or an internal one (ReLU, max
    # pooling): as remat_calls, their saves wait until those are recipes (`_fxmem_defer`); the others' need not
    self_saving: tuple = ()

    def is_call(self, applied: set) -> bool:
        """Emitted as remat_call among the `applied` site names: a call, or holding an applied site nested."""
        return self.call or any(name in applied for name in self.call_with)

    @property
    def keys(self) -> set:
        return {self.key, *self.internal}


def remat_op(node: fx.Node) -> bool:
    """A cheap op remat can run again: pointwise (in place too), a layer/group/RMS/batch norm, a join, a pooling."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable and not optable.packet(target).endswith("_"):
        return False
    category = optable.category(target)
    return category == optable.POINTWISE or (category == optable.NORM and optable.packet(target) in REMAT_NORMS) \
        or optable.packet(target) in REMAT_JOINS or optable.packet(target) in REMAT_POOLS


def input_fed_matmul(node: fx.Node) -> bool:
    """A matmul-like op (convolution, linear) whose tensor inputs are all graph inputs or parameters."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        optable.category(target) == optable.MATMUL and not target._schema.is_mutable and \
        all(a.op in ("placeholder", "get_attr") for a in node.all_input_nodes)


def held_matmul(node: fx.Node) -> bool:
    """A linear, matrix product or convolution not writing in place: a site when its inputs are held anyway (it
    saves its input itself: the first half of an MLP under its activation, a convolution under its batch norm)."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        optable.packet(target) in REMAT_PRODUCTS and not target._schema.is_mutable


def product_site(site: RematSite) -> bool:
    """A site only `remat_sites(products=True)` finds: a matrix product whose inputs are not all graph inputs or
    parameters."""
    return held_matmul(site.node) and not input_fed_matmul(site.node)


def softmax_op(node: fx.Node) -> bool:
    """A softmax (or log-softmax) call."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
        optable.packet(node.target) in REMAT_SOFTMAX


def softmax_site(site: RematSite) -> bool:
    """A site only `remat_sites(scores=True)` finds: a softmax (recomputed with its scores)."""
    return softmax_op(site.node)


def chain_op(producer: fx.Node, site: fx.Node) -> bool:
    """`producer` may be recomputed as a member of `site`'s chain: a cheap op, or a transposed convolution
    feeding a join."""
    if remat_op(producer):
        return True
    target = producer.target
    return producer.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        optable.packet(target) in REMAT_CHAIN_ONLY and isinstance(site.target, torch._ops.OpOverload) and \
        optable.packet(site.target) in REMAT_JOINS


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs (bool-mask dropout: its input alone, not the mask's parameters)."""
    inputs = node.args[:1] if node.target is bool_mask_dropout else node.all_input_nodes
    return [a for a in inputs if a.op in ("placeholder", "get_attr")
            or node_value(a, tensor_only=True) is not None]


class _SiteFinder:
    """A forward trace (`traced`: what `trace_forward` returned) indexed to find remat sites: per node its op
    records outside regions, per storage its savers."""

    def __init__(self, traced, balance: float | None, products: bool, scores: bool = False):
        recorder, self.base_keys, self.out_keys = traced.recorder, traced.base_keys, traced.out_keys
        self.products, self.scores = products, scores
        self.records = [r for r in recorder.records if r.region is None]
        self.storage_bytes = recorder.storage_bytes
        self.balance = balance
        self.by_node: dict[str, list] = {}
        for record in self.records:
            self.by_node.setdefault(record.node, []).append(record)
        self.position = {r.idx: i for i, r in enumerate(self.records)}
        self.first_saver: dict[int, int] = {}  # storage key -> index of the first record saving it
        self.savers: dict[int, list] = {}
        for record in self.records:
            for key in record.saved:
                self.first_saver.setdefault(key, record.idx)
                self.savers.setdefault(key, []).append(record)
        # storage key -> index of the last record writing it in place (the index lists writes in record order)
        self.last_write = {key: idx for idx, keys in TraceIndex.of(recorder).writes for key in keys}
        self.per_unpack: dict[str, tuple] = {}  # site -> (recompute cost once, times backward recomputes it)
        self.unpacked_at: dict[str, set] = {}  # site -> positions (in records) of the records saving its outputs

    def product(self, node: fx.Node) -> bool:
        """`node` may be a matrix-product site held nested (`held_matmul`, when looking for those)."""
        return self.products and held_matmul(node)

    def softmax(self, node: fx.Node) -> bool:
        """`node` is a softmax that may be a site (`scores`: its chain reaches back through the scores' matrix
        product to operands held anyway)."""
        return self.scores and softmax_op(node)

    def key_of(self, arg) -> int | None:
        return value_key(self.by_node, arg) if isinstance(arg, fx.Node) else None

    def held(self, arg: fx.Node, key: int, last: int) -> bool:
        """`arg` is held until the saves of `key` are unpacked anyway: a parameter or input, a base storage, or a
        tensor an op up to record `last` saves."""
        if arg.op in ("placeholder", "get_attr"):
            return True
        arg_key = self.key_of(arg)
        return arg_key is not None and arg_key != key and (
            self.base_keys.get(arg_key) is not None or self.first_saver.get(arg_key, last + 1) <= last)

    def cost_of(self, node: fx.Node) -> float:
        records = [r for r in self.by_node.get(node.name, [])
                   if optable.category(r.func) not in (optable.RANDOM, optable.CREATION)]
        return sum(op_cost(r, self.balance) for r in records)

    def back_to_back(self, positions: set, between: set = frozenset()) -> bool:
        """Records at these positions run their backwards one after another: nothing between them but ops without
        a backward or views (no saves, no new tensors), or the records at `between`."""
        if not positions:
            return True
        records = self.records
        return all(i in positions or i in between or not records[i].out_rg or (not records[i].saved
                                                                        and not records[i].new_keys)
                   for i in range(min(positions), max(positions) + 1))

    def chain(self, node: fx.Node, key: int, last: int, dropout: bool, in_place: bool, depth: int = 1,
              deep: bool = False) -> list | None:
        """The producers `node` recomputes with it, producers first: each tensor input not held is made by a cheap
        op nobody keeps (`deep`, a softmax's chain: a matrix product too), from held tensors or, up to `depth` producers
        back, from such producers themselves (an attention softmax <- masked_fill <- scale <- q @ k^T), or is the
        tensor an in-place op overwrites; `deep`, an input none of that reaches may be kept by the recipe
        (`keepable`: a mask built in the graph). None when some input is neither."""
        members = []
        for index, arg in enumerate(tensor_inputs(node)):
            overwritten = in_place and index == 0
            if self.held(arg, key, last) and not overwritten:
                continue
            made = None if dropout or depth <= 0 else self._made_again(arg, node, key, last, depth, deep)
            if made is not None:
                members.extend(made)
            elif not (deep and not overwritten and self.keepable(arg, key, last)):
                return None
        return list(dict.fromkeys(members))

    def _made_again(self, arg: fx.Node, consumer: fx.Node, key: int, last: int, depth: int,
                    deep: bool) -> list | None:
        """`arg` recomputed as a chain member through `consumer`, with the producers it needs (`chain`, one
        producer less deep), producers first; None when it cannot be."""
        if not self._chainable(arg, consumer, key, deep):
            return None
        if all(self.held(b, key, last) for b in tensor_inputs(arg)):
            return [arg]
        inner = self.chain(arg, key, last, False, False, depth - 1, deep)
        return None if inner is None else inner + [arg]

    def keepable(self, arg: fx.Node, key: int, last: int) -> bool:
        """`arg` may be kept by a recipe: traced, saved by no op (so never a site itself), not written in place
        after record `last` (the site's), and not the site's own storage."""
        arg_key = self.key_of(arg)
        return arg_key is not None and arg_key != key and arg_key not in self.savers \
            and self.last_write.get(arg_key, -1) <= last

    def kept(self, node: fx.Node, chain: list, key: int, last: int) -> list[int]:
        """Storage keys of the inputs of `node` and its chain that are neither held anyway nor chain members:
        what the recipe keeps alive by holding them."""
        members = {m.name for m in chain}
        return list(dict.fromkeys(self.key_of(a) for m in (*chain, node) for a in tensor_inputs(m)
                                  if a.name not in members and not self.held(a, key, last)))

    def made_and_kept(self, node: fx.Node, key: int) -> list[int]:
        """Storage keys of what `node`'s recipe holds that the node makes itself and no op saves: a bool-mask
        dropout's mask (and its scale, as a tensor) when its input needs no gradient, so nothing else keeps them;
        the inputs of the ops writing its output `key`, less its own tensor inputs."""
        inputs = {self.key_of(a) for a in tensor_inputs(node)}
        return list(dict.fromkeys(k for r in self.by_node[node.name] if key in r.out_keys for k in r.in_keys
                                  if k is not None and k != key and k not in inputs and k not in self.savers
                                  and self.base_keys.get(k) is None))

    def _chainable(self, arg: fx.Node, consumer: fx.Node, key: int, products: bool) -> bool:
        """`arg` may be recomputed as a member of a chain through `consumer`: a cheap op (or, with `products`, a
        matrix product) not writing in place, read by `consumer` alone, traced, kept by nobody, not an output or a
        base storage."""
        arg_key = self.key_of(arg)
        return (chain_op(arg, consumer) or (products and held_matmul(arg))) and not arg.target._schema.is_mutable \
            and len(arg.users) == 1 and arg_key is not None and arg_key not in self.out_keys \
            and self.base_keys.get(arg_key) is None and (arg_key == key or arg_key not in self.savers) \
            and bool(self.by_node.get(arg.name))

    def site(self, node: fx.Node) -> RematSite | None:
        """`node` as a remat site, None when it is not one (see `remat_sites`)."""
        dropout = node.target is bool_mask_dropout
        fed = not dropout and (input_fed_matmul(node) or self.product(node))
        if not (dropout or fed or remat_op(node) or self.softmax(node)):
            return None
        value = node_value(node)
        records = self.by_node.get(node.name)
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point or not records:
            return None
        key = self.key_of(node)
        if key is None or key in self.out_keys or self.base_keys.get(key) is not None:
            return None
        if self.last_write.get(key, -1) > max(r.idx for r in records):
            # changed in place later, directly (batch norm -> ReLU_: the in-place op is the site, with a chain) or
            # through a view (saved as a tensor from then on: fxmem.nn.recast checks the version)
            return None
        consumers = self.savers.get(key, [])
        if not consumers:
            return None
        in_place = not dropout and node.target._schema.is_mutable
        # (chains deeper than one producer, and products among them, only for softmax sites: the static estimate
        # was seen 15% low on other deep chains, an MLP's GELU through its linear and layer norm)
        deep = self.softmax(node)
        last = max(r.idx for r in records)
        chain = self.chain(node, key, last, dropout, in_place, REMAT_CHAIN_DEPTH if deep else 1, deep)
        if chain is None or (fed and chain):
            return None
        sizes = self.storage_bytes
        kept = self.kept(node, chain, key, last) if deep else self.made_and_kept(node, key) if dropout else []
        # (the site itself when it is a product, and the products in its chain: a softmax's q @ k^T)
        products = ([node] if fed else []) + [m for m in chain if held_matmul(m)]
        if sum(map(self.cost_of, products)) > REMAT_INPUT_MATMUL_PASSES * (self.balance or CPU_BALANCE) * sizes[key]:
            return None  # dearer than a few pointwise passes: regions decide instead
        # savers with nothing between them but ops without a backward or views (no saves, no new tensors): their
        # backwards run back to back, so one recomputation can serve them all, held across no other op's backward
        contiguous = self.back_to_back({self.position[r.idx] for r in consumers})
        share = len(consumers) > 1 and contiguous
        # what else the op saves of its own making (max pooling's indices): a recipe too, the op run again for it
        internal = [s for r in records for s in r.saved if s != key and s in r.new_keys] \
            if not dropout and optable.op_name(node.target, optable.QUALIFIED) in INTERNAL_SAVES else []
        self.unpacked_at[node.name] = {self.position[r.idx] for k in (key, *internal) for r in self.savers.get(k, [])}
        group = bool(internal) and self.back_to_back(self.unpacked_at[node.name])
        once = self.cost_of(node) + sum(self.cost_of(c) for c in chain)
        unpacks = 1 if group else (1 if share else len(consumers)) + bool(internal)
        self.per_unpack[node.name] = (once, unpacks)
        # a join's list argument may hold recipes' outputs (a skip connection's ReLU): remat_call keeps them as recipes
        call = bool(chain) or in_place or any(key in r.saved for r in records) or bool(internal) \
            or optable.packet(node.target) in REMAT_JOINS
        return RematSite(node, key, int(sizes[key] + sum(sizes[s] for s in internal)), float(once * unpacks),
                         (module_paths(node) or ["<root>"])[-1], tuple(chain), call, share, tuple(internal),
                         contiguous=contiguous, group=group, kept=tuple(kept),
                         self_saving=self.self_saving((*chain, node), internal))

    def self_saving(self, members: tuple, internal: list) -> tuple:
        """Names of `members` whose ops save their own output (a ReLU its result), or, for the last (the site),
        an internal output (`internal`: max pooling's indices)."""
        names = []
        for member in members:
            own = {self.key_of(member), *(internal if member is members[-1] else ())}
            if any(key in own for r in self.by_node.get(member.name, []) for key in r.saved):
                names.append(member.name)
        return tuple(names)

    def within_kept_share(self, sites: list[RematSite]) -> list[RematSite]:
        """`sites` less those whose kept tensors, each one's bytes shared among the sites keeping it, come to more
        than REMAT_KEPT_SHARE of the bytes they free (leaving one out shares its kept tensors among fewer: the
        others stay over)."""
        sizes = self.storage_bytes
        while True:
            keepers = Counter(k for s in sites for k in s.kept)
            over = {s.node.name for s in sites
                    if sum(sizes[k] / keepers[k] for k in s.kept) > REMAT_KEPT_SHARE * s.bytes}
            if not over:
                return sites
            sites = [s for s in sites if s.node.name not in over]
            for name in over:
                del self.per_unpack[name], self.unpacked_at[name]

    def held_inputs(self, site: RematSite, by_key: dict) -> tuple:
        """(input name, site name) for each tensor input of `site` and its chain that holds another site's output
        storage (`by_key`: storage key -> site name): the output itself, a view of it, a no-op cast of it."""
        members = {c.name for c in site.chain}
        pairs = {}
        for member in (*site.chain, site.node):
            for arg in tensor_inputs(member):
                name = by_key.get(self.key_of(arg))
                if name is not None and name != site.node.name and arg.name not in members:
                    pairs.setdefault(arg.name, name)
        return tuple(pairs.items())

    def nest(self, sites: list[RematSite]) -> None:
        """An input that is another site's output, or a view of it (the same storage), is a nested recipe when both
        are applied: the holder is then emitted as remat_call (`call_with`; bool-mask dropout nests it itself),
        whose recipe holds the input as its recipe, since a recipe holding it as a tensor would keep the other
        site's output alive. Each unpack recomputes it too, its cost added to the holder's, unless the holder's
        unpacks and the input's own saves are back to back: then one recomputation, shared, serves them all (the
        inner site's `adjacent`)."""
        by_name = {s.node.name: s for s in sites}
        by_key = {key: s.node.name for s in sites for key in s.keys}
        for site in sites:
            site.via = self.held_inputs(site, by_key)
            held_names = list(dict.fromkeys(name for _, name in site.via))
            dropout = site.node.target is bool_mask_dropout
            site.holds = tuple(held_names)
            site.call_with = () if site.call or dropout else tuple(held_names)
            # (the holder's own ops run their backward between its saves' and the inner one's)
            own = {self.position[r.idx] for m in (*site.chain, site.node) for r in self.by_node.get(m.name, [])}
            for name in held_names:
                inner = by_name[name]
                if inner.contiguous and \
                        self.back_to_back(self.unpacked_at[name] | self.unpacked_at[site.node.name], own):
                    inner.adjacent += (site.node.name,)
                elif name in site.call_with and self.product(inner.node):
                    # made again at each of the holder's unpacks too: a cost of applying the matmul site, which
                    # the holder applied alone (recomputed from the kept product) does not pay
                    inner.cost += self.per_unpack[site.node.name][1] * self.per_unpack[name][0]
                else:
                    site.cost += self.per_unpack[site.node.name][1] * self.per_unpack[name][0]


def remat_sites(program: Program, traced, balance: float | None, products: bool = False,
                scores: bool = False) -> list[RematSite]:
    """Nodes whose output some op saves for backward (later consumers, or the node itself: ReLU saves its result)
    that (1) are pointwise ops (in-place ones too), layer/group/RMS/batch norms, bool-mask dropout, joins (cat,
    stack), pooling (max pooling's indices recomputed with it), or a convolution or linear fed only by graph inputs
    and parameters at most REMAT_INPUT_MATMUL_PASSES pointwise passes dear per byte, and (2) have every tensor
    input held until those saves are unpacked anyway (parameters, inputs, tensors saved by this node or an earlier
    one), or computed by one such cheap op from held tensors and kept by nobody (a chain: batch norm -> in-place
    ReLU; a join's upsampling transposed convolution). Cheapest per byte first; a site's cost counts an input that
    is another site's output, or a view of it, once per unpack (a nested recipe, recomputed with it: `nest`).
    `products`: linears and matrix products whose inputs are held anyway are sites too (`held_matmul`), under the
    same cost cap; `scores`: softmaxes are sites too, their chains up to REMAT_CHAIN_DEPTH producers back through
    such products (an attention's, back to q @ k^T), keeping what no op saves up to REMAT_KEPT_SHARE (a mask built
    in the graph). A dropout's recipe keeps its own mask likewise where its input needs no gradient."""
    finder = _SiteFinder(traced, balance, products, scores)
    sites = [s for s in (finder.site(n) for n in program.graph.nodes if n.op == "call_function") if s is not None]
    sites = finder.within_kept_share(sites)
    finder.nest(sites)
    sites.sort(key=lambda s: (s.cost / max(1, s.bytes), s.node.name))
    return sites


class RematPlan(NamedTuple):
    """What the sites applied together share and nest (see `remat_plan`)."""
    shared: set  # output keys recomputed once for all their uses
    nesting: dict  # nested recipe key -> {holder key: used through its shared value}, as `DispatchRecorder.nesting`
    through: dict  # holder site name -> the shared nested sites it uses through their shared value
    groups: dict  # output key -> group key: outputs one shared run makes together, as `DispatchRecorder.recipe_group`


def remat_plan(sites: list[RematSite]) -> RematPlan:
    """For the sites applied together: the outputs recomputed once for all their uses (shared), which recipes hold
    which nested and whether through the shared value, per holder the names of the sites it uses that way, and
    the outputs one shared run makes together (a grouped max pooling's output and indices). A nested site is used
    through its shared value by the holders adjacent to it that are applied too; a site is shared when it has more
    than one use that way or of its own."""
    chosen = {s.node.name: s for s in sites}
    through: dict[str, list[str]] = {}  # holder -> nested sites it uses through their shared value
    uses: dict[str, int] = {s.node.name: (2 if s.share else 1) for s in sites}
    for site in sites:
        for name in site.holds:
            if name in chosen and site.node.name in chosen[name].adjacent:
                through.setdefault(site.node.name, []).append(name)
                uses[name] += 1
    shared = {s.node.name for s in sites if uses[s.node.name] > 1 and s.contiguous}
    nesting: dict[int, dict[int, bool]] = {}
    for site in sites:
        for name in site.holds:
            if name in chosen:
                for holder_key in site.keys:
                    nesting.setdefault(chosen[name].key, {})[holder_key] = name in through.get(site.node.name, ())
    groups = {k: s.key for s in sites if s.group for k in s.keys}
    return RematPlan({chosen[n].key for n in shared} | set(groups), nesting,
                     {h: [a for a in names if a in shared] for h, names in through.items()}, groups)


def as_planned(traced, sites: list[RematSite]):
    """`traced` as if `sites` were applied (their outputs saved as recipes), without tracing the rewrite."""
    plan = remat_plan(sites)
    return as_recipes(traced, RecipeLayout(frozenset().union(*(s.keys for s in sites)), frozenset(plan.shared),
                                           plan.nesting, plan.groups, {s.key: s.kept for s in sites if s.kept}))


def choose_sites(sites: list[RematSite], misses: Callable[[list[RematSite]], int]) -> list[RematSite]:
    """The shortest cheapest-per-byte prefix of `sites` that `misses` (bytes the estimate with those sites applied
    misses the limits by) says fits, all of them when none does; the prefix's last site replaced by a cheaper one
    further down that fits in its place (a 1 MiB chain where the next in line is a 2 MiB concatenation)."""
    count = smallest_fitting_prefix(len(sites), lambda k: misses(sites[:k]), 0)
    if count == len(sites):  # (smallest_fitting_prefix gives all sites when none fits)
        return sites[:count]
    cheaper = sorted((s for s in sites[count:] if s.cost < sites[count - 1].cost), key=lambda s: s.cost)
    for site in cheaper[:REMAT_LAST_SITE_TRIES]:
        if misses(sites[:count - 1] + [site]) <= 0:
            return sites[:count - 1] + [site]
    return sites[:count]


def apply_remat(program: Program, sites: list[RematSite]) -> list[Change]:
    """Rewrite each site as `remat(op(*args), 'aten.op', *args)` (bool-mask dropout: its remat variant), or, for a
    site that is a call (its own saves, a chain, in place), its nodes as `remat_call('aten.op', *args)`."""
    rewriter = _Rewriter(program, remat_plan(sites))
    applied = {s.node.name for s in sites}
    changes = [rewriter.as_call(s) if s.is_call(applied) else rewriter.wrap(s) for s in sites]
    install_recast(program.module)
    program.module.recompile()
    return changes


class _Rewriter:
    """Rewrites remat sites in one graph (`apply_remat`), in order."""

    def __init__(self, program: Program, plan: RematPlan):
        self.graph = program.graph
        self.by_name = {n.name: n for n in self.graph.nodes}
        self.plan = plan
        self.site_of: dict[str, str] = {}  # a remat node emitted here -> the site's node

    def as_call(self, site: RematSite) -> Change:
        """remat_call: the op's own saves of its output become the recipe too, and a chained producer's output is
        held as its recipe (nested), not as a tensor."""
        by_name = self.by_name
        node = by_name[site.node.name]
        names = [self._call(by_name[m.name], site) for m in (*site.chain, node)]
        if site.group:
            node.kwargs = {**node.kwargs, "_fxmem_group": True}
        elif site.key in self.plan.shared:
            node.kwargs = {**node.kwargs, "_fxmem_share": True}
        # under torch.compile the last member recomputes the chain in one checkpoint (fxmem.nn.remat)
        member_at = {m: i for i, m in enumerate(names)}
        last = by_name[names[-1]]
        last.kwargs = {**last.kwargs, "_fxmem_chain": tuple(
            (by_name[m].args[0],  # a member's output as "@i", also inside a list argument (cat)
             fx.node.map_arg(by_name[m].args[1:], lambda a: f"@{member_at[a.name]}" if a.name in member_at else a),
             {k: v for k, v in by_name[m].kwargs.items() if k not in _REMAT_KWARGS})
            for m in names)}
        what = " -> ".join(optable.packet(op_named(by_name[m].args[0])) for m in names)
        return Change(
            kind="checkpoint_remat", module=site.path, nodes_before=names, nodes_after=names,
            reason=f"{what} output (inputs saved anyway): recomputed where backward needs it, also for the "
                   "op's own saves, instead of kept", bytes_saved=site.bytes, details={"recompute_cost": site.cost})

    def _call(self, member: fx.Node, site: RematSite) -> str:
        """`member` (of `site`'s chain, or the site itself) as a remat_call, unless it is one already."""
        if member.target is not remat_call:
            # (in place on a chained output nobody else reads, relu_ after a batch norm, stays in place)
            through = self.plan.through.get(site.node.name, ())
            held = dict(site.via)  # (an input that views a site's output: that site)
            nest = tuple(i for i, a in enumerate(flat_args(member.args)) if isinstance(a, fx.Node)
                         and self.site_of.get(a.name, held.get(a.name, a.name)) in through)
            member.args = (optable.op_name(member.target, optable.QUALIFIED),) + tuple(member.args)
            member.target = remat_call
            if nest:  # nested sites used through their shared value
                member.kwargs = {**member.kwargs, "_fxmem_nest": nest}
            if member.name not in site.self_saving:  # (its saves need not wait: most of a batch norm's)
                member.kwargs = {**member.kwargs, "_fxmem_defer": False}
        return member.name

    def wrap(self, site: RematSite) -> Change:
        """The site's output passed through `remat` (bool-mask dropout: its remat variant in place)."""
        node = self.by_name[site.node.name]
        if node.target is bool_mask_dropout:
            node.target = bool_mask_dropout_remat
            if site.holds:
                # its input a site too: held nested where applied (through its shared value where the plan says so)
                shared = self.plan.through.get(site.node.name, ())
                node.kwargs = {**node.kwargs, "_fxmem_nest": (0,) if site.holds[0] in shared else ()}
            after, what = node.name, "dropout output (input and bool mask are saved anyway)"
        else:
            share = {"_fxmem_share": True} if site.key in self.plan.shared else {}
            qualified_name = optable.op_name(node.target, optable.QUALIFIED)
            with self.graph.inserting_after(node):
                wrapper = self.graph.create_node("call_function", remat, (node, qualified_name) + tuple(node.args),
                                                 {**node.kwargs, **share}, name=node.name + "_remat")
            wrapper.meta.update(node.meta)
            self.site_of[wrapper.name] = node.name
            node.replace_all_uses_with(wrapper, delete_user_cb=lambda u: u is not wrapper)
            after, what = wrapper.name, f"{optable.packet(node.target)} output (its inputs are saved anyway)"
        return Change(
            kind="checkpoint_remat", module=site.path, nodes_before=[node.name], nodes_after=[after],
            reason=f"{what}: recomputed where backward needs it instead of saved by its consumer",
            bytes_saved=site.bytes, details={"recompute_cost": site.cost})
