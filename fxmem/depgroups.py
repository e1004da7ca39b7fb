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

from dataclasses import dataclass, field

import torch
from torch import fx, nn

from .copy_on_write import private_owner
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


def _ndim(node) -> int | None:
    value = node_value(node, tensor_only=True)
    return None if value is None else value.dim()


def _size(node, dim) -> int | None:
    value = node_value(node, tensor_only=True)
    if value is None or dim < 0 or dim >= value.dim():
        return None
    try:
        return int(value.shape[dim])
    except Exception:  # noqa: BLE001 - symbolic size
        return None


def attr_of(module: nn.Module, target: str):
    """The attribute a get_attr node's dotted `target` names (a parameter, a buffer, a submodule)."""
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _is_param_attr(graph_module, node) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr" \
        and isinstance(_safe_attr(graph_module, node.target), torch.Tensor)


def _safe_attr(graph_module, target):
    try:
        return attr_of(graph_module, target)
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
        producers = "+".join(x.node for x in self.producers)
        consumers = "+".join(x.node for x in self.consumers)
        text = f"{self.name} [{self.kind}] C={self.size}: {producers} -> {consumers}"
        return text if self.ok else text + f" (not prunable: {self.reason})"


# ---------------------------------------------------------------------------------------------- producers
def _weight_op(graph_module, node: fx.Node):
    """(kind, weight node, bias node|None) when `node` is a linear/conv with a parameter weight, else None."""
    if node.op != "call_function":
        return None
    name = op_name(node, calls_only=True)
    if name == "linear":
        weight = node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        kind = "linear"
    elif name == "addmm" and len(node.args) >= 3 and not node.kwargs:
        bias, weight = node.args[0], node.args[2]  # HF Conv1D: addmm(bias, x.view(-1, in), W[in, out])
        kind = "addmm"
    elif name in ("conv2d", "conv1d", "conv3d"):
        weight = node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
        if groups != 1:
            return None
        kind = "conv"
    elif name in ("conv_transpose2d", "conv_transpose1d", "conv_transpose3d"):
        weight = node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
        if groups != 1:
            return None
        kind = "conv_transpose"
    else:
        return None
    if not _is_param_attr(graph_module, weight):
        return None
    if bias is not None and not _is_param_attr(graph_module, bias):
        return None
    return kind, weight, bias


def _out_channel_dim(kind: str, node: fx.Node) -> int:
    return (_ndim(node) or 1) - 1 if kind in ("linear", "addmm") else 1


def _input_index(kind: str) -> int:
    return 1 if kind == "addmm" else 0


# weight dim indexing output channels (producer) / input channels (consumer)
_PROD_WDIM = {"linear": 0, "conv": 0, "conv_transpose": 1, "addmm": 1}
_CONS_WDIM = {"linear": 1, "conv": 1, "conv_transpose": 0, "addmm": 0}


def weight_producers(graph_module: fx.GraphModule) -> list[fx.Node]:
    return [n for n in graph_module.graph.nodes if _weight_op(graph_module, n) is not None]


def probe_nodes(graph_module: fx.GraphModule) -> dict[str, tuple[str, int]]:
    """{input node name: (consumer module path, channel dim)} for the input of every linear/conv with a parameter
    weight: the hidden units that feed a Linear/Conv, which calibration watches."""
    out = {}
    for node in graph_module.graph.nodes:
        weight_op = _weight_op(graph_module, node)
        if weight_op is None:
            continue
        data_input = node.args[_input_index(weight_op[0])]
        if not isinstance(data_input, fx.Node) or node_value(data_input, tensor_only=True) is None:
            continue
        input_ndim = _ndim(data_input)
        if input_ndim is None:
            continue
        channel_dim = input_ndim - 1 if weight_op[0] in ("linear", "addmm") else 1
        out.setdefault(data_input.name, (module_path(node) or node.name, channel_dim))
    return out


# ---------------------------------------------------------------------------------------------- the search
class _Reject(Exception):
    pass


class _Defer(Exception):
    pass


