"""Dependency groups: which hidden dimensions of a captured graph can be pruned together, found on the FX graph.

A *group* is a set of hidden units (channels) that appear in several tensors and parameters at once and must be
removed from all of them consistently (torch-pruning's DepGraph on fxmem's aten-level graph): Linear -> act ->
Linear, SwiGLU, Conv -> BN -> act -> Conv, GNN layer chains.

    groups = find_groups(gm)            # a group coupled to values outside it: ok=False with a `reason`
    slice_group(gm, group, keep)        # new sliced parameters/buffers under the same names; shape literals

Call `program.refresh()` after slicing.
Design: docs/design/pruning-gating.md, "Dependency groups".
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from .node_value import node_value
from .ops import op_name
from .program import module_path

aten = torch.ops.aten

__all__ = ["Group", "Producer", "Consumer", "find_groups", "slice_group", "probe_nodes", "weight_producers"]

# ---------------------------------------------------------------------------------------------- op classes
_UNARY = {"relu", "relu_", "gelu", "gelu_", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "dropout",
          "clone", "contiguous", "hardtanh", "hardtanh_", "leaky_relu", "leaky_relu_", "elu", "elu_", "mish",
          "hardswish", "hardsigmoid", "alias", "detach", "neg", "abs", "square", "softplus", "relu6", "celu",
          "selu", "_to_copy", "to", "type_as", "log_sigmoid", "exp", "sin", "cos"}
_BINARY = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"}
_POOL = {"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "max_pool1d", "avg_pool1d", "upsample_nearest2d",
         "upsample_bilinear2d", "max_pool3d", "avg_pool3d"}
_BN = {"batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
       "native_batch_norm", "instance_norm", "_batch_norm_with_update", "_batch_norm_no_update"}
_VIEWS = {"view", "reshape", "_unsafe_view"}
_FACTORY_LIKE = {"new_zeros", "new_empty", "new_ones"}
_SCATTER = {"scatter_add", "scatter_add_", "index_add", "index_add_", "scatter_reduce", "scatter_reduce_"}


def _ndim(n) -> int | None:
    v = node_value(n, tensor_only=True)
    return None if v is None else v.dim()


def _size(n, d) -> int | None:
    v = node_value(n, tensor_only=True)
    if v is None or d < 0 or d >= v.dim():
        return None
    try:
        return int(v.shape[d])
    except Exception:  # noqa: BLE001 - symbolic size
        return None


def attr_of(gm: nn.Module, target: str):
    """The attribute a get_attr node's dotted `target` names (a parameter, a buffer, a submodule)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _is_param_attr(gm, n) -> bool:
    return isinstance(n, fx.Node) and n.op == "get_attr" and isinstance(_safe_attr(gm, n.target), torch.Tensor)


def _safe_attr(gm, target):
    try:
        return attr_of(gm, target)
    except AttributeError:
        return None


# ---------------------------------------------------------------------------------------------- records
@dataclass
class Producer:
    node: str
    weight: str  # get_attr target
    bias: str | None
    wdim: int  # weight dim that indexes the output channels
    kind: str  # linear | conv | conv_transpose


@dataclass
class Consumer:
    node: str
    weight: str
    bias: str | None
    wdim: int  # weight dim that indexes the input channels
    kind: str
    probe: str  # the consumer's input node: the activations calibration watches


@dataclass
class Group:
    name: str  # module path of the first producer
    size: int  # number of units C
    producers: list = field(default_factory=list)
    consumers: list = field(default_factory=list)
    params: list = field(default_factory=list)  # (get_attr target, dim) extra tensors sliced along with it
    literals: list = field(default_factory=list)  # (node name, arg index, list position) shape literals == C
    members: dict = field(default_factory=dict)  # node name -> channel dim
    ok: bool = True
    reason: str = ""
    kind: str = "mlp"  # mlp | swiglu | conv | gnn

    @property
    def probes(self) -> list[str]:
        return list(dict.fromkeys(c.probe for c in self.consumers))

    def summary(self) -> str:
        p = "+".join(x.node for x in self.producers)
        c = "+".join(x.node for x in self.consumers)
        s = f"{self.name} [{self.kind}] C={self.size}: {p} -> {c}"
        return s if self.ok else s + f" (not prunable: {self.reason})"


