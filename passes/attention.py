"""Attention pass: hand-written attention -> `scaled_dot_product_attention` (exact), or an approximation (opt-in).

Manual attention keeps the (Lq x Lk) score matrix several times for backward; SDPA's fused kernels keep memory
linear in the sequence length. Sites come from `fxmem.attention_match.find_attention`, which proves each one
equivalent; what it cannot prove is reported as "not rewritten: <reason>" with the module path.

`rewrite`: `sdpa` (default, exact; `fxmem.nn.attention.sdpa_dropout`, fully masked rows `fxmem.attention_rows`),
`hab` (`fxmem.nn.attention.HybridAttention`) or `semiseparable` (`SemiseparableAttention`), both lossy and judged by
`fxmem.lossguard` (kind `attention`) through `is_exact(options)`. Per-site cost-model bytes (`site_bytes`) go into
each Change's `bytes_saved`.
Design: docs/design/attention.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import fx

from fxmem.attention_constants import emit_scale
from fxmem.attention_match import existing_sdpa, find_attention, glob_match
from fxmem.attention_projection import trace_projection
from fxmem.attention_rows import SdpaCall, emit_fully_masked_rows
from fxmem.attention_site import AttentionSite
from fxmem.costmodel import node_costs
from fxmem.intent import Intent, guard_stop
from fxmem.lossguard import exclusion_steps, first_accepted, guard_for
from fxmem.nn.attention import HybridAttention, SemiseparableAttention, sdpa_dropout
from fxmem.node_value import node_value
from fxmem.pass_api import Change, Pass, PassContext, PassResult, register
from fxmem.outline import unique_name
from fxmem.program import Program, is_impure
from fxmem.sdpa_backend import probe_backend

aten = torch.ops.aten


@dataclass
class AttentionOptions:
    """Options of `passes.attention` in a policy."""
    rewrite: Literal["sdpa", "hab", "semiseparable"] = "sdpa"
    gqa: bool = True  # grouped-query attention: enable_gqa=True on the un-expanded k/v (False: keep repeat_kv)
    skip: list[str] = field(default_factory=list)  # module-path glob patterns left as they are
    site_bytes: bool = True  # per-site saved bytes before/after from the cost model (two static traces)
    # --- hab (HybridAttention)
    sparsity_ratio: float = 0.75  # share of keys each query drops (keeps the top (1 - ratio) * Lk scores)
    top_k: int | None = None  # absolute number of keys per query (overrides sparsity_ratio)
    chunk_size: int = 128  # query rows per block (hab) / block size of the band (semiseparable when band is None)
    rank_ratio: float | None = None  # hab: low-rank q/k projections from a truncated SVD of the q/k weights
    # --- semiseparable
    rank: int | None = None  # rank of the low-rank part; None = ceil(log2 Lk)
    band: int | None = None  # block size of the exact band (each query sees its own and neighbouring blocks)
    hierarchical: bool = False  # two levels: rank 2r for the blocks next to the band, r beyond
    lowrank_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # dtype of the low-rank factors (band stays fp32)
    # --- both approximations
    tolerance: float | None = None  # end-to-end relative output error; None = kind default / verify.lossy_tolerance
    seed: int = 0  # random features of the semiseparable low-rank part

    def __post_init__(self):
        if not 0.0 <= self.sparsity_ratio < 1.0:
            raise ValueError(f"sparsity_ratio must be in [0, 1), got {self.sparsity_ratio}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.band is not None and self.band < 1:
            raise ValueError(f"band must be >= 1, got {self.band}")
        if self.rank_ratio is not None and not 0.0 < self.rank_ratio <= 1.0:
            raise ValueError(f"rank_ratio must be in (0, 1], got {self.rank_ratio}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {self.tolerance}")


@register
class AttentionPass(Pass):
    name = "attention"
    exact = True  # for rewrite: sdpa; see is_exact
    Options = AttentionOptions

    @staticmethod
    def is_exact(options) -> bool:
        return getattr(options, "rewrite", "sdpa") == "sdpa"

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        opts: AttentionOptions = ctx.options
        if opts.rewrite == "sdpa":
            return rewrite_attention(program, opts, mode=ctx.mode, log=ctx.log)
        return approximate(program, opts, ctx)


def approximate(program: Program, opts: AttentionOptions, ctx: PassContext) -> PassResult:
    """`rewrite: hab | semiseparable`, judged end to end by the guard (kind `attention`): every site that can take
    the approximation takes it; while the guard refuses, the sites whose own error (on the example inputs) is largest
    go back to exact SDPA, 1, 2, 4, ... of them. When it accepts none, every site is exact SDPA."""
    guard = guard_for(ctx, program, "attention", section="passes.attention", tolerance=opts.tolerance)
    built: list = []

    def build(exact_sites):
        cand = program.snapshot()
        res = rewrite_attention(cand, opts, mode=ctx.mode, log=ctx.log, exact_sites=set(exact_sites))
        built.append(res)
        return cand, res

    def states():
        yield []
        errors = {c.module: c.details["rel_error"] for c in built[0].changes if c.kind == f"attention.{opts.rewrite}"}
        yield from list(exclusion_steps(sorted(errors, key=lambda m: -errors[m])))[1:]
    outcome = first_accepted(guard, build, states(), "attention")
    first = built[0]
    asked = sum(c.kind == f"attention.{opts.rewrite}" for c in first.changes)
    if outcome.program is None:  # no approximation accepted: exact SDPA at every site
        result = build([c.module for c in first.changes])[1]
    else:
        result = outcome.payload
        result.verdicts = [outcome.verdict]
    _approx_intent(result, opts, first, asked, outcome)
    if outcome.asked is not None:
        result.metrics["guard_asked"] = [outcome.asked.to_dict()]
    return result


def _approx_intent(result: PassResult, opts: AttentionOptions, first: PassResult, asked: int, outcome) -> None:
    """What `rewrite` asked (every matched site) against how many sites were approximated, and why not more."""
    sites = first.metrics["rewritten"]
    done = sum(record.kind == f"attention.{opts.rewrite}" for record in result.changes)
    stopped_by, change = guard_stop(outcome.asked)
    if asked < sites and not stopped_by:
        stopped_by = f"{sites - asked} site(s) cannot take {opts.rewrite} (the report's notes say why)"
        change = "nothing to change for those sites"
    for record in result.changes:
        if record.kind == "attention.sdpa" and record.module in {x.module for x in first.changes
                                                        if x.kind == f"attention.{opts.rewrite}"}:
            record.reason += (f"; {opts.rewrite} backed off here by the guard (this site's own error is among the "
                              f"largest)")
    result.intents = [Intent("passes.attention.rewrite", f"{opts.rewrite} at {sites} attention site(s)",
                             f"{opts.rewrite} at {done} of {sites} (the rest exact SDPA)", done == sites,
                             stopped_by, change)]


# ============================================================================================ the rewrite

def rewrite_attention(program: Program, opts: AttentionOptions | None = None, *, mode: str | None = None,
                      log=lambda m: None, exact_sites: set = frozenset()) -> PassResult:
    """Rewrite every provable attention site of `program` in place (usable without a policy, e.g. in tests): exact
    SDPA, or the approximation `opts.rewrite` except at the sites (module paths) in `exact_sites`. Unjudged: the
    pass's guard decides which approximations stay (`approximate`)."""
    opts = opts or AttentionOptions()
    mode = mode or program.mode
    _ensure_meta(program)
    changes, notes = [], []
    sites = find_attention(program)
    n_existing = len(existing_sdpa(program))
    if n_existing:
        notes.append(f"{n_existing} scaled_dot_product_attention call(s) already in the graph: left as they are")
    before = _saved_by_node(program, mode) if opts.site_bytes else {}
    metrics = {"sites": len(sites), "rewritten": 0, "not_rewritten": 0, "sites_detail": []}
    if opts.rewrite != "sdpa":
        capture_examples(program, sites)
    done = []
    for site in sites:
        if site.ok and opts.skip and glob_match(site.module, opts.skip):
            site.reason = "skipped by passes.attention.skip"
        if not site.ok:
            notes.append(f"{site.module or '<root>'}: not rewritten: {site.reason}")
            metrics["not_rewritten"] += 1
            metrics["sites_detail"].append({"module": site.module, "rewritten": False, "reason": site.reason})
            continue
        kind = "sdpa" if site.module in exact_sites else opts.rewrite
        info = {}
        if kind != "sdpa":
            new, info = _emit_approx(program, site, opts, kind)
            if new is None:
                notes.append(f"{site.module}: {kind} rejected ({info.get('why')}); exact SDPA instead")
                kind = "sdpa"
        if kind == "sdpa":
            new, info = _emit_sdpa(program, site, opts)
        done.append((site, new, kind, info))
    if not done:
        return PassResult(program, False, changes, notes, metrics, reason=declined_summary(sites))
    program.refresh()
    after = _saved_by_node(program, mode) if opts.site_bytes else {}
    for site, new, kind, info in done:
        backend = probe_backend(new) if kind == "sdpa" else {}
        saved_before = sum(before.get(name, 0) for name in info["removed"])
        saved_after = after.get(new.name, 0) + sum(after.get(name, 0) for name in info.get("added", []))
        reason = f"manual attention -> {_label(kind)} ({site.describe()})"
        if backend:
            reason += f"; SDPA backend on {backend['device']}: {backend['summary']}"
        details = {"rewrite": kind, "scale": site.scale_value, "is_causal": info.get("is_causal", False),
                   "mask": info.get("mask", "none"), "dropout_p": site.dropout_p, "gqa_groups": site.gqa_groups,
                   "enable_gqa": info.get("enable_gqa", False), "backend": backend,
                   "fully_masked_rows": info.get("fully_masked_rows"),
                   "saved_bytes_before": saved_before, "saved_bytes_after": saved_after,
                   "notes": list(site.notes)}
        for key in ("rel_error", "top_k", "rank", "rank_ratio", "band", "lowrank_dtype"):
            if key in info:
                details[key] = info[key]
        changes.append(Change(kind=f"attention.{kind}", module=site.module, nodes_before=list(info["removed"]),
                              nodes_after=[new.name] + list(info.get("added", [])), reason=reason,
                              bytes_saved=(saved_before - saved_after) if opts.site_bytes else None,
                              details=details))
        metrics["rewritten"] += 1
        metrics["sites_detail"].append({"module": site.module, "rewritten": True, "rewrite": kind,
                                        "backend": backend.get("summary"), "rel_error": info.get("rel_error")})
        for note in site.notes:
            notes.append(f"{site.module}: {note}")
        if backend and backend.get("fallback"):
            notes.append(f"{site.module}: {backend['fallback']}")
    log(f"[attention] {metrics['rewritten']} site(s) rewritten, {metrics['not_rewritten']} not rewritten")
    # SDPA draws attention dropout in its own kernel: the same distribution, not the same numbers as the manual form
    return PassResult(program, True, changes, notes, metrics,
                      draws_differ=any(site.dropout_p > 0 for site, *_ in done))


