"""Find hand-written attention in a captured (aten-level) graph: `find_attention(program) -> [AttentionSite]`.

Anchored on every softmax, the matcher walks down to the value product P @ V and up through casts, masks and the
scale to the score product Q @ K^T (peeling K's transpose and repeat_kv for grouped-query attention). A softmax
between no such products is not a site; a site that cannot be rewritten *provably* exactly carries `reason`, and
the pass reports "not rewritten: <reason>".

The causal proof of a mask: `fxmem.attention_causal`; q, k and v and their checks: `fxmem.attention_operands`;
the dtypes along the site (a softmax computed in float32 on bf16/fp16 scores, cast back): `fxmem.attention_precision`.
Design: docs/design/attention.md, "The matcher".
"""
from __future__ import annotations

import fnmatch
import math

import torch
from torch import fx

from .attention_causal import finish_masks
from .attention_constants import float_const, is_neg_inf, scale_operands, scale_value
from .attention_nodes import (ASSERTS, CASTS, DROPOUT, EINSUM, MATMUL, SDPA, SOFTMAX, aten, consumers, device, dtype,
                              is_op, norm_dim, shape)
from .attention_operands import check_shapes, qk_operands, v_operand
from .attention_precision import check_precision, record_change, softmax_output_dtype
from .attention_site import AttentionSite, MaskTerm, Reject
from .ops import OVERLOAD, op_name
from .program import Program, module_path


class _NoMatch(Exception):
    """Not attention at all (leave silently); `stop` is the node where the walk gave up, if any."""

    def __init__(self, stop: fx.Node | None = None):
        super().__init__()
        self.stop = stop


def find_attention(program: Program | fx.GraphModule) -> list[AttentionSite]:
    """Every attention computation in the graph, rewritable (`site.ok`) or with the reason it is not."""
    if isinstance(program, Program) and any(
            n.op == "call_function" and "fxmem_val" not in n.meta for n in program.graph.nodes):
        program.refresh()  # concrete example shapes for the checks
    graph = program.graph
    sites = []
    claimed: set = set()
    for n in list(graph.nodes):
        if not is_op(n, SOFTMAX):
            continue
        site = AttentionSite(module=module_path(n), softmax=n)
        try:
            _match(site)
        except _NoMatch:
            continue
        except Reject as e:
            site.reason = str(e)
        if site.ok and claimed.intersection(site.nodes):
            site.reason = "overlaps another attention site"
        claimed.update(site.nodes)
        sites.append(site)
    return sites


def _match(site: AttentionSite) -> None:
    sm = site.softmax
    # ---- the value product below the softmax (decides whether this is attention at all)
    chain_down, out_node, p_node = _walk_down(site)
    site.output = out_node
    # ---- the score product above the softmax
    try:
        chain_up, scores = _walk_up(site)
    except _NoMatch as e:
        _declined_above(e.stop)
        raise
    site.scores = scores
    qk_operands(site, scores)
    v_operand(site, out_node, p_node)
    # ---- checks
    _check_softmax(site)
    nodes = set(chain_up) | {sm} | set(chain_down) | {scores, out_node}
    site.nodes = _ordered(sm.graph, nodes)
    for n in site.nodes:
        if n is out_node:
            continue
        for u in n.users:
            if u not in nodes and not is_op(u, ASSERTS):
                raise Reject(f"intermediate {n.name} ({op_name(n, OVERLOAD)}) is used outside the attention by "
                             f"{u.name} (e.g. returned attention weights)")
    # assert nodes hanging off the chain go too
    extra = [u for n in site.nodes for u in n.users if is_op(u, ASSERTS)]
    site.nodes = _ordered(sm.graph, set(site.nodes) | set(extra))
    check_precision(site)
    check_shapes(site)
    finish_masks(site)
    site.scale_value = scale_value(site.scale)


def _ordered(graph, nodes) -> list:
    return [n for n in graph.nodes if n in nodes]