# ---------------------------------------------------------------------------------------------- producers
def _weight_op(gm, n: fx.Node):
    """(kind, weight node, bias node|None) when `n` is a linear/conv with a parameter weight, else None."""
    if n.op != "call_function":
        return None
    nm = op_name(n, calls_only=True)
    if nm == "linear":
        w = n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        kind = "linear"
    elif nm == "addmm" and len(n.args) >= 3 and not n.kwargs:
        b, w = n.args[0], n.args[2]  # HF Conv1D: addmm(bias, x.view(-1, in), W[in, out])
        kind = "addmm"
    elif nm in ("conv2d", "conv1d", "conv3d"):
        w = n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        groups = n.args[6] if len(n.args) > 6 else n.kwargs.get("groups", 1)
        if groups != 1:
            return None
        kind = "conv"
    elif nm in ("conv_transpose2d", "conv_transpose1d", "conv_transpose3d"):
        w = n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        groups = n.args[6] if len(n.args) > 6 else n.kwargs.get("groups", 1)
        if groups != 1:
            return None
        kind = "conv_transpose"
    else:
        return None
    if not _is_param_attr(gm, w):
        return None
    if b is not None and not _is_param_attr(gm, b):
        return None
    return kind, w, b


def _out_channel_dim(kind: str, n: fx.Node) -> int:
    return (_ndim(n) or 1) - 1 if kind in ("linear", "addmm") else 1


def _input_index(kind: str) -> int:
    return 1 if kind == "addmm" else 0


# weight dim indexing output channels (producer) / input channels (consumer)
_PROD_WDIM = {"linear": 0, "conv": 0, "conv_transpose": 1, "addmm": 1}
_CONS_WDIM = {"linear": 1, "conv": 1, "conv_transpose": 0, "addmm": 0}


def weight_producers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if _weight_op(gm, n) is not None]


def probe_nodes(gm: fx.GraphModule) -> dict[str, tuple[str, int]]:
    """{input node name: (consumer module path, channel dim)} for the input of every linear/conv with a parameter
    weight: the hidden units that feed a Linear/Conv, which calibration watches."""
    out = {}
    for n in gm.graph.nodes:
        wo = _weight_op(gm, n)
        if wo is None:
            continue
        x = n.args[_input_index(wo[0])]
        if not isinstance(x, fx.Node) or node_value(x, tensor_only=True) is None:
            continue
        nd = _ndim(x)
        if nd is None:
            continue
        out.setdefault(x.name, (module_path(n) or n.name, nd - 1 if wo[0] in ("linear", "addmm") else 1))
    return out


# ---------------------------------------------------------------------------------------------- the search
class _Reject(Exception):
    pass


class _Defer(Exception):
    pass


def _reaches_from(gm, o: fx.Node, members: dict, limit: int = 200) -> bool:
    """Is `o` computed from a member of the group without passing a linear/conv (which would end the group),
    through at most `limit` nodes?"""
    seen, stack = set(), [o]
    while stack and len(seen) < limit:
        n = stack.pop()
        if _weight_op(gm, n) is not None:
            continue
        for a in n.all_input_nodes:
            if a.name in members:
                return True
            if a not in seen and a.op == "call_function":
                seen.add(a)
                stack.append(a)
    return False


def _norm_dim(d, nd):
    return d + nd if d < 0 else d


