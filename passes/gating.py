"""Gating insertion: wrap expensive residual branches `x + f(x)` as `x + g(x) * f(x)` (fxmem.nn.gating).

Residual branches are found on the graph (an `aten.add.Tensor(x, y)` whose y depends on x through a matmul-class
op), chosen by `targets` (`auto`, or module path globs), outlined (`fxmem.outline`) and wrapped in `GatedResidual`.
A branch whose only per-row input is x can skip per sample; others skip per batch, and the Change says so.

Exact at insertion (`exact = True`): g = 1 exactly while the last gate layer is zero, so outputs and gradients
equal the original's. Train the gates with `fxmem.gating_loss(module)` added to the task loss.
Design: docs/design/pruning-gating.md, "The gating pass".
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from fxmem.calibrate import normalize_item
from fxmem.errors import PolicyError
from fxmem.nn.gating import GatedResidual, reset_skip_stats, skip_stats
from fxmem.node_value import EXPORT, node_value
from fxmem.ops import op_name
from fxmem.outline import OutlineError, outline, region_boundary
from fxmem.pass_api import Change, Pass, PassContext, PassResult, register
from fxmem.program import Program, module_path, module_stack

aten = torch.ops.aten

_EXPENSIVE = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "conv3d", "conv_transpose2d",
              "scaled_dot_product_attention", "einsum", "convolution"}
_NORMS = {"layer_norm", "rms_norm", "group_norm", "batch_norm", "native_layer_norm"}
_AUTO_PATH = re.compile(r"(^|\.)(attn|attention|self_attn|self_attention|mlp|ffn|ff|feed_forward|feedforward|"
                        r"conv|convs|gnn|gcn|gat|mixer)(\.|$|_|\d)", re.I)
_AUTO_TYPE = re.compile(r"(attention|mlp|feedforward|ffn|conv|gnn|block|layer)", re.I)


@dataclass
class GatingOptions:
    """passes.gating: which residual branches get a learned skip gate, and how it skips in inference."""
    targets: list[str] = field(default_factory=lambda: ["auto"])  # ["auto"] or module path globs
    threshold: float = 0.5  # inference: rows with gate < threshold skip the branch
    per_sample: bool = True  # compute the branch only for open rows (when the branch allows it)
    init_bias: float = 0.0  # >= 0: gates start exactly open
    reduction: int = 4  # gate hidden width = d / reduction
    min_branch_ops: int = 1  # matmul-class ops a branch needs to be worth a gate


def validate(options: GatingOptions) -> None:
    if not (0.0 < options.threshold <= 1.0):
        raise PolicyError(f"passes.gating.threshold: must be in (0, 1], got {options.threshold}")
    if options.init_bias < 0:
        raise PolicyError(f"passes.gating.init_bias: must be >= 0 (gates start open), got {options.init_bias}")
    if options.reduction < 1:
        raise PolicyError(f"passes.gating.reduction: must be >= 1, got {options.reduction}")
    if not options.targets:
        raise PolicyError("passes.gating.targets: empty; use [auto] or module path globs")


@dataclass
class Branch:
    add: fx.Node
    stream: fx.Node
    out: fx.Node
    nodes: list
    label: str
    types: list


def _descendants(start: fx.Node, limit: fx.Node, order: dict) -> set:
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in seen and order[user] <= order[limit]:
                seen.add(user)
                stack.append(user)
    return seen


def _ancestors(end: fx.Node) -> set:
    seen, stack = {end}, [end]
    while stack:
        node = stack.pop()
        for source in node.all_input_nodes:
            if source not in seen:
                seen.add(source)
                stack.append(source)
    return seen


def _label(nodes) -> tuple[str, list]:
    def is_norm(node):
        stack = module_stack(node)
        return op_name(node, calls_only=True) in _NORMS or (stack and "norm" in stack[-1][1].lower())
    paths = [module_path(node).split(".") for node in nodes if node.op == "call_function" and not is_norm(node)
             and module_path(node)]
    if not paths:
        return "", []
    common = paths[0]
    for parts in paths[1:]:
        common_len = 0
        while common_len < min(len(common), len(parts)) and common[common_len] == parts[common_len]:
            common_len += 1
        common = common[:common_len]
    label = ".".join(common)
    types = []
    for node in nodes:
        for path, type_name in module_stack(node):
            if path == label:
                types.append(type_name)
    return label, sorted(set(types))


def find_branches(graph_module: fx.GraphModule, min_ops: int = 1) -> list[Branch]:
    order = {node: i for i, node in enumerate(graph_module.graph.nodes)}
    out = []
    for add in graph_module.graph.nodes:
        if op_name(add, calls_only=True) != "add" or add.target is not aten.add.Tensor or len(add.args) != 2 \
                or add.kwargs:
            continue
        left, right = add.args
        if not (isinstance(left, fx.Node) and isinstance(right, fx.Node)):
            continue
        left_value, right_value, sum_value = (node_value(operand, tensor_only=True) for operand in (left, right, add))
        if left_value is None or right_value is None or sum_value is None \
                or tuple(left_value.shape) != tuple(right_value.shape) \
                or tuple(sum_value.shape) != tuple(left_value.shape) or not left_value.is_floating_point():
            continue
        for stream, branch_out in ((left, right), (right, left)):
            if len(branch_out.users) != 1:
                continue
            desc = _descendants(stream, branch_out, order)
            if branch_out not in desc:
                continue
            body = [node for node in _ancestors(branch_out) if node in desc and node.op != "get_attr"]
            if sum(op_name(node, calls_only=True) in _EXPENSIVE for node in body) < min_ops:
                continue
            members = set(body)
            for node in list(body):  # shape/metadata assertions on branch values go with the branch
                for user in node.users:
                    if user not in members and op_name(user, calls_only=True).startswith("_assert") and not user.users:
                        members.add(user)
                        body.append(user)
            if any(user not in members and user is not add for node in body for user in node.users):
                continue  # a branch value escapes: not a pure branch
            if any(node.op in ("placeholder", "output") for node in body):
                continue
            if any(node.op == "call_function" and getattr(node.target, "_schema", None) is not None
                   and node.target._schema.is_mutable for node in body):
                continue
            body.sort(key=order.get)
            label, types = _label(body)
            out.append(Branch(add, stream, branch_out, body, label or branch_out.name, types))
            break
    return out


def _chosen(branch: Branch, targets: list[str]) -> str | None:
    for target in targets:
        if target == "auto":
            if _AUTO_PATH.search(branch.label) or any(_AUTO_TYPE.search(ty) for ty in branch.types):
                return "auto"
        elif fnmatch.fnmatchcase(branch.label, target):
            return target
    return None


def _localize_sizes(graph_module: fx.GraphModule, branch: Branch) -> None:
    """Sizes of x the branch reads from outside (sym_size nodes) are re-read from x inside the branch, so the
    branch can run on a subset of rows."""
    stream_value = node_value(branch.stream, source=EXPORT)
    if not isinstance(stream_value, torch.Tensor):
        return
    members = set(branch.nodes)
    for size_node in list({a for n in branch.nodes for a in n.all_input_nodes if a not in members}):
        if size_node.op != "call_function" or size_node.target is not aten.sym_size.int:
            continue
        size_value = node_value(size_node, source=EXPORT)
        dims = [k for k in range(stream_value.dim()) if str(stream_value.shape[k]) == str(size_value)]
        if not dims:
            continue
        first = min(branch.nodes, key=lambda n: list(graph_module.graph.nodes).index(n))
        with graph_module.graph.inserting_before(first):
            new = graph_module.graph.call_function(aten.sym_size.int, (branch.stream, dims[0]))
        new.meta = dict(size_node.meta)
        size_node.replace_all_uses_with(new, delete_user_cb=lambda u: u in members)
        branch.nodes.insert(0, new)
        members.add(new)


def _row_safe(branch: Branch, inputs: list) -> tuple[bool, str]:
    for source in inputs:
        if source is branch.stream or source.op == "get_attr":
            continue
        value = node_value(source, source=EXPORT)
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or _not_per_row(value, node_value(branch.stream, source=EXPORT)):
                continue
            return False, f"the branch also reads tensor {source.name} from outside (per-row coupling unknown)"
        if source.op == "call_function" and source.target is aten.sym_size.int:
            return False, f"the branch reads size {source.name} of another tensor"
    return True, ""


def _not_per_row(value: torch.Tensor, stream_value) -> bool:
    """True when tensor `value` cannot be indexed by the rows of the residual stream x (`stream_value`): its
    leading dim is 1, or x's batch size is symbolic and appears in none of its dims."""
    if int(value.shape[0]) == 1 if not isinstance(value.shape[0], torch.SymInt) else False:
        return True
    if isinstance(stream_value, torch.Tensor) and stream_value.dim() \
            and isinstance(stream_value.shape[0], torch.SymInt):
        batch_size = str(stream_value.shape[0])
        return all(str(s) != batch_size for s in value.shape)
    return False