def declined_summary(sites: list[AttentionSite], shown: int = 3) -> str:
    """One line naming the sites not rewritten, grouped by reason ('' when every site was rewritten)."""
    by_reason: dict[str, list[str]] = {}
    for site in sites:
        if not site.ok:
            by_reason.setdefault(site.reason, []).append(site.module or "<root>")
    parts = []
    for reason, modules in by_reason.items():
        more = f" and {len(modules) - shown} more" if len(modules) > shown else ""
        parts.append(f"{', '.join(modules[:shown])}{more}: {reason}")
    count = sum(len(m) for m in by_reason.values())
    return f"{count} attention site(s) not rewritten: " + "; ".join(parts) if parts else ""


def _label(kind):
    return {"sdpa": "scaled_dot_product_attention", "hab": "HybridAttention",
            "semiseparable": "SemiseparableAttention"}[kind]


def _ensure_meta(program: Program) -> None:
    graph = program.graph
    if any(n.op == "call_function" and "fxmem_val" not in n.meta for n in graph.nodes):
        program.refresh()
    else:
        graph.eliminate_dead_code(is_impure_node=is_impure)


def _saved_by_node(program: Program, mode: str) -> dict:
    try:
        return {k: v.saved_bytes for k, v in node_costs(program, mode).items()}
    except Exception:  # noqa: BLE001 - the estimate is informative only
        return {}