def _reaches_from(graph_module, operand: fx.Node, members: dict, limit: int = 200) -> bool:
    """Is `operand` computed from a member of the group without passing a linear/conv (which would end the group),
    through at most `limit` nodes?"""
    seen, stack = set(), [operand]
    while stack and len(seen) < limit:
        node = stack.pop()
        if _weight_op(graph_module, node) is not None:
            continue
        for source in node.all_input_nodes:
            if source.name in members:
                return True
            if source not in seen and source.op == "call_function":
                seen.add(source)
                stack.append(source)
    return False


def _norm_dim(dim, ndim):
    return dim + ndim if dim < 0 else dim


def find_groups(graph_module: fx.GraphModule) -> list[Group]:
    """Every producer's dependency group (joined producers are listed once), in graph order."""
    nodes = {node.name: node for node in graph_module.graph.nodes}
    attr_uses: dict[int, int] = {}
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            obj = _safe_attr(graph_module, node.target)
            if isinstance(obj, torch.Tensor):
                attr_uses[id(obj)] = attr_uses.get(id(obj), 0) + len(node.users)
    groups: list[Group] = []
    taken: set[str] = set()
    for node in graph_module.graph.nodes:
        weight_op = _weight_op(graph_module, node)
        if weight_op is None or node.name in taken:
            continue
        group = _grow(graph_module, node, attr_uses)
        for producer in group.producers:
            taken.add(producer.node)
        groups.append(group)
    del nodes
    return groups


def _grow(graph_module, start: fx.Node, attr_uses) -> Group:
    kind, weight, bias = _weight_op(graph_module, start)
    channel_dim = _out_channel_dim(kind, start)
    channels = _size(start, channel_dim)
    group = Group(name=module_path(start) or start.name, size=channels or 0)
    try:
        if channels is None:
            raise _Reject(f"{start.name}: output channel count unknown (no shape metadata)")
        _add_producer(graph_module, group, start, attr_uses)
        queue = [start]
        group.members[start.name] = channel_dim
        while queue:
            member = queue.pop()
            member_dim = group.members[member.name]
            for user in list(member.users):
                try:
                    _visit(graph_module, group, member, member_dim, user, queue, attr_uses)
                except _Defer:
                    pass
        _check_closed(graph_module, group)
        if not group.consumers:
            raise _Reject("its units reach no linear/conv consumer")
        group.kind = _kind(graph_module, group)
    except _Reject as rejection:
        group.ok, group.reason = False, str(rejection)
    return group


def _check_closed(graph_module, group: Group) -> None:
    """Every use of a value carrying the group's channels is inside the group (or a consumer, a size read)."""
    consumers = {c.node for c in group.consumers}
    for node in graph_module.graph.nodes:
        if node.name not in group.members:
            continue
        for user in node.users:
            if user.name in group.members or user.name in consumers:
                continue
            user_op = op_name(user, calls_only=True)
            if user_op in ("sym_size", "size") or user_op.startswith("_assert"):
                continue
            raise _Reject(f"channels coupled through {user.name} ({user_op or user.op}), which reads {node.name}")


def _kind(graph_module, group: Group) -> str:
    names = {op_name(n, calls_only=True) for n in graph_module.graph.nodes if n.name in group.members}
    if len(group.producers) > 1:
        return "residual" if names & {"add", "add_", "sub", "sub_"} else "swiglu"
    if names & _SCATTER:
        return "gnn"
    if group.producers[0].kind not in ("linear", "addmm"):
        return "conv"
    return "mlp"


def _add_producer(graph_module, group: Group, node: fx.Node, attr_uses):
    kind, weight, bias = _weight_op(graph_module, node)
    for param in (weight, bias):
        if param is not None and attr_uses.get(id(_safe_attr(graph_module, param.target)), 0) != 1:
            raise _Reject(f"{node.name}: parameter {param.target} is used elsewhere (tied/shared)")
    bias_target = bias.target if bias is not None else None
    group.producers.append(Producer(node.name, weight.target, bias_target, _PROD_WDIM[kind], kind))


def _add_member(group, node, channel_dim, queue):
    prev = group.members.get(node.name)
    if prev is not None:
        if prev != channel_dim:
            raise _Reject(f"{node.name}: reached with channel dim {prev} and {channel_dim}")
        return
    group.members[node.name] = channel_dim
    queue.append(node)


