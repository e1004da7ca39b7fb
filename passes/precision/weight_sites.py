"""Weight quantization sites that are not linears: convolution weights, embedding tables and 3-D expert weights
read through `get_attr`, each swapped for a `fxmem.nn.quantized_weights.QuantizedWeight` the graph calls instead;
and, for every other large parameter no linear holds, why it stays in full precision."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from fxmem.copy_on_write import private_owner
from fxmem.depgroups import attr_of
from fxmem.nn.quantized_weights import QuantizedWeight
from fxmem.ops import op_name
from fxmem.weights_left import feeds_a_linear

from .nodes import matching_pattern
from .options import PrecisionOptions

aten = torch.ops.aten
CONVOLUTIONS = (aten.convolution.default, aten._convolution.default, aten.conv1d.default, aten.conv2d.default,
                aten.conv3d.default, aten.conv_transpose1d.default, aten.conv_transpose2d.input,
                aten.conv_transpose3d.input)
# what reads a mixture of experts' 3-D weight: batched or grouped matmuls, directly or through a view of an expert
EXPERT_READERS = frozenset({"bmm", "matmul", "einsum", "baddbmm", "_grouped_mm", "grouped_mm", "grouped_mm_fallback",
                            "transpose", "permute", "select", "index", "unbind", "split", "chunk"})
ROLES = ("convolution weight", "embedding table", "expert weights")


@dataclass
class WeightSite:
    """A parameter stored quantized: its name, the get_attr nodes that read it and what reads it."""
    target: str
    nodes: list[fx.Node]
    role: str  # one of ROLES: what the parameter is to the ops that read it

    @property
    def name(self) -> str:
        """The site's name in the guard's back-off and the report: its first get_attr node."""
        return self.nodes[0].name


def _reads_as(node: fx.Node, ops, position: int) -> bool:
    return all(u.op == "call_function" and u.target in ops and len(u.args) > position and u.args[position] is node
               and node not in u.args[position + 1:] for u in node.users)


def _role(nodes: list[fx.Node], param: torch.Tensor) -> str | None:
    """What the parameter is to the ops that read it, None when it is none of ROLES."""
    if all(_reads_as(n, CONVOLUTIONS, 1) for n in nodes):
        return "convolution weight"
    if all(_reads_as(n, (aten.embedding.default,), 0) for n in nodes):
        return "embedding table"
    if param.dim() == 3 and param.shape[0] > 1 and all(op_name(u) in EXPERT_READERS for n in nodes for u in n.users):
        return "expert weights"
    return None


def _why_left(graph_module: fx.GraphModule, target: str, nodes: list[fx.Node], opts: PrecisionOptions) -> str | None:
    """Why this parameter cannot be a site (None: it can)."""
    param = attr_of(graph_module, target)
    path = target.rpartition(".")[0]
    ops = "/".join(sorted({op_name(u) for n in nodes for u in n.users}))
    if any(feeds_a_linear(n) for n in nodes):
        return "shared (tied) with a linear's weight"
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"its dtype is {param.dtype}"
    if param.dim() < 2:
        return "a 1-D weight (a scale or bias vector): bitsandbytes stores matrices"
    pattern = matching_pattern(path, opts.skip_modules)
    if pattern is not None:
        return f"matches skip_modules {pattern!r}"
    if _role(nodes, param) is None:
        return (f"read by {ops}: int8/4-bit storage covers linear, convolution and embedding weights and 3-D expert "
                "weights read by (batched or grouped) matmuls")
    return None


def weight_sites(graph_module: fx.GraphModule, opts: PrecisionOptions) -> tuple[list[WeightSite], dict[str, str]]:
    """The parameters of at least `opts.min_params` elements that no linear uses as its weight: those stored
    quantized (sites), and the others with why (name -> reason)."""
    readers: dict[int, tuple[str, list[fx.Node]]] = {}
    for node in graph_module.graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        try:
            param = graph_module.get_parameter(node.target)
        except AttributeError:
            continue
        if param.numel() >= opts.min_params:
            readers.setdefault(id(param), (node.target, []))[1].append(node)
    sites, left = [], {}
    for target, nodes in readers.values():
        if all(feeds_a_linear(n) for n in nodes):
            continue  # a linear's weight: the linear sites' business
        why = _why_left(graph_module, target, nodes, opts)
        if why is None:
            sites.append(WeightSite(target, nodes, _role(nodes, attr_of(graph_module, target))))
        else:
            left[target] = why
    return sites, left


def build_weight(graph_module: fx.GraphModule, site: WeightSite, kind: str) -> QuantizedWeight:
    return QuantizedWeight(attr_of(graph_module, site.target), kind, row_dims=2 if site.role == "expert weights" else 1)


def swap_weight(graph_module: fx.GraphModule, site: WeightSite, module: nn.Module) -> str:
    """Put `module` where the parameter was (same path: its state_dict keys become `<path>.qweight`, ...) and make
    every read of the parameter a call of it, placed just before the read; a read of one expert
    (`select(W, 0, i)`) dequantizes that expert only. Returns the module's target."""
    prefix, _, name = site.target.rpartition(".")
    owner = private_owner(graph_module, prefix)
    del owner._parameters[name]
    owner._modules[name] = module
    order = {n: i for i, n in enumerate(graph_module.graph.nodes)}
    for node in site.nodes:
        for select in [u for u in node.users if _one_slice(u, node, module)]:
            _call_before(graph_module, site.target, select, (select.args[2] % module.shape[0],), select)
        if node.users:
            # just before its first reader (export puts every get_attr at the top: dequantized there, every weight's
            # full-precision copy would live from the start of forward to its use)
            _call_before(graph_module, site.target, min(node.users, key=order.__getitem__), (), node)
        graph_module.graph.erase_node(node)
    return site.target


def _one_slice(user: fx.Node, node: fx.Node, module: nn.Module) -> bool:
    """`user` is `aten.select(node, 0, i)` (one expert of a 3-D weight) and the module dequantizes it alone."""
    return (user.target is aten.select.int and user.args[0] is node and user.args[1] == 0
            and isinstance(user.args[2], int) and module.sliceable())


def _call_before(graph_module: fx.GraphModule, target: str, where: fx.Node, args: tuple, replaced: fx.Node) -> None:
    """A call of the module `target` with `args`, before `where`, in place of `replaced` (its uses and value)."""
    with graph_module.graph.inserting_before(where):
        call = graph_module.graph.call_module(target, args)
    call.meta.update({k: v for k, v in replaced.meta.items() if k in ("val", "fxmem_val", "tensor_meta")})
    call.meta["fxmem_precision"] = "quant"
    replaced.replace_all_uses_with(call)
    if replaced is where:  # a select of one expert: the call is it
        graph_module.graph.erase_node(replaced)