def find_groups(gm: fx.GraphModule) -> list[Group]:
    """Every producer's dependency group (joined producers are listed once), in graph order."""
    nodes = {n.name: n for n in gm.graph.nodes}
    attr_uses: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = _safe_attr(gm, n.target)
            if isinstance(obj, torch.Tensor):
                attr_uses[id(obj)] = attr_uses.get(id(obj), 0) + len(n.users)
    groups: list[Group] = []
    taken: set[str] = set()
    for n in gm.graph.nodes:
        wo = _weight_op(gm, n)
        if wo is None or n.name in taken:
            continue
        g = _grow(gm, n, attr_uses)
        for p in g.producers:
            taken.add(p.node)
        groups.append(g)
    del nodes
    return groups


def _grow(gm, start: fx.Node, attr_uses) -> Group:
    kind, w, b = _weight_op(gm, start)
    d0 = _out_channel_dim(kind, start)
    C = _size(start, d0)
    g = Group(name=module_path(start) or start.name, size=C or 0)
    try:
        if C is None:
            raise _Reject(f"{start.name}: output channel count unknown (no shape metadata)")
        _add_producer(gm, g, start, attr_uses)
        queue = [start]
        g.members[start.name] = d0
        while queue:
            x = queue.pop()
            dx = g.members[x.name]
            for u in list(x.users):
                try:
                    _visit(gm, g, x, dx, u, queue, attr_uses)
                except _Defer:
                    pass
        _check_closed(gm, g)
        if not g.consumers:
            raise _Reject("its units reach no linear/conv consumer")
        g.kind = _kind(gm, g)
    except _Reject as e:
        g.ok, g.reason = False, str(e)
    return g


def _check_closed(gm, g: Group) -> None:
    """Every use of a value carrying the group's channels is inside the group (or a consumer, a size read)."""
    consumers = {c.node for c in g.consumers}
    for n in gm.graph.nodes:
        if n.name not in g.members:
            continue
        for u in n.users:
            if u.name in g.members or u.name in consumers:
                continue
            user_op = op_name(u, calls_only=True)
            if user_op in ("sym_size", "size") or user_op.startswith("_assert"):
                continue
            raise _Reject(f"channels coupled through {u.name} ({user_op or u.op}), which reads {n.name}")


def _kind(gm, g: Group) -> str:
    names = {op_name(n, calls_only=True) for n in gm.graph.nodes if n.name in g.members}
    if len(g.producers) > 1:
        return "residual" if names & {"add", "add_", "sub", "sub_"} else "swiglu"
    if names & _SCATTER:
        return "gnn"
    if g.producers[0].kind not in ("linear", "addmm"):
        return "conv"
    return "mlp"


def _add_producer(gm, g: Group, n: fx.Node, attr_uses):
    kind, w, b = _weight_op(gm, n)
    for a in (w, b):
        if a is not None and attr_uses.get(id(_safe_attr(gm, a.target)), 0) != 1:
            raise _Reject(f"{n.name}: parameter {a.target} is used elsewhere (tied/shared)")
    g.producers.append(Producer(n.name, w.target, b.target if b is not None else None, _PROD_WDIM[kind], kind))


def _add_member(g, n, d, queue):
    prev = g.members.get(n.name)
    if prev is not None:
        if prev != d:
            raise _Reject(f"{n.name}: reached with channel dim {prev} and {d}")
        return
    g.members[n.name] = d
    queue.append(n)