def _walk_down(site: AttentionSite):
    sm = site.softmax
    chain = []
    cur = sm
    dropout_seen = False
    while True:
        us = consumers(cur)
        if len(us) != 1:
            if not us:
                raise _NoMatch()
            # several users of the probabilities: attention only if one of them is a value product
            if any(is_op(u, MATMUL | EINSUM) for u in us):
                raise Reject(f"the attention probabilities ({cur.name}) are used outside the attention "
                             f"({', '.join(u.name for u in us)}), e.g. returned attention weights")
            raise _NoMatch()
        u = us[0]
        if is_op(u, MATMUL | EINSUM):
            if is_op(u, MATMUL) and u.args[0] is not cur:
                raise _NoMatch()
            return chain, u, cur
        if is_op(u, CASTS):
            _cast_step(site, cur, u, "probabilities")
            chain.append(u)
            cur = u
            continue
        if is_op(u, DROPOUT):
            if dropout_seen:
                raise Reject("two dropouts on the attention probabilities")
            dropout_seen = True
            p = u.args[1] if len(u.args) > 1 else u.kwargs.get("p", 0.5)
            train = u.args[2] if len(u.args) > 2 else u.kwargs.get("train", True)
            if not isinstance(p, (int, float)):
                raise Reject(f"dropout probability is not a constant ({p})")
            site.dropout_p = float(p)
            site.dropout_train = train
            chain.append(u)
            cur = u
            continue
        if _reaches_matmul(u):
            raise Reject(f"{op_name(u, OVERLOAD)} ({u.name}) between softmax and P @ V has no SDPA equivalent")
        raise _NoMatch()


def _cast_step(site: AttentionSite, source: fx.Node, cast: fx.Node, where: str) -> None:
    """A cast on the attention's path: a device move is no attention SDPA can take; a dtype change is judged with the
    others once the site is known (`fxmem.attention_precision`)."""
    if device(cast) != device(source):
        raise Reject(f"the {where} move from {device(source)} to {device(cast)} ({cast.name})")
    if dtype(cast) != dtype(source):
        record_change(site, cast, dtype(source), dtype(cast), where)


def _declined_above(stop: fx.Node | None) -> None:
    """The walk up from a softmax whose probabilities feed a value product stopped at `stop`: when a product lies
    above `stop` (Q @ K^T within a few ops), this is attention the rewrite cannot take, and it says where."""
    if stop is None or not _reached_from_product(stop):
        return
    raise Reject(f"{op_name(stop, OVERLOAD)} ({stop.name}) between Q @ K^T and the softmax has no SDPA equivalent")


def _reached_from_product(n: fx.Node, depth: int = 4) -> bool:
    """A matmul / einsum / baddbmm is among the inputs of `n`, at most `depth` ops up."""
    if depth == 0 or not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    return any(is_op(x, MATMUL | EINSUM | {aten.baddbmm.default}) or _reached_from_product(x, depth - 1)
               for x in n.all_input_nodes)


def _reaches_matmul(n: fx.Node, depth: int = 3) -> bool:
    if depth == 0:
        return False
    for u in n.users:
        if is_op(u, MATMUL | EINSUM) or _reaches_matmul(u, depth - 1):
            return True
    return False