def _copy_meta(new: fx.Node, old: fx.Node) -> None:
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "val", "fxmem_val"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


def _inputs(graph: fx.Graph, site: AttentionSite, opts) -> tuple:
    """q, k, v in (B, H, L, E) layout (k transposed back if needed; 3-D forms unsqueezed), enable_gqa."""
    query, value = site.query, site.value
    key = site.key
    if key is None:
        key = graph.call_function(aten.transpose.int, (site.key_transposed, -2, -1))
    enable_gqa = site.gqa_groups > 1
    if enable_gqa and not opts.gqa:
        key, value, enable_gqa = site.key_expanded, site.value_expanded, False
    if site.batch_dims == 1:
        query, key, value = (graph.call_function(aten.unsqueeze.default, (x, 0)) for x in (query, key, value))
    return query, key, value, enable_gqa


def _mask(graph: fx.Graph, site: AttentionSite) -> tuple[fx.Node | None, str]:
    """The attn_mask for SDPA: None (no mask / is_causal), a bool keep-mask, or an additive float mask."""
    if not site.masks or site.causal:
        return None, "causal" if site.causal else "none"
    keep = None
    add = None
    for mask_term in site.masks:
        if mask_term.kind == "additive":
            add = mask_term.node if add is None else graph.call_function(aten.add.Tensor, (add, mask_term.node))
            continue
        keep_term = mask_term.node if mask_term.kind == "keep" \
            else graph.call_function(aten.logical_not.default, (mask_term.node,))
        keep = keep_term if keep is None else graph.call_function(aten.logical_and.default, (keep, keep_term))
    if keep is not None and add is not None:
        return graph.call_function(aten.where.ScalarOther, (keep, add, float("-inf"))), "additive+bool"
    if keep is not None:
        return keep, "bool keep-mask"
    return add, "additive"


