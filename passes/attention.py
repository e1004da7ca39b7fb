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
    done = sum(c.kind == f"attention.{opts.rewrite}" for c in result.changes)
    stopped_by, change = guard_stop(outcome.asked)
    if asked < sites and not stopped_by:
        stopped_by = f"{sites - asked} site(s) cannot take {opts.rewrite} (the report's notes say why)"
        change = "nothing to change for those sites"
    for c in result.changes:
        if c.kind == "attention.sdpa" and c.module in {x.module for x in first.changes
                                                        if x.kind == f"attention.{opts.rewrite}"}:
            c.reason += f"; {opts.rewrite} backed off here by the guard (this site's own error is among the largest)"
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
        saved_before = sum(before.get(n, 0) for n in info["removed"])
        saved_after = after.get(new.name, 0) + sum(after.get(n, 0) for n in info.get("added", []))
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
        for n in site.notes:
            notes.append(f"{site.module}: {n}")
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
    g = program.graph
    if any(n.op == "call_function" and "fxmem_val" not in n.meta for n in g.nodes):
        program.refresh()
    else:
        g.eliminate_dead_code(is_impure_node=is_impure)


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
    q, v = site.q, site.v
    k = site.k
    if k is None:
        k = graph.call_function(aten.transpose.int, (site.k_transposed, -2, -1))
    enable_gqa = site.gqa_groups > 1
    if enable_gqa and not opts.gqa:
        k, v, enable_gqa = site.k_expanded, site.v_expanded, False
    if site.batch_dims == 1:
        q, k, v = (graph.call_function(aten.unsqueeze.default, (x, 0)) for x in (q, k, v))
    return q, k, v, enable_gqa


def _mask(graph: fx.Graph, site: AttentionSite) -> tuple[fx.Node | None, str]:
    """The attn_mask for SDPA: None (no mask / is_causal), a bool keep-mask, or an additive float mask."""
    if not site.masks or site.causal:
        return None, "causal" if site.causal else "none"
    keep = None
    add = None
    for m in site.masks:
        if m.kind == "additive":
            add = m.node if add is None else graph.call_function(aten.add.Tensor, (add, m.node))
            continue
        k = m.node if m.kind == "keep" else graph.call_function(aten.logical_not.default, (m.node,))
        keep = k if keep is None else graph.call_function(aten.logical_and.default, (keep, k))
    if keep is not None and add is not None:
        return graph.call_function(aten.where.ScalarOther, (keep, add, float("-inf"))), "additive+bool"
    if keep is not None:
        return keep, "bool keep-mask"
    return add, "additive"


def _emit_sdpa(program: Program, site: AttentionSite, opts) -> tuple[fx.Node, dict]:
    g = program.graph
    before = set(g.nodes)
    with g.inserting_before(site.output):
        q, k, v, enable_gqa = _inputs(g, site, opts)
        mask, mask_kind = _mask(g, site)
        scale = emit_scale(g, site.scale)
        train = site.dropout_train
        if site.dropout_p > 0 and isinstance(train, fx.Node):
            out = g.call_function(sdpa_dropout, (q, k, v, mask, site.dropout_p, train, site.causal, scale,
                                                 enable_gqa))
        else:
            p = site.dropout_p if (site.dropout_p > 0 and train is True) else 0.0
            out = g.call_function(aten.scaled_dot_product_attention.default, (q, k, v),
                                  {"attn_mask": mask, "dropout_p": p, "is_causal": site.causal, "scale": scale,
                                   "enable_gqa": enable_gqa})
        call = SdpaCall(q, k, v, mask, scale, site.gqa_groups if enable_gqa else 1)
        final = _with_fully_masked_rows(g, site, call, out) if mask_kind == "additive" else out
        corrected = final is not out
        if site.batch_dims == 1:
            final = g.call_function(aten.squeeze.dim, (final, 0))
    added = [n for n in g.nodes if n not in before]
    for n in added:
        _copy_meta(n, site.output) if n is final else n.meta.setdefault(
            "nn_module_stack", site.output.meta.get("nn_module_stack"))
    removed = _replace(g, site, final)
    return out, {"removed": removed, "added": [n.name for n in added if n is not out], "is_causal": site.causal,
                 "mask": mask_kind, "enable_gqa": enable_gqa, "fully_masked_rows": "eager" if corrected else None}