def _check_operand(graph_module, group: Group, user: fx.Node, operand, out_ndim: int, channel_dim: int, queue,
                   attr_uses):
    """Another input of an op on the channel path: fine if scalar / broadcast over the channel / a per-channel
    parameter (sliced too) / the output of another producer carrying the same channels (joined)."""
    if not isinstance(operand, fx.Node):
        return
    if operand.name in group.members:
        if group.members[operand.name] != channel_dim - (out_ndim - (_ndim(operand) or out_ndim)):
            raise _Reject(f"{user.name}: operands carry the channels on different dims")
        return
    operand_ndim = _ndim(operand)
    if operand_ndim is None:
        return  # SymInt etc.
    operand_dim = channel_dim - (out_ndim - operand_ndim)
    if operand_dim < 0 or _size(operand, operand_dim) == 1:
        return  # broadcast along the channel dim
    if _size(operand, operand_dim) == group.size and _reaches_from(graph_module, operand, group.members):
        raise _Defer()  # o is computed from the group: visit u again when o joins
    if _size(operand, operand_dim) != group.size:
        raise _Reject(f"{user.name} ({op_name(user, calls_only=True)}): operand {operand.name} has size "
                      f"{_size(operand, operand_dim)} on the channel dim")
    if operand.op == "get_attr":
        if attr_uses.get(id(_safe_attr(graph_module, operand.target)), 0) != 1:
            raise _Reject(f"{user.name}: per-channel tensor {operand.target} is shared with other ops")
        group.params.append((operand.target, operand_dim))
        return
    # join: walk back through pointwise ops to another producer
    chain = []
    source = operand
    while True:
        weight_op = _weight_op(graph_module, source)
        if weight_op is not None and _out_channel_dim(weight_op[0], source) == operand_dim:
            break
        if op_name(source, calls_only=True) in _UNARY and isinstance(source.args[0], fx.Node):
            chain.append(source)
            source = source.args[0]
            continue
        raise _Reject(f"channels coupled through {user.name} ({op_name(user, calls_only=True)}) with "
                      f"{operand.name} ({op_name(operand, calls_only=True) or operand.op}, e.g. a residual stream)")
    _add_producer(graph_module, group, source, attr_uses)
    _add_member(group, source, operand_dim, queue)


def _visit(graph_module, group: Group, member: fx.Node, channel_dim: int, user: fx.Node, queue, attr_uses):
    """Follow the group's channels (on dim `channel_dim` of `member`) into `user`: a consumer ends the path, an op
    that keeps the channels joins the group (queued), anything else rejects the group."""
    if user.name in group.members:
        return
    if user.op == "output":
        raise _Reject(f"{member.name} is a graph output")
    if user.op != "call_function":
        raise _Reject(f"{member.name} is used by {user.op} {user.target}")
    name = op_name(user, calls_only=True)
    weight_op = _weight_op(graph_module, user)
    if weight_op is not None:
        _visit_consumer(graph_module, group, member, channel_dim, user, weight_op, attr_uses)
    elif name == "pow" and user.args[0] is member and not isinstance(user.args[1], fx.Node):
        _add_member(group, user, channel_dim, queue)
    elif name in _UNARY:
        if user.args[0] is not member:
            raise _Reject(f"{user.name} ({name}) reads {member.name} as a non-data argument")
        _add_member(group, user, channel_dim, queue)
    elif name in _POOL:
        if channel_dim != 1 or user.args[0] is not member:
            raise _Reject(f"{user.name} ({name}) on channel dim {channel_dim}")
        _add_member(group, user, 1, queue)
    elif name in _BINARY:
        _visit_binary(graph_module, group, member, channel_dim, user, queue, attr_uses)
    elif name in _BN:
        _visit_batch_norm(group, member, channel_dim, user, queue)
    elif name == "index_select":
        dim = _norm_dim(user.args[1], _ndim(member))
        if user.args[0] is not member or dim == channel_dim:
            raise _Reject(f"{user.name}: index_select over the channel dim")
        _add_member(group, user, channel_dim, queue)
    elif name == "expand_as" and len(user.args) > 1 and user.args[1] is member and user.args[0] is not member:
        operand = user.args[0]
        ndim = _ndim(user)
        operand_dim = channel_dim - (ndim - (_ndim(operand) or ndim))
        if operand_dim >= 0 and _size(operand, operand_dim) not in (1, None):
            raise _Reject(f"{user.name}: expand_as of {operand.name} with channels")
        _add_member(group, user, channel_dim, queue)
    elif name in _FACTORY_LIKE and user.args[0] is member:
        shape = list(user.args[1])
        if not (channel_dim < len(shape) and shape[channel_dim] == group.size):
            raise _Reject(f"{user.name} ({name}): new tensor without the channel dim")
        group.literals.append((user.name, 1, channel_dim))
        _add_member(group, user, channel_dim, queue)
    elif name in _SCATTER:
        _visit_scatter(graph_module, group, channel_dim, user, queue, attr_uses)
    elif name in _VIEWS:
        _visit_view(group, member, channel_dim, user, queue)
    elif name in ("sym_size", "size", "_assert_tensor_metadata"):
        if name == "sym_size" and _norm_dim(user.args[1], _ndim(member)) == channel_dim:
            raise _Reject(f"{user.name}: the channel count is read as a size")
    else:
        raise _Reject(f"channels coupled through {user.name} ({name or user.op})")