def _emit_sdpa(program: Program, site: AttentionSite, opts) -> tuple[fx.Node, dict]:
    graph = program.graph
    before = set(graph.nodes)
    with graph.inserting_before(site.output):
        query, key, value, enable_gqa = _inputs(graph, site, opts)
        mask, mask_kind = _mask(graph, site)
        scale = emit_scale(graph, site.scale)
        train = site.dropout_train
        if site.dropout_p > 0 and isinstance(train, fx.Node):
            out = graph.call_function(sdpa_dropout, (query, key, value, mask, site.dropout_p, train, site.causal, scale,
                                                 enable_gqa))
        else:
            dropout_p = site.dropout_p if (site.dropout_p > 0 and train is True) else 0.0
            out = graph.call_function(aten.scaled_dot_product_attention.default, (query, key, value),
                                  {"attn_mask": mask, "dropout_p": dropout_p, "is_causal": site.causal, "scale": scale,
                                   "enable_gqa": enable_gqa})
        call = SdpaCall(query, key, value, mask, scale, site.gqa_groups if enable_gqa else 1)
        final = _with_fully_masked_rows(graph, site, call, out) if mask_kind == "additive" else out
        corrected = final is not out
        if site.batch_dims == 1:
            final = graph.call_function(aten.squeeze.dim, (final, 0))
    added = [node for node in graph.nodes if node not in before]
    for node in added:
        _copy_meta(node, site.output) if node is final else node.meta.setdefault(
            "nn_module_stack", site.output.meta.get("nn_module_stack"))
    removed = _replace(graph, site, final)
    return out, {"removed": removed, "added": [node.name for node in added if node is not out],
                 "is_causal": site.causal, "mask": mask_kind, "enable_gqa": enable_gqa,
                 "fully_masked_rows": "eager" if corrected else None}


def _with_fully_masked_rows(graph: fx.Graph, site: AttentionSite, call: SdpaCall, out: fx.Node) -> fx.Node:
    """`out` whose rows the additive mask masks fully get eager attention's value and gradient
    (`fxmem.attention_rows`); `out` itself where the mask is not a float tensor."""
    mask_val = node_value(site.masks[0].node)
    if not isinstance(mask_val, torch.Tensor) or not mask_val.is_floating_point():
        return out
    output_ndim = len(node_value(site.query).shape) + (site.batch_dims == 1)
    return emit_fully_masked_rows(graph, call, out, mask_val.dtype, output_ndim)


def _replace(graph: fx.Graph, site: AttentionSite, final: fx.Node) -> list[str]:
    site.output.replace_all_uses_with(final)
    removed = []
    for node in reversed(site.nodes):
        if not node.users:
            removed.append(node.name)
            graph.erase_node(node)
    return removed[::-1]


# ============================================================================================ approximations