def _check_operand(gm, g: Group, u: fx.Node, o, out_nd: int, d: int, queue, attr_uses):
    """Another input of an op on the channel path: fine if scalar / broadcast over the channel / a per-channel
    parameter (sliced too) / the output of another producer carrying the same channels (joined)."""
    if not isinstance(o, fx.Node):
        return
    if o.name in g.members:
        if g.members[o.name] != d - (out_nd - (_ndim(o) or out_nd)):
            raise _Reject(f"{u.name}: operands carry the channels on different dims")
        return
    ond = _ndim(o)
    if ond is None:
        return  # SymInt etc.
    od = d - (out_nd - ond)
    if od < 0 or _size(o, od) == 1:
        return  # broadcast along the channel dim
    if _size(o, od) == g.size and _reaches_from(gm, o, g.members):
        raise _Defer()  # o is computed from the group: visit u again when o joins
    if _size(o, od) != g.size:
        raise _Reject(f"{u.name} ({op_name(u, calls_only=True)}): operand {o.name} has size {_size(o, od)} "
                      f"on the channel dim")
    if o.op == "get_attr":
        if attr_uses.get(id(_safe_attr(gm, o.target)), 0) != 1:
            raise _Reject(f"{u.name}: per-channel tensor {o.target} is shared with other ops")
        g.params.append((o.target, od))
        return
    # join: walk back through pointwise ops to another producer
    chain = []
    x = o
    while True:
        wo = _weight_op(gm, x)
        if wo is not None and _out_channel_dim(wo[0], x) == od:
            break
        if op_name(x, calls_only=True) in _UNARY and isinstance(x.args[0], fx.Node):
            chain.append(x)
            x = x.args[0]
            continue
        raise _Reject(f"channels coupled through {u.name} ({op_name(u, calls_only=True)}) with {o.name} "
                      f"({op_name(o, calls_only=True) or o.op}, e.g. a residual stream)")
    _add_producer(gm, g, x, attr_uses)
    _add_member(g, x, od, queue)


def _visit(gm, g: Group, x: fx.Node, d: int, u: fx.Node, queue, attr_uses):
    """Follow the group's channels (on dim `d` of `x`) into the user `u`: a consumer ends the path, an op that
    keeps the channels joins the group (queued), anything else rejects the group."""
    if u.name in g.members:
        return
    if u.op == "output":
        raise _Reject(f"{x.name} is a graph output")
    if u.op != "call_function":
        raise _Reject(f"{x.name} is used by {u.op} {u.target}")
    nm = op_name(u, calls_only=True)
    weight_op = _weight_op(gm, u)
    if weight_op is not None:
        _visit_consumer(gm, g, x, d, u, weight_op, attr_uses)
    elif nm == "pow" and u.args[0] is x and not isinstance(u.args[1], fx.Node):
        _add_member(g, u, d, queue)
    elif nm in _UNARY:
        if u.args[0] is not x:
            raise _Reject(f"{u.name} ({nm}) reads {x.name} as a non-data argument")
        _add_member(g, u, d, queue)
    elif nm in _POOL:
        if d != 1 or u.args[0] is not x:
            raise _Reject(f"{u.name} ({nm}) on channel dim {d}")
        _add_member(g, u, 1, queue)
    elif nm in _BINARY:
        _visit_binary(gm, g, x, d, u, queue, attr_uses)
    elif nm in _BN:
        _visit_batch_norm(g, x, d, u, queue)
    elif nm == "index_select":
        dim = _norm_dim(u.args[1], _ndim(x))
        if u.args[0] is not x or dim == d:
            raise _Reject(f"{u.name}: index_select over the channel dim")
        _add_member(g, u, d, queue)
    elif nm == "expand_as" and len(u.args) > 1 and u.args[1] is x and u.args[0] is not x:
        o = u.args[0]
        nd = _ndim(u)
        od = d - (nd - (_ndim(o) or nd))
        if od >= 0 and _size(o, od) not in (1, None):
            raise _Reject(f"{u.name}: expand_as of {o.name} with channels")
        _add_member(g, u, d, queue)
    elif nm in _FACTORY_LIKE and u.args[0] is x:
        shape = list(u.args[1])
        if not (d < len(shape) and shape[d] == g.size):
            raise _Reject(f"{u.name} ({nm}): new tensor without the channel dim")
        g.literals.append((u.name, 1, d))
        _add_member(g, u, d, queue)
    elif nm in _SCATTER:
        _visit_scatter(gm, g, d, u, queue, attr_uses)
    elif nm in _VIEWS:
        _visit_view(g, x, d, u, queue)
    elif nm in ("sym_size", "size", "_assert_tensor_metadata"):
        if nm == "sym_size" and _norm_dim(u.args[1], _ndim(x)) == d:
            raise _Reject(f"{u.name}: the channel count is read as a size")
    else:
        raise _Reject(f"channels coupled through {u.name} ({nm or u.op})")