def _with_fully_masked_rows(g: fx.Graph, site: AttentionSite, call: SdpaCall, out: fx.Node) -> fx.Node:
    """`out` whose rows the additive mask masks fully get eager attention's value and gradient
    (`fxmem.attention_rows`); `out` itself where the mask is not a float tensor."""
    mask_val = node_value(site.masks[0].node)
    if not isinstance(mask_val, torch.Tensor) or not mask_val.is_floating_point():
        return out
    return emit_fully_masked_rows(g, call, out, mask_val.dtype, len(node_value(site.q).shape) + (site.batch_dims == 1))


def _replace(g: fx.Graph, site: AttentionSite, final: fx.Node) -> list[str]:
    site.output.replace_all_uses_with(final)
    removed = []
    for n in reversed(site.nodes):
        if not n.users:
            removed.append(n.name)
            g.erase_node(n)
    return removed[::-1]


# ============================================================================================ approximations

def _emit_approx(program: Program, site: AttentionSite, opts, kind: str):
    """Swap in HybridAttention / SemiseparableAttention where the site allows it; its own relative error on the
    example inputs (against exact attention) goes into the Change (it orders the guard's back-off)."""
    if site.masks and not site.causal and any(m.kind != "additive" for m in site.masks) \
            and any(m.kind == "additive" for m in site.masks):
        return None, {"why": "mixed bool and additive masks"}
    qv, kv, vv = (_example(site, x) for x in ("q", "k", "v"))
    if qv is None:
        return None, {"why": "example values of q/k/v unavailable"}
    if kind == "hab":
        mod, params, xv = _hybrid_module(program, site, opts, kv.shape[-2])
        if mod is None:
            return None, params
    else:
        (mod, params), xv = _semiseparable_module(site, opts, kv.shape[-2], qv.shape[-1]), None
    if site.scale_value is None or any(not isinstance(f, float) for _, f in site.scale):
        return None, {"why": "shape-dependent scale"}
    mask_ex, why = _approx_mask_example(program, site)
    if why is not None:
        return None, why
    params["rel_error"] = _approx_error(site, mod, (qv, kv, vv), mask_ex, xv)
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
    pq, pk = trace_projection(site.q), trace_projection(site.k) if site.k is not None else None
    if pq is None or pk is None or pq.x is not pk.x or pq.heads != pk.heads or site.gqa_groups > 1:
        return None, {"why": "rank_ratio: q and k are not heads of linear layers on one input"}, None
    xv = _example_node(program, pq.x)
    if xv is None or site.batch_dims != 2:
        return None, {"why": "rank_ratio: example value of the projection input unavailable"}, None
    w = _attr(program, pq.weight)
    wk_ = _attr(program, pk.weight)
    n = pq.heads * pq.head_dim
    bq = _attr(program, pq.bias)[pq.offset:pq.offset + n] if pq.bias is not None else None
    bk = _attr(program, pk.bias)[pk.offset:pk.offset + n] if pk.bias is not None else None
    rank = mod.set_low_rank(w[pq.offset:pq.offset + n], bq, wk_[pk.offset:pk.offset + n], bk, pq.heads,
                            opts.rank_ratio)
    params.update({"rank": rank, "rank_ratio": opts.rank_ratio})
    return mod, params, xv


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


