"""Weight quantization sites: the linears (`aten.linear`, HF Conv1D's `aten.addmm`) whose weights can be swapped,
and the swap of one for a module (`fxmem.nn.lowbit.QuantLinear`, or a LoRA wrapper)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from fxmem.copy_on_write import private_owner
from fxmem.depgroups import attr_of
from fxmem.nn.lowbit import QuantLinear
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


def linear_sites(gm: fx.GraphModule, opts: PrecisionOptions) -> tuple[list[LinearSite], list[dict]]:
    """aten.linear sites whose weight (and bias) are parameters, and the skipped ones with why."""
    sites, skipped = [], []
    uses: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                p = attr_of(gm, n.target)
            except AttributeError:
                continue
            if isinstance(p, torch.Tensor):
                uses[id(p)] = uses.get(id(p), 0) + len(n.users)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (aten.linear.default, aten.addmm.default):
            continue
        transposed = n.target is aten.addmm.default
        if transposed:
            if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1 or len(n.args) != 3:
                continue
            w, b = n.args[2], n.args[0]
            if not (isinstance(b, fx.Node) and b.op == "get_attr" and is_param_attr(gm, b)
                    and attr_of(gm, b.target).dim() == 1):
                continue  # a plain matrix product, not a Conv1D layer
        else:
            w = n.args[1]
            b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and is_param_attr(gm, w)):
            skipped.append({"node": n.name, "module": module_path(n), "why": "weight is not a parameter"})
            continue
        path = w.target.rpartition(".")[0]
        if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr" and is_param_attr(gm, b)):
            skipped.append({"node": n.name, "module": path, "why": "bias is not a parameter"})
            continue
        p = attr_of(gm, w.target)
        pat = matching_pattern(path, opts.skip_modules)
        if pat is not None:
            skipped.append({"node": n.name, "module": path, "why": f"matches skip_modules {pat!r}"})
            continue
        if p.numel() < opts.min_params:
            skipped.append({"node": n.name, "module": path, "why": f"{p.numel()} weights < min_params "
                                                                   f"{opts.min_params}"})
            continue
        if uses.get(id(p), 0) != 1:
            skipped.append({"node": n.name, "module": path, "why": "weight is shared (tied) with another use"})
            continue
        if p.dim() != 2:
            skipped.append({"node": n.name, "module": path, "why": f"weight has {p.dim()} dims"})
            continue
        sites.append(LinearSite(n, path, w.target, b.target if b is not None else None, transposed))
    return sites, skipped


def build_quant(gm, site: LinearSite, opts: PrecisionOptions, kind: str, compute: torch.dtype) -> nn.Module:
    w = attr_of(gm, site.weight)
    b = attr_of(gm, site.bias) if site.bias else None
    if site.transposed:
        w = w.t()
    return QuantLinear(w, b, kind, threshold=opts.int8_threshold, double_quant=opts.double_quant,
                       compute_dtype=compute)


def install_module(gm: fx.GraphModule, path: str, mod: nn.Module, site: LinearSite) -> str:
    """Put `mod` at the linear's own path when its container holds only this linear's weight/bias (a container
    fx made for this snapshot); else under a fresh root name. Returns the target."""
    prefix, _, name = path.rpartition(".")
    parent = gm.get_submodule(prefix) if prefix else gm
    container = getattr(parent, name, None)
    own = {site.weight.rpartition(".")[2]} | ({site.bias.rpartition(".")[2]} if site.bias else set())
    if type(container) is nn.Module and not container._modules and set(container._parameters) <= own \
            and not container._buffers:
        parent = private_owner(gm, prefix)
        parent._modules[name] = mod
        return path
    target = "fxmem_lowbit_" + path.replace(".", "_")
    k = 1
    while hasattr(gm, target):
        target = f"fxmem_lowbit_{path.replace('.', '_')}_{k}"
        k += 1
    gm.add_module(target, mod)
    return target


def swap_linear(gm: fx.GraphModule, site: LinearSite, mod: nn.Module) -> str:
    n = site.node
    if site.transposed:
        b_node, x_node, w_node = n.args
    else:
        x_node, w_node = n.args[0], n.args[1]
        b_node = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    target = install_module(gm, site.path, mod, site)
    with gm.graph.inserting_before(n):
        call = gm.graph.call_module(target, (x_node,))
    call.meta.update({k: v for k, v in n.meta.items() if k in ("nn_module_stack", "stack_trace", "val",
                                                                "fxmem_val")})
    call.meta["fxmem_precision"] = "quant"
    n.replace_all_uses_with(call)
    gm.graph.erase_node(n)
    for a in (w_node, b_node):
        if isinstance(a, fx.Node) and not a.users:
            gm.graph.erase_node(a)
    return target