def _visit_consumer(gm, g: Group, x: fx.Node, d: int, u: fx.Node, weight_op, attr_uses):
    """`u` is a linear/convolution reading `x` (`weight_op`: its kind, weight and bias): a consumer when it
    reduces over the channels as its data input."""
    kind, w, b = weight_op
    if u.args[_input_index(kind)] is not x or any(a is x for i, a in enumerate(u.args)
                                                  if i != _input_index(kind)):
        raise _Reject(f"{x.name} is a weight/bias operand of {u.name}")
    want = (_ndim(x) or 1) - 1 if kind in ("linear", "addmm") else 1
    if d != want:
        raise _Reject(f"{u.name}: consumes the units on dim {d}, not its reduction dim")
    if attr_uses.get(id(_safe_attr(gm, w.target)), 0) != 1:
        raise _Reject(f"{u.name}: weight {w.target} is shared")
    if not any(c.node == u.name for c in g.consumers):
        g.consumers.append(Consumer(u.name, w.target, b.target if b is not None else None, _CONS_WDIM[kind],
                                    kind, x.name))


def _visit_binary(gm, g: Group, x: fx.Node, d: int, u: fx.Node, queue, attr_uses):
    """add/sub/mul/div: the other operand must broadcast over the channels, be per-channel, or join the group."""
    nm, nd = op_name(u, calls_only=True), _ndim(u)
    if nd is None:
        raise _Reject(f"{u.name}: no shape metadata")
    od = d + (nd - (_ndim(x) or nd))
    for a in list(u.args[:2]):
        if a is not x:
            _check_operand(gm, g, u, a, nd, od, queue, attr_uses)
    if nm.endswith("_") and u.args[0] is not x and u.args[0].name not in g.members:
        raise _Reject(f"{u.name}: in-place {nm} into a value outside the group")
    _add_member(g, u, od, queue)


def _visit_batch_norm(g: Group, x: fx.Node, d: int, u: fx.Node, queue):
    """A batch/instance norm over the channels: its affine parameters and statistics join the group."""
    nm = op_name(u, calls_only=True)
    if d != 1 or u.args[0] is not x:
        raise _Reject(f"{u.name} ({nm}) normalizes dim 1, channels are on dim {d}")
    for a in u.args[1:5]:
        if isinstance(a, fx.Node):
            if a.op != "get_attr":
                raise _Reject(f"{u.name}: normalization statistics {a.name} are not parameters/buffers")
            g.params.append((a.target, 0))
    if isinstance(node_value(u, tensor_only=True), torch.Tensor):
        _add_member(g, u, d, queue)
        return
    # tuple-returning variants: follow getitem 0
    for gu in list(u.users):
        if op_name(gu, calls_only=True) == "getitem" and gu.args[1] == 0:
            _add_member(g, gu, d, queue)
        elif op_name(gu, calls_only=True) == "getitem":
            raise _Reject(f"{u.name}: statistics output {gu.name} used")
    g.members[u.name] = d


def _visit_scatter(gm, g: Group, d: int, u: fx.Node, queue, attr_uses):
    """scatter_add/index_add/scatter_reduce over another dim (a GNN's aggregation): its other tensors must fit."""
    nm, nd = op_name(u, calls_only=True), _ndim(u)
    dim = _norm_dim(u.args[1], nd)
    if dim == d:
        raise _Reject(f"{u.name}: {nm} over the channel dim")
    for a in (u.args[0], u.args[2], u.args[3] if len(u.args) > 3 else None):
        if isinstance(a, fx.Node) and a.name not in g.members:
            _check_operand(gm, g, u, a, nd, d, queue, attr_uses)
    if nm.endswith("_") and u.args[0].name not in g.members:
        raise _Reject(f"{u.name}: {nm} accumulates into {u.args[0].name} outside the group")
    _add_member(g, u, d, queue)