def _approx_error(site: AttentionSite, mod, examples, mask_ex, xv) -> float:
    """The approximation's relative error against exact attention on the example q, k, v (and mask)."""
    qv, kv, vv = examples
    if site.gqa_groups > 1:
        kv = kv.repeat_interleave(site.gqa_groups, dim=1)
        vv = vv.repeat_interleave(site.gqa_groups, dim=1)
    with torch.no_grad():
        exact = torch.nn.functional.scaled_dot_product_attention(
            qv, kv, vv, attn_mask=mask_ex, is_causal=site.causal, scale=site.scale_value)
        approx = mod(qv, kv, vv, mask_ex, xv) if getattr(mod, "q_proj", None) is not None else \
            mod(qv, kv, vv, mask_ex)
    return float((approx.double() - exact.double()).norm() / exact.double().norm().clamp_min(1e-30))


def _insert_approx(program: Program, site: AttentionSite, opts, mod, kind: str, mask_ex):
    """Register `mod` and call it in place of the site; the call node and what changed in the graph."""
    g = program.graph
    name = _free_name(program.module, "attn_" + (site.module or "root").replace(".", "_") + f"_{kind}")
    program.module.add_submodule(name, mod)
    before = set(g.nodes)
    with g.inserting_before(site.output):
        q, k, v, _ = _inputs(g, site, opts)
        if site.gqa_groups > 1:
            k = g.call_function(aten.repeat_interleave.self_int, (k, site.gqa_groups, 1))
            v = g.call_function(aten.repeat_interleave.self_int, (v, site.gqa_groups, 1))
        mask = site.masks[0].node if mask_ex is not None else None
        lowrank = getattr(mod, "q_proj", None) is not None
        out = g.call_module(name, (q, k, v, mask) + ((trace_projection(site.q).x,) if lowrank else ()))
        final = out if site.batch_dims != 1 else g.call_function(aten.squeeze.dim, (out, 0))
    added = [n for n in g.nodes if n not in before]
    for n in added:
        n.meta.setdefault("nn_module_stack", site.output.meta.get("nn_module_stack"))
    _copy_meta(final, site.output)
    removed = _replace(g, site, final)
    return out, {"removed": removed, "added": [n.name for n in added if n is not out],
                 "is_causal": site.causal, "mask": "additive" if mask_ex is not None else
                 ("causal" if site.causal else "none")}


def _attr(program: Program, node: fx.Node) -> torch.Tensor:
    obj = program.module
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj.detach()


def _free_name(gm, base: str) -> str:
    name, i = base, 1
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _example(site: AttentionSite, which: str):
    """A real tensor with the example shape for q/k/v: computed by running the graph up to that node."""
    return site.__dict__.setdefault("_examples", {}).get(which)


def _example_node(program: Program, node: fx.Node):
    return getattr(program, "_attention_examples", {}).get(node.name)


def capture_examples(program: Program, sites: list[AttentionSite]) -> None:
    """Run the graph once on the example inputs (no grad) and keep q/k/v/mask values of each site."""
    want = {}
    for s in sites:
        if not s.ok:
            continue
        k = s.k if s.k is not None else s.k_transposed
        for which, n in (("q", s.q), ("k", k), ("v", s.v)):
            want.setdefault(n, []).append((s, which))
        for m in s.masks:
            want.setdefault(m.node, []).append((None, m.node.name))
        proj = trace_projection(s.q) if s.q is not None else None
        if proj is not None:
            want.setdefault(proj.x, []).append((None, proj.x.name))
    got = {}

    class _Grab(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n in want and isinstance(out, torch.Tensor):
                got[n] = out.detach().clone()
            return out

    gm = program.module
    was = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            flat = program.flat_inputs()
            _Grab(gm).run(*flat, enable_io_processing=False)
    finally:
        gm.train(was)
    program._attention_examples = {}
    for n, users in want.items():
        t = got.get(n)
        for s, which in users:
            if s is None:
                program._attention_examples[which] = t
                continue
            if t is not None and which == "k" and s.k is None:
                t = t.transpose(-2, -1)
            if t is not None and s.batch_dims == 1:
                t = t.unsqueeze(0)
            s.__dict__.setdefault("_examples", {})[which] = t