@register
class GatingPass(Pass):
    name = "gating"
    exact = True  # at insertion: gates are exactly open
    Options = GatingOptions

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        options: GatingOptions = ctx.options
        validate(options)
        graph_module = program.module
        notes, changes = [], []
        found = find_branches(graph_module, options.min_branch_ops)
        metrics: dict = {"branches_found": [b.label for b in found]}
        chosen = [(b, why) for b in found if (why := _chosen(b, options.targets)) is not None]
        if not chosen:
            notes.append(f"no residual branch matches targets {options.targets} (found: "
                         f"{', '.join(b.label for b in found) or 'none'})")
            return PassResult(program, False, notes=notes, metrics=metrics)
        done: set = set()
        while True:
            # re-find after every rewrite: outlining replaces nodes the next branch may read
            nxt = [(b, why) for b in find_branches(graph_module, options.min_branch_ops)
                   if (why := _chosen(b, options.targets)) is not None and (b.label, b.add.name) not in done]
            if not nxt:
                break
            branch, why = nxt[0]
            done.add((branch.label, branch.add.name))
            if options.per_sample:
                _localize_sizes(graph_module, branch)
            inputs, outputs = region_boundary(branch.nodes)
            if outputs != [branch.out]:
                notes.append(f"{branch.label}: branch values used outside it ({[x.name for x in outputs]}); not gated")
                continue
            if branch.stream not in inputs:
                notes.append(f"{branch.label}: the branch does not read its residual stream directly; not gated")
                continue
            x_index = inputs.index(branch.stream)
            stream_value = node_value(branch.stream, tensor_only=True)
            fdim = 1 if stream_value.dim() == 4 else -1
            feats = int(stream_value.shape[fdim])
            safe, why_not = _row_safe(branch, inputs)
            label = branch.label
            add = branch.add

            def wrap(body, x_index=x_index, feats=feats, fdim=fdim, safe=safe, label=label):
                return GatedResidual(body, x_index, feats, feature_dim=fdim, reduction=options.reduction,
                                     init_bias=options.init_bias, threshold=options.threshold,
                                     per_sample=options.per_sample,
                                     label=label, row_safe=safe)
            try:
                call = outline(program, branch.nodes, "gate_" + label.replace(".", "_"), wrap=wrap)
            except OutlineError as error:
                notes.append(f"{label}: not gated: {error}")
                continue
            add.replace_all_uses_with(call)
            call.meta.update({k: v for k, v in add.meta.items() if k in ("val", "fxmem_val", "tensor_meta")})
            graph_module.graph.erase_node(add)
            mode = "per sample" if (options.per_sample and safe) else "per batch"
            gate_width = max(1, feats // options.reduction)
            reason = (f"residual branch ({why}) gated: x + g(x) * f(x), gate {feats}->{gate_width}"
                      f"->1 on the mean of x; inference skips {mode}")
            if options.per_sample and not safe:
                reason += f" ({why_not})"
            changes.append(Change(kind="gate", module=label, nodes_before=[n.name for n in branch.nodes] + [add.name],
                                  nodes_after=[call.name], reason=reason, bytes_saved=0,
                                  details={"submodule": call.target, "features": feats, "per_sample":
                                           bool(options.per_sample and safe), "matched": why}))
        if not changes:
            return PassResult(program, False, notes=notes, metrics=metrics)
        graph_module.graph.lint()
        graph_module.recompile()
        metrics["gates"] = len(changes)
        metrics["gate_params"] = sum(p.numel() for n, p in graph_module.named_parameters() if ".gate." in f".{n}")
        cal = ctx.calibration
        if cal:
            metrics["skip_rate_calibration"] = self._skip_rates(program, list(cal)[:4])
        return PassResult(program, True, changes=changes, notes=notes, metrics=metrics)

    @staticmethod
    def _skip_rates(program: Program, items) -> dict:
        module = program.module
        was = module.training
        module.eval()
        reset_skip_stats(module)
        try:
            with torch.no_grad():
                for item in items:
                    args, kwargs = normalize_item(item)
                    module(*args, **kwargs)
        finally:
            module.train(was)
        out = {label: round(stats["skip_rate"], 4) for label, stats in skip_stats(module).items()}
        reset_skip_stats(module)
        return out