def _visit_consumer(graph_module, group: Group, member: fx.Node, channel_dim: int, user: fx.Node, weight_op, attr_uses):
    """`user` is a linear/convolution reading `member` (`weight_op`: its kind, weight and bias): a consumer when it
    reduces over the channels as its data input."""
    kind, weight, bias = weight_op
    data_index = _input_index(kind)
    if user.args[data_index] is not member \
            or any(arg is member for index, arg in enumerate(user.args) if index != data_index):
        raise _Reject(f"{member.name} is a weight/bias operand of {user.name}")
    want = (_ndim(member) or 1) - 1 if kind in ("linear", "addmm") else 1
    if channel_dim != want:
        raise _Reject(f"{user.name}: consumes the units on dim {channel_dim}, not its reduction dim")
    if attr_uses.get(id(_safe_attr(graph_module, weight.target)), 0) != 1:
        raise _Reject(f"{user.name}: weight {weight.target} is shared")
    if not any(c.node == user.name for c in group.consumers):
        bias_target = bias.target if bias is not None else None
        group.consumers.append(Consumer(user.name, weight.target, bias_target, _CONS_WDIM[kind], kind, member.name))


def _visit_binary(graph_module, group: Group, member: fx.Node, channel_dim: int, user: fx.Node, queue, attr_uses):
    """add/sub/mul/div: the other operand must broadcast over the channels, be per-channel, or join the group."""
    name, ndim = op_name(user, calls_only=True), _ndim(user)
    if ndim is None:
        raise _Reject(f"{user.name}: no shape metadata")
    out_dim = channel_dim + (ndim - (_ndim(member) or ndim))
    for operand in list(user.args[:2]):
        if operand is not member:
            _check_operand(graph_module, group, user, operand, ndim, out_dim, queue, attr_uses)
    if name.endswith("_") and user.args[0] is not member and user.args[0].name not in group.members:
        raise _Reject(f"{user.name}: in-place {name} into a value outside the group")
    _add_member(group, user, out_dim, queue)


def _visit_batch_norm(group: Group, member: fx.Node, channel_dim: int, user: fx.Node, queue):
    """A batch/instance norm over the channels: its affine parameters and statistics join the group."""
    name = op_name(user, calls_only=True)
    if channel_dim != 1 or user.args[0] is not member:
        raise _Reject(f"{user.name} ({name}) normalizes dim 1, channels are on dim {channel_dim}")
    for statistic in user.args[1:5]:
        if isinstance(statistic, fx.Node):
            if statistic.op != "get_attr":
                raise _Reject(f"{user.name}: normalization statistics {statistic.name} are not parameters/buffers")
            group.params.append((statistic.target, 0))
    if isinstance(node_value(user, tensor_only=True), torch.Tensor):
        _add_member(group, user, channel_dim, queue)
        return
    # tuple-returning variants: follow getitem 0
    for getitem in list(user.users):
        if op_name(getitem, calls_only=True) == "getitem" and getitem.args[1] == 0:
            _add_member(group, getitem, channel_dim, queue)
        elif op_name(getitem, calls_only=True) == "getitem":
            raise _Reject(f"{user.name}: statistics output {getitem.name} used")
    group.members[user.name] = channel_dim