def _emit_approx(program: Program, site: AttentionSite, opts, kind: str):
    """Swap in HybridAttention / SemiseparableAttention where the site allows it; its own relative error on the
    example inputs (against exact attention) goes into the Change (it orders the guard's back-off)."""
    if site.masks and not site.causal and any(m.kind != "additive" for m in site.masks) \
            and any(m.kind == "additive" for m in site.masks):
        return None, {"why": "mixed bool and additive masks"}
    query_example, key_example, value_example = (_example(site, x) for x in ("q", "k", "v"))
    if query_example is None:
        return None, {"why": "example values of q/k/v unavailable"}
    if kind == "hab":
        mod, params, input_example = _hybrid_module(program, site, opts, key_example.shape[-2])
        if mod is None:
            return None, params
    else:
        mod, params = _semiseparable_module(site, opts, key_example.shape[-2], query_example.shape[-1])
        input_example = None
    if site.scale_value is None or any(not isinstance(f, float) for _, f in site.scale):
        return None, {"why": "shape-dependent scale"}
    mask_ex, why = _approx_mask_example(program, site)
    if why is not None:
        return None, why
    params["rel_error"] = _approx_error(site, mod, (query_example, key_example, value_example), mask_ex, input_example)
    out, inserted = _insert_approx(program, site, opts, mod, kind, mask_ex)
    if site.dropout_p:
        site.notes.append(f"attention dropout (p={site.dropout_p:g}) is not applied by the approximation")
    params.update(inserted)
    return out, params


def _hybrid_module(program: Program, site: AttentionSite, opts, key_len: int):
    """HybridAttention for the site, its parameters and the example input of the q/k projection (low rank only);
    (None, {"why": ...}, None) where rank_ratio cannot apply."""
    top_k = opts.top_k or max(1, math.ceil((1.0 - opts.sparsity_ratio) * key_len))
    mod = HybridAttention(scale=site.scale_value, causal=site.causal, top_k=top_k, chunk_size=opts.chunk_size)
    params = {"top_k": top_k}
    if opts.rank_ratio is None:
        return mod, params, None
    query_proj, key_proj = trace_projection(site.query), trace_projection(site.key) if site.key is not None else None
    if query_proj is None or key_proj is None or query_proj.input_node is not key_proj.input_node \
            or query_proj.heads != key_proj.heads or site.gqa_groups > 1:
        return None, {"why": "rank_ratio: q and k are not heads of linear layers on one input"}, None
    input_example = _example_node(program, query_proj.input_node)
    if input_example is None or site.batch_dims != 2:
        return None, {"why": "rank_ratio: example value of the projection input unavailable"}, None
    query_weight = _attr(program, query_proj.weight)
    key_weight = _attr(program, key_proj.weight)
    width = query_proj.heads * query_proj.head_dim
    query_rows = slice(query_proj.offset, query_proj.offset + width)
    key_rows = slice(key_proj.offset, key_proj.offset + width)
    query_bias = _attr(program, query_proj.bias)[query_rows] if query_proj.bias is not None else None
    key_bias = _attr(program, key_proj.bias)[key_rows] if key_proj.bias is not None else None
    rank = mod.set_low_rank(query_weight[query_rows], query_bias, key_weight[key_rows], key_bias, query_proj.heads,
                            opts.rank_ratio)
    params.update({"rank": rank, "rank_ratio": opts.rank_ratio})
    return mod, params, input_example


def _semiseparable_module(site: AttentionSite, opts, key_len: int, head_dim: int):
    """SemiseparableAttention for the site and its parameters."""
    rank = opts.rank or max(1, math.ceil(math.log2(max(key_len, 2))))
    band = opts.band or opts.chunk_size
    mod = SemiseparableAttention(scale=site.scale_value, causal=site.causal, rank=rank, band=band,
                                 hierarchical=opts.hierarchical, lowrank_dtype=opts.lowrank_dtype,
                                 seed=opts.seed, head_dim=head_dim)
    return mod, {"rank": rank, "band": band, "lowrank_dtype": opts.lowrank_dtype}


def _approx_mask_example(program: Program, site: AttentionSite):
    """(the example value of the site's one additive mask or None, None), or (None, {"why": ...}) where the
    approximation cannot take the site's masks."""
    if not site.masks or site.causal:
        return None, None
    if any(m.kind != "additive" for m in site.masks):
        return None, {"why": "bool masks other than causal are not supported by the approximation"}
    if len(site.masks) > 1:
        return None, {"why": "several additive masks"}
    mask_ex = _example_node(program, site.masks[0].node)
    if mask_ex is None:
        return None, {"why": "example value of the mask unavailable"}
    return mask_ex, None