def _visit_view(g: Group, x: fx.Node, d: int, u: fx.Node, queue):
    """A view/reshape that keeps the channels as the last dim (its shape literal recorded to slice with them)."""
    nm = op_name(u, calls_only=True)
    xin = _ndim(x)
    shape = list(u.args[1])
    if u.args[0] is not x or d != xin - 1 or not shape:
        raise _Reject(f"channels coupled through a reshape: {u.name} ({nm})")
    last = shape[-1]
    if last == -1 and all(not (isinstance(s, int) and s == -1) for s in shape[:-1]):
        pass
    elif last == g.size:
        g.literals.append((u.name, 1, len(shape) - 1))
    else:
        raise _Reject(f"channels coupled through a reshape: {u.name} ({nm} to {shape})")
    _add_member(g, u, len(shape) - 1, queue)


# ---------------------------------------------------------------------------------------------- slicing
def _private_owner(gm: nn.Module, prefix: str) -> nn.Module:
    """The module at `prefix`, made private to `gm` first: every container on the path is replaced by a shallow
    copy (own parameter/buffer/module dicts). Snapshots may share containers with the program they came from,
    and rollback needs those untouched."""
    parent = gm
    if not prefix:
        return gm
    for item in prefix.split("."):
        child = parent._modules[item]
        c = copy.copy(child)
        c._parameters = dict(child._parameters)
        c._buffers = dict(child._buffers)
        c._modules = dict(child._modules)
        parent._modules[item] = c
        parent = c
    return parent


def _set_tensor(gm: nn.Module, target: str, new: torch.Tensor) -> None:
    prefix, _, attr = target.rpartition(".")
    owner = _private_owner(gm, prefix)
    old = getattr(owner, attr)
    if isinstance(old, nn.Parameter):
        owner._parameters[attr] = nn.Parameter(new, requires_grad=old.requires_grad)
    elif attr in owner._buffers:
        owner._buffers[attr] = new
    else:
        setattr(owner, attr, new)


def slice_group(gm: fx.GraphModule, g: Group, keep: torch.Tensor, bias_delta: dict | None = None) -> dict:
    """Keep only units `keep` (sorted indices) of group `g` in `gm`: new sliced parameters/buffers under the
    same names, shape literals rewritten. `bias_delta`: {consumer node name: tensor added to its bias} (mean
    compensation). Returns {target: (old shape, new shape)}."""
    if not g.ok:
        raise ValueError(f"group {g.name} is not prunable: {g.reason}")
    keep = keep.to(torch.long)
    shapes = {}

    def sl(target, dim, extra=None):
        t = attr_of(gm, target)
        with torch.no_grad():
            new = t.detach().index_select(dim, keep.to(t.device)).clone()
        shapes[target] = (tuple(t.shape), tuple(new.shape))
        _set_tensor(gm, target, new)

    for p in g.producers:
        sl(p.weight, p.wdim)
        if p.bias is not None:
            sl(p.bias, 0)
    for c in g.consumers:
        sl(c.weight, c.wdim)
        if bias_delta and c.node in bias_delta and c.bias is not None:
            b = attr_of(gm, c.bias)
            with torch.no_grad():
                nb = (b.detach() + bias_delta[c.node].to(b.dtype)).clone()
            _set_tensor(gm, c.bias, nb)
    for target, dim in dict.fromkeys(g.params):
        sl(target, dim)
    by_name = {n.name: n for n in gm.graph.nodes}
    for node_name, argi, pos in g.literals:
        n = by_name[node_name]
        shape = list(n.args[argi])
        shape[pos] = int(keep.numel())
        args = list(n.args)
        args[argi] = shape
        n.args = tuple(args)
    gm.recompile()
    return shapes