def _visit_scatter(graph_module, group: Group, channel_dim: int, user: fx.Node, queue, attr_uses):
    """scatter_add/index_add/scatter_reduce over another dim (a GNN's aggregation): its other tensors must fit."""
    name, ndim = op_name(user, calls_only=True), _ndim(user)
    dim = _norm_dim(user.args[1], ndim)
    if dim == channel_dim:
        raise _Reject(f"{user.name}: {name} over the channel dim")
    for operand in (user.args[0], user.args[2], user.args[3] if len(user.args) > 3 else None):
        if isinstance(operand, fx.Node) and operand.name not in group.members:
            _check_operand(graph_module, group, user, operand, ndim, channel_dim, queue, attr_uses)
    if name.endswith("_") and user.args[0].name not in group.members:
        raise _Reject(f"{user.name}: {name} accumulates into {user.args[0].name} outside the group")
    _add_member(group, user, channel_dim, queue)


def _visit_view(group: Group, member: fx.Node, channel_dim: int, user: fx.Node, queue):
    """A view/reshape that keeps the channels as the last dim (its shape literal recorded to slice with them)."""
    name = op_name(user, calls_only=True)
    member_ndim = _ndim(member)
    shape = list(user.args[1])
    if user.args[0] is not member or channel_dim != member_ndim - 1 or not shape:
        raise _Reject(f"channels coupled through a reshape: {user.name} ({name})")
    last = shape[-1]
    if last == -1 and all(not (isinstance(s, int) and s == -1) for s in shape[:-1]):
        pass
    elif last == group.size:
        group.literals.append((user.name, 1, len(shape) - 1))
    else:
        raise _Reject(f"channels coupled through a reshape: {user.name} ({name} to {shape})")
    _add_member(group, user, len(shape) - 1, queue)


# ---------------------------------------------------------------------------------------------- slicing
def _set_tensor(graph_module: nn.Module, target: str, new: torch.Tensor) -> None:
    prefix, _, attr = target.rpartition(".")
    owner = private_owner(graph_module, prefix)
    old = getattr(owner, attr)
    if isinstance(old, nn.Parameter):
        owner._parameters[attr] = nn.Parameter(new, requires_grad=old.requires_grad)
    elif attr in owner._buffers:
        owner._buffers[attr] = new
    else:
        setattr(owner, attr, new)


def slice_group(graph_module: fx.GraphModule, group: Group, keep: torch.Tensor, bias_delta: dict | None = None) -> dict:
    """Keep only units `keep` (sorted indices) of `group` in `graph_module`: new sliced parameters/buffers under the
    same names, shape literals rewritten. `bias_delta`: {consumer node name: tensor added to its bias} (mean
    compensation). Returns {target: (old shape, new shape)}."""
    if not group.ok:
        raise ValueError(f"group {group.name} is not prunable: {group.reason}")
    keep = keep.to(torch.long)
    shapes = {}

    def slice_tensor(target, dim, extra=None):
        tensor = attr_of(graph_module, target)
        with torch.no_grad():
            new = tensor.detach().index_select(dim, keep.to(tensor.device)).clone()
        shapes[target] = (tuple(tensor.shape), tuple(new.shape))
        _set_tensor(graph_module, target, new)

    for producer in group.producers:
        slice_tensor(producer.weight, producer.wdim)
        if producer.bias is not None:
            slice_tensor(producer.bias, 0)
    for consumer in group.consumers:
        slice_tensor(consumer.weight, consumer.wdim)
        if bias_delta and consumer.node in bias_delta and consumer.bias is not None:
            bias = attr_of(graph_module, consumer.bias)
            with torch.no_grad():
                new_bias = (bias.detach() + bias_delta[consumer.node].to(bias.dtype)).clone()
            _set_tensor(graph_module, consumer.bias, new_bias)
    for target, dim in dict.fromkeys(group.params):
        slice_tensor(target, dim)
    by_name = {node.name: node for node in graph_module.graph.nodes}
    for node_name, arg_index, pos in group.literals:
        node = by_name[node_name]
        shape = list(node.args[arg_index])
        shape[pos] = int(keep.numel())
        args = list(node.args)
        args[arg_index] = shape
        node.args = tuple(args)
    graph_module.recompile()
    return shapes