def _approx_error(site: AttentionSite, mod, examples, mask_ex, input_example) -> float:
    """The approximation's relative error against exact attention on the example q, k, v (and mask)."""
    query_example, key_example, value_example = examples
    if site.gqa_groups > 1:
        key_example = key_example.repeat_interleave(site.gqa_groups, dim=1)
        value_example = value_example.repeat_interleave(site.gqa_groups, dim=1)
    with torch.no_grad():
        exact = torch.nn.functional.scaled_dot_product_attention(
            query_example, key_example, value_example, attn_mask=mask_ex, is_causal=site.causal,
            scale=site.scale_value)
        inputs = (query_example, key_example, value_example, mask_ex)
        approx = mod(*inputs, input_example) if getattr(mod, "q_proj", None) is not None else mod(*inputs)
    return float((approx.double() - exact.double()).norm() / exact.double().norm().clamp_min(1e-30))


def _insert_approx(program: Program, site: AttentionSite, opts, mod, kind: str, mask_ex):
    """Register `mod` and call it in place of the site; the call node and what changed in the graph."""
    graph = program.graph
    name = unique_name(program.module, "attn_" + (site.module or "root").replace(".", "_") + f"_{kind}")
    program.module.add_submodule(name, mod)
    before = set(graph.nodes)
    with graph.inserting_before(site.output):
        query, key, value, _ = _inputs(graph, site, opts)
        if site.gqa_groups > 1:
            key = graph.call_function(aten.repeat_interleave.self_int, (key, site.gqa_groups, 1))
            value = graph.call_function(aten.repeat_interleave.self_int, (value, site.gqa_groups, 1))
        mask = site.masks[0].node if mask_ex is not None else None
        lowrank = getattr(mod, "q_proj", None) is not None
        out = graph.call_module(name, (query, key, value, mask)
                                + ((trace_projection(site.query).input_node,) if lowrank else ()))
        final = out if site.batch_dims != 1 else graph.call_function(aten.squeeze.dim, (out, 0))
    added = [node for node in graph.nodes if node not in before]
    for node in added:
        node.meta.setdefault("nn_module_stack", site.output.meta.get("nn_module_stack"))
    _copy_meta(final, site.output)
    removed = _replace(graph, site, final)
    return out, {"removed": removed, "added": [node.name for node in added if node is not out],
                 "is_causal": site.causal, "mask": "additive" if mask_ex is not None else
                 ("causal" if site.causal else "none")}


def _attr(program: Program, node: fx.Node) -> torch.Tensor:
    obj = program.module
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj.detach()


def _example(site: AttentionSite, which: str):
    """A real tensor with the example shape for q/k/v: computed by running the graph up to that node."""
    return site.__dict__.setdefault("_examples", {}).get(which)


def _example_node(program: Program, node: fx.Node):
    return getattr(program, "_attention_examples", {}).get(node.name)


def capture_examples(program: Program, sites: list[AttentionSite]) -> None:
    """Run the graph once on the example inputs (no grad) and keep q/k/v/mask values of each site."""
    want = {}
    for site in sites:
        if not site.ok:
            continue
        key = site.key if site.key is not None else site.key_transposed
        for which, node in (("q", site.query), ("k", key), ("v", site.value)):
            want.setdefault(node, []).append((site, which))
        for mask_term in site.masks:
            want.setdefault(mask_term.node, []).append((None, mask_term.node.name))
        proj = trace_projection(site.query) if site.query is not None else None
        if proj is not None:
            want.setdefault(proj.input_node, []).append((None, proj.input_node.name))
    got = {}

    class _Grab(fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node in want and isinstance(out, torch.Tensor):
                got[node] = out.detach().clone()
            return out

    module = program.module
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            flat = program.flat_inputs()
            _Grab(module).run(*flat, enable_io_processing=False)
    finally:
        module.train(was)
    program._attention_examples = {}
    for node, users in want.items():
        example = got.get(node)
        for site, which in users:
            if site is None:
                program._attention_examples[which] = example
                continue
            if example is not None and which == "k" and site.key is None:
                example = example.transpose(-2, -1)
            if example is not None and site.batch_dims == 1:
                example = example.unsqueeze(0)
            site.__dict__.setdefault("_examples", {})[which] = example
