"""Weight quantization sites: the linears (`aten.linear`, HF Conv1D's `aten.addmm`) whose weights can be swapped,
and the swap of one for a module (`fxmem.nn.lowbit.QuantLinear`, or a LoRA wrapper)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from fxmem.copy_on_write import private_owner
from fxmem.depgroups import attr_of
from fxmem.nn.lowbit import QuantLinear
from fxmem.outline import unique_name
from fxmem.program import module_path

from .nodes import is_param_attr, matching_pattern
from .options import PrecisionOptions

aten = torch.ops.aten


@dataclass
class LinearSite:
    node: fx.Node
    path: str  # module path of the nn.Linear (the weight's owner)
    weight: str  # get_attr target
    bias: str | None
    transposed: bool = False  # aten.addmm(bias, x, W) (HF Conv1D): W is (in, out)

    @property
    def x(self) -> fx.Node:
        return self.node.args[1] if self.transposed else self.node.args[0]


def linear_sites(graph_module: fx.GraphModule, opts: PrecisionOptions) -> tuple[list[LinearSite], list[dict]]:
    """aten.linear sites whose weight (and bias) are parameters, and the skipped ones with why."""
    sites, skipped = [], []
    uses: dict[int, int] = {}
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            try:
                param = attr_of(graph_module, node.target)
            except AttributeError:
                continue
            if isinstance(param, torch.Tensor):
                uses[id(param)] = uses.get(id(param), 0) + len(node.users)
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.linear.default, aten.addmm.default):
            continue
        transposed = node.target is aten.addmm.default
        if transposed:
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
                continue
            weight, bias = node.args[2], node.args[0]
            if not (isinstance(bias, fx.Node) and bias.op == "get_attr" and is_param_attr(graph_module, bias)
                    and attr_of(graph_module, bias.target).dim() == 1):
                continue  # a plain matrix product, not a Conv1D layer
        else:
            weight = node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and is_param_attr(graph_module, weight)):
            skipped.append({"node": node.name, "module": module_path(node), "why": "weight is not a parameter"})
            continue
        path = weight.target.rpartition(".")[0]
        bias_is_param = isinstance(bias, fx.Node) and bias.op == "get_attr" and is_param_attr(graph_module, bias)
        if bias is not None and not bias_is_param:
            skipped.append({"node": node.name, "module": path, "why": "bias is not a parameter"})
            continue
        param = attr_of(graph_module, weight.target)
        pat = matching_pattern(path, opts.skip_modules)
        if pat is not None:
            skipped.append({"node": node.name, "module": path, "why": f"matches skip_modules {pat!r}"})
            continue
        if param.numel() < opts.min_params:
            skipped.append({"node": node.name, "module": path, "why": f"{param.numel()} weights < min_params "
                                                                   f"{opts.min_params}"})
            continue
        if uses.get(id(param), 0) != 1:
            skipped.append({"node": node.name, "module": path, "why": "weight is shared (tied) with another use"})
            continue
        if param.dim() != 2:
            skipped.append({"node": node.name, "module": path, "why": f"weight has {param.dim()} dims"})
            continue
        sites.append(LinearSite(node, path, weight.target, bias.target if bias is not None else None, transposed))
    return sites, skipped


def build_quant(graph_module, site: LinearSite, opts: PrecisionOptions, kind: str, compute: torch.dtype) -> nn.Module:
    weight = attr_of(graph_module, site.weight)
    bias = attr_of(graph_module, site.bias) if site.bias else None
    if site.transposed:
        weight = weight.t()
    return QuantLinear(weight, bias, kind, threshold=opts.int8_threshold, double_quant=opts.double_quant,
                       compute_dtype=compute)


def install_module(graph_module: fx.GraphModule, path: str, mod: nn.Module, site: LinearSite) -> str:
    """Put `mod` at the linear's own path when its container holds only this linear's weight/bias (a container
    fx made for this snapshot); else under a fresh root name. Returns the target."""
    prefix, _, name = path.rpartition(".")
    parent = graph_module.get_submodule(prefix) if prefix else graph_module
    container = getattr(parent, name, None)
    own = {site.weight.rpartition(".")[2]} | ({site.bias.rpartition(".")[2]} if site.bias else set())
    if type(container) is nn.Module and not container._modules and set(container._parameters) <= own \
            and not container._buffers:
        parent = private_owner(graph_module, prefix)
        parent._modules[name] = mod
        return path
    target = unique_name(graph_module, "fxmem_lowbit_" + path.replace(".", "_"))
    graph_module.add_module(target, mod)
    return target


def swap_linear(graph_module: fx.GraphModule, site: LinearSite, mod: nn.Module) -> str:
    node = site.node
    if site.transposed:
        b_node, x_node, w_node = node.args
    else:
        x_node, w_node = node.args[0], node.args[1]
        b_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    target = install_module(graph_module, site.path, mod, site)
    with graph_module.graph.inserting_before(node):
        call = graph_module.graph.call_module(target, (x_node,))
    call.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "val",
                                                                "fxmem_val")})
    call.meta["fxmem_precision"] = "quant"
    node.replace_all_uses_with(call)
    graph_module.graph.erase_node(node)
    for operand in (w_node, b_node):
        if isinstance(operand, fx.Node) and not operand.users:
            graph_module.graph.erase_node(operand)
    return target