def _walk_up(site: AttentionSite):
    """From the softmax input up to Q @ K^T: masks, scale. Returns (chain nodes, the QK node)."""
    chain = []
    cur = site.softmax.args[0]
    scale_seen = False  # a scale already peeled (closer to the softmax): a mask above it would be scaled
    for _ in range(32):
        if not isinstance(cur, fx.Node):
            raise _NoMatch()
        if is_op(cur, MATMUL | EINSUM):
            return chain, cur
        if is_op(cur, {aten.baddbmm.default}):
            beta = cur.kwargs.get("beta", 1)
            alpha = cur.kwargs.get("alpha", 1)
            if beta != 1:
                raise Reject(f"baddbmm with beta={beta}")
            if alpha != 1:
                site.scale.append(("mul", float(alpha)))
            _add_mask(site, cur.args[0], cur, "additive", "baddbmm bias")
            chain.append(cur)
            return chain, cur
        chain.append(cur)
        if is_op(cur, CASTS):
            _cast_step(site, cur.args[0], cur, "scores")
            cur = cur.args[0]
            continue
        if is_op(cur, {aten.add.Tensor}):
            a, b = cur.args[0], cur.args[1]
            alpha = cur.kwargs.get("alpha", 1)
            if alpha != 1:
                raise Reject(f"add with alpha={alpha} on the scores")
            s, m = _pick_score_operand(a, b)
            if s is None:
                raise _NoMatch(cur)
            if not isinstance(m, fx.Node):
                cur = s  # adding a constant to every score does not change the softmax... but keep it exact:
                raise Reject("a scalar is added to the scores")
            if scale_seen:
                raise Reject("the scale is applied after an additive mask (the mask would be scaled)")
            _add_mask(site, m, cur, "additive", "add")
            cur = s
            continue
        if is_op(cur, {aten.masked_fill.Scalar, aten.masked_fill.Tensor}):
            s, m, fill = cur.args[0], cur.args[1], cur.args[2]
            if not is_neg_inf(fill):
                raise Reject(f"masked_fill with {float_const(fill)!r} instead of -inf is not a keep-mask "
                             "(a fully masked row would differ)")
            _add_mask(site, m, cur, "drop", "masked_fill")
            cur = s
            continue
        if is_op(cur, {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}):
            c, a, b = cur.args[0], cur.args[1], cur.args[2]
            if is_neg_inf(b) and isinstance(a, fx.Node):
                _add_mask(site, c, cur, "keep", "where")
                cur = a
            elif is_neg_inf(a) and isinstance(b, fx.Node):
                _add_mask(site, c, cur, "drop", "where")
                cur = b
            else:
                raise Reject("where() on the scores with a value other than -inf")
            continue
        if is_op(cur, {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}):
            a, b = cur.args[0], cur.args[1]
            if cur.kwargs.get("rounding_mode") is not None:
                raise Reject("div with a rounding mode on the scores")
            op = "mul" if cur.target in (aten.mul.Tensor, aten.mul.Scalar) else "div"
            f, s = scale_operands(a, b, op)
            if f is None:
                raise Reject(f"scores are multiplied by a tensor ({cur.name}), not a scalar")
            if isinstance(f, float) and not f > 0:
                raise Reject(f"scale {f} is not positive")
            site.scale.append((op, f))
            scale_seen = True
            cur = s
            continue
        if is_op(cur, DROPOUT):
            raise Reject("dropout on the scores before the softmax (SDPA drops probabilities)")
        raise _NoMatch(cur)
    raise Reject("more than 32 ops between the softmax and the score product")


def _pick_score_operand(a, b):
    """Which operand of an add is the scores path (reaches a matmul within a few hops)?"""
    def reaches(n, depth=8):
        if not isinstance(n, fx.Node):
            return False
        if is_op(n, MATMUL | EINSUM | {aten.baddbmm.default}):
            return True
        if depth == 0 or n.op != "call_function":
            return False
        return any(reaches(x, depth - 1) for x in n.args if isinstance(x, fx.Node))
    ra, rb = reaches(a), reaches(b)
    if ra and not rb:
        return a, b
    if rb and not ra:
        return b, a
    if ra and rb:
        # both reach a product: the one with the score shape that is not a mask-like broadcast
        sa, sb = shape(a), shape(b)
        if sa is not None and sb is not None and sa != sb:
            return (a, b) if math.prod(sa) >= math.prod(sb) else (b, a)
        raise Reject("cannot tell the scores from the mask in an add of two products")
    return None, None


def _add_mask(site, m, at: fx.Node, kind: str, source: str) -> None:
    if not isinstance(m, fx.Node):
        raise Reject(f"{source} mask is not a tensor")
    md = dtype(m)
    if kind in ("keep", "drop"):
        if md != torch.bool:
            raise Reject(f"{source} condition has dtype {md}, expected bool")
    else:
        if md == torch.bool:
            raise Reject(f"a bool tensor is added to the scores ({m.name})")
    # the mask must broadcast into the scores without enlarging them
    ms, os_ = shape(m), shape(at)
    if ms is None or os_ is None:
        raise Reject(f"unknown shape of the mask {m.name}")
    if len(ms) > len(os_) or any(x not in (1, y) for x, y in zip(ms[::-1], os_[::-1])):
        raise Reject(f"mask {m.name} of shape {ms} does not broadcast into the scores {os_}")
    site.masks.append(MaskTerm(kind=kind, node=m, source=source))
    site.masks[-1].at = at  # type: ignore[attr-defined]


def _check_softmax(site: AttentionSite) -> None:
    sm = site.softmax
    x = sm.args[0]
    s = shape(x)
    if s is None:
        raise Reject("unknown shape of the scores")
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    if norm_dim(int(dim), len(s)) != len(s) - 1:
        raise Reject(f"softmax over dim {dim}, not the key dim (last)")
    wider = softmax_output_dtype(sm)
    if wider is not None:
        record_change(site, sm, dtype(x), wider, "softmax")


def existing_sdpa(program) -> list[fx.Node]:
    """SDPA calls already in the graph (left alone by the pass)."""
    return [n for n in program.graph.nodes if is_op(n, SDPA)]


def glob_match(path: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)
