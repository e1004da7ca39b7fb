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
from fxmem.node_value import EXPORT, node_value
from fxmem.nn.gating import GatedResidual, reset_skip_stats, skip_stats
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


def validate(o: GatingOptions) -> None:
    if not (0.0 < o.threshold <= 1.0):
        raise PolicyError(f"passes.gating.threshold: must be in (0, 1], got {o.threshold}")
    if o.init_bias < 0:
        raise PolicyError(f"passes.gating.init_bias: must be >= 0 (gates start open), got {o.init_bias}")
    if o.reduction < 1:
        raise PolicyError(f"passes.gating.reduction: must be >= 1, got {o.reduction}")
    if not o.targets:
        raise PolicyError("passes.gating.targets: empty; use [auto] or module path globs")


@dataclass
class Branch:
    add: fx.Node
    x: fx.Node
    out: fx.Node
    nodes: list
    label: str
    types: list


def _descendants(x: fx.Node, limit: fx.Node, order: dict) -> set:
    seen, stack = set(), [x]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen and order[u] <= order[limit]:
                seen.add(u)
                stack.append(u)
    return seen


def _ancestors(y: fx.Node) -> set:
    seen, stack = {y}, [y]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _label(nodes) -> tuple[str, list]:
    def is_norm(n):
        st = module_stack(n)
        return op_name(n, calls_only=True) in _NORMS or (st and "norm" in st[-1][1].lower())
    paths = [module_path(n).split(".") for n in nodes if n.op == "call_function" and not is_norm(n)
             and module_path(n)]
    if not paths:
        return "", []
    common = paths[0]
    for p in paths[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    label = ".".join(common)
    types = []
    for n in nodes:
        for path, ty in module_stack(n):
            if path == label:
                types.append(ty)
    return label, sorted(set(types))


def find_branches(gm: fx.GraphModule, min_ops: int = 1) -> list[Branch]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for add in gm.graph.nodes:
        if op_name(add, calls_only=True) != "add" or add.target is not aten.add.Tensor or len(add.args) != 2 \
                or add.kwargs:
            continue
        a, b = add.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            continue
        va, vb, vo = (node_value(operand, tensor_only=True) for operand in (a, b, add))
        if va is None or vb is None or vo is None or tuple(va.shape) != tuple(vb.shape) \
                or tuple(vo.shape) != tuple(va.shape) or not va.is_floating_point():
            continue
        for x, y in ((a, b), (b, a)):
            if len(y.users) != 1:
                continue
            desc = _descendants(x, y, order)
            if y not in desc:
                continue
            body = [n for n in _ancestors(y) if n in desc and n.op != "get_attr"]
            if sum(op_name(n, calls_only=True) in _EXPENSIVE for n in body) < min_ops:
                continue
            members = set(body)
            for n in list(body):  # shape/metadata assertions on branch values go with the branch
                for u in n.users:
                    if u not in members and op_name(u, calls_only=True).startswith("_assert") and not u.users:
                        members.add(u)
                        body.append(u)
            if any(u not in members and u is not add for n in body for u in n.users):
                continue  # a branch value escapes: not a pure branch
            if any(n.op in ("placeholder", "output") for n in body):
                continue
            if any(n.op == "call_function" and getattr(n.target, "_schema", None) is not None
                   and n.target._schema.is_mutable for n in body):
                continue
            body.sort(key=order.get)
            label, types = _label(body)
            out.append(Branch(add, x, y, body, label or y.name, types))
            break
    return out


def _chosen(br: Branch, targets: list[str]) -> str | None:
    for t in targets:
        if t == "auto":
            if _AUTO_PATH.search(br.label) or any(_AUTO_TYPE.search(ty) for ty in br.types):
                return "auto"
        elif fnmatch.fnmatchcase(br.label, t):
            return t
    return None


def _localize_sizes(gm: fx.GraphModule, br: Branch) -> None:
    """Sizes of x the branch reads from outside (sym_size nodes) are re-read from x inside the branch, so the
    branch can run on a subset of rows."""
    vx = node_value(br.x, source=EXPORT)
    if not isinstance(vx, torch.Tensor):
        return
    members = set(br.nodes)
    for s in list({a for n in br.nodes for a in n.all_input_nodes if a not in members}):
        if s.op != "call_function" or s.target is not aten.sym_size.int:
            continue
        sv = node_value(s, source=EXPORT)
        dims = [k for k in range(vx.dim()) if str(vx.shape[k]) == str(sv)]
        if not dims:
            continue
        first = min(br.nodes, key=lambda n: list(gm.graph.nodes).index(n))
        with gm.graph.inserting_before(first):
            new = gm.graph.call_function(aten.sym_size.int, (br.x, dims[0]))
        new.meta = dict(s.meta)
        s.replace_all_uses_with(new, delete_user_cb=lambda u: u in members)
        br.nodes.insert(0, new)
        members.add(new)


def _row_safe(br: Branch, inputs: list) -> tuple[bool, str]:
    for a in inputs:
        if a is br.x or a.op == "get_attr":
            continue
        v = node_value(a, source=EXPORT)
        if isinstance(v, torch.Tensor):
            if v.dim() == 0 or _not_per_row(v, node_value(br.x, source=EXPORT)):
                continue
            return False, f"the branch also reads tensor {a.name} from outside (per-row coupling unknown)"
        if a.op == "call_function" and a.target is aten.sym_size.int:
            return False, f"the branch reads size {a.name} of another tensor"
    return True, ""


def _not_per_row(v: torch.Tensor, vx) -> bool:
    """True when tensor `v` cannot be indexed by x's rows: its leading dim is 1, or x's batch size is symbolic
    and appears in none of v's dims."""
    if int(v.shape[0]) == 1 if not isinstance(v.shape[0], torch.SymInt) else False:
        return True
    if isinstance(vx, torch.Tensor) and vx.dim() and isinstance(vx.shape[0], torch.SymInt):
        b = str(vx.shape[0])
        return all(str(s) != b for s in v.shape)
    return False


@register
class GatingPass(Pass):
    name = "gating"
    exact = True  # at insertion: gates are exactly open
    Options = GatingOptions

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        o: GatingOptions = ctx.options
        validate(o)
        gm = program.module
        notes, changes = [], []
        found = find_branches(gm, o.min_branch_ops)
        metrics: dict = {"branches_found": [b.label for b in found]}
        chosen = [(b, why) for b in found if (why := _chosen(b, o.targets)) is not None]
        if not chosen:
            notes.append(f"no residual branch matches targets {o.targets} (found: "
                         f"{', '.join(b.label for b in found) or 'none'})")
            return PassResult(program, False, notes=notes, metrics=metrics)
        done: set = set()
        while True:
            # re-find after every rewrite: outlining replaces nodes the next branch may read
            nxt = [(b, why) for b in find_branches(gm, o.min_branch_ops)
                   if (why := _chosen(b, o.targets)) is not None and (b.label, b.add.name) not in done]
            if not nxt:
                break
            br, why = nxt[0]
            done.add((br.label, br.add.name))
            if o.per_sample:
                _localize_sizes(gm, br)
            inputs, outputs = region_boundary(br.nodes)
            if outputs != [br.out]:
                notes.append(f"{br.label}: branch values used outside it ({[x.name for x in outputs]}); not gated")
                continue
            if br.x not in inputs:
                notes.append(f"{br.label}: the branch does not read its residual stream directly; not gated")
                continue
            x_index = inputs.index(br.x)
            vx = node_value(br.x, tensor_only=True)
            fdim = 1 if vx.dim() == 4 else -1
            feats = int(vx.shape[fdim])
            safe, why_not = _row_safe(br, inputs)
            label = br.label
            add = br.add

            def wrap(body, x_index=x_index, feats=feats, fdim=fdim, safe=safe, label=label):
                return GatedResidual(body, x_index, feats, feature_dim=fdim, reduction=o.reduction,
                                     init_bias=o.init_bias, threshold=o.threshold, per_sample=o.per_sample,
                                     label=label, row_safe=safe)
            try:
                call = outline(program, br.nodes, "gate_" + label.replace(".", "_"), wrap=wrap)
            except OutlineError as e:
                notes.append(f"{label}: not gated: {e}")
                continue
            add.replace_all_uses_with(call)
            call.meta.update({k: v for k, v in add.meta.items() if k in ("val", "fxmem_val", "tensor_meta")})
            gm.graph.erase_node(add)
            mode = "per sample" if (o.per_sample and safe) else "per batch"
            reason = (f"residual branch ({why}) gated: x + g(x) * f(x), gate {feats}->{max(1, feats // o.reduction)}"
                      f"->1 on the mean of x; inference skips {mode}")
            if o.per_sample and not safe:
                reason += f" ({why_not})"
            changes.append(Change(kind="gate", module=label, nodes_before=[n.name for n in br.nodes] + [add.name],
                                  nodes_after=[call.name], reason=reason, bytes_saved=0,
                                  details={"submodule": call.target, "features": feats, "per_sample":
                                           bool(o.per_sample and safe), "matched": why}))
        if not changes:
            return PassResult(program, False, notes=notes, metrics=metrics)
        gm.graph.lint()
        gm.recompile()
        metrics["gates"] = len(changes)
        metrics["gate_params"] = sum(p.numel() for n, p in gm.named_parameters() if ".gate." in f".{n}")
        cal = ctx.calibration
        if cal:
            metrics["skip_rate_calibration"] = self._skip_rates(program, list(cal)[:4])
        return PassResult(program, True, changes=changes, notes=notes, metrics=metrics)

    @staticmethod
    def _skip_rates(program: Program, items) -> dict:
        gm = program.module
        was = gm.training
        gm.eval()
        reset_skip_stats(gm)
        try:
            with torch.no_grad():
                for it in items:
                    a, k = normalize_item(it)
                    gm(*a, **k)
        finally:
            gm.train(was)
        out = {k: round(v["skip_rate"], 4) for k, v in skip_stats(gm).items()}
        reset_skip_stats(gm)
        return out
