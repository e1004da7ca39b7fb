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
            node.op == "call_function" and "fxmem_val" not in node.meta for node in program.graph.nodes):
        program.refresh()  # concrete example shapes for the checks
    graph = program.graph
    sites = []
    claimed: set = set()
    for node in list(graph.nodes):
        if not is_op(node, SOFTMAX):
            continue
        site = AttentionSite(module=module_path(node), softmax=node)
        try:
            _match(site)
        except _NoMatch:
            continue
        except Reject as rejection:
            site.reason = str(rejection)
        if site.ok and claimed.intersection(site.nodes):
            site.reason = "overlaps another attention site"
        claimed.update(site.nodes)
        sites.append(site)
    return sites


def _match(site: AttentionSite) -> None:
    softmax = site.softmax
    # ---- the value product below the softmax (decides whether this is attention at all)
    chain_down, out_node, p_node = _walk_down(site)
    site.output = out_node
    # ---- the score product above the softmax
    try:
        chain_up, scores = _walk_up(site)
    except _NoMatch as no_match:
        _declined_above(no_match.stop)
        raise
    site.scores = scores
    qk_operands(site, scores)
    v_operand(site, out_node, p_node)
    # ---- checks
    _check_softmax(site)
    nodes = set(chain_up) | {softmax} | set(chain_down) | {scores, out_node}
    site.nodes = _ordered(softmax.graph, nodes)
    for node in site.nodes:
        if node is out_node:
            continue
        for user in node.users:
            if user not in nodes and not is_op(user, ASSERTS):
                raise Reject(f"intermediate {node.name} ({op_name(node, OVERLOAD)}) is used outside the attention by "
                             f"{user.name} (e.g. returned attention weights)")
    # assert nodes hanging off the chain go too
    extra = [user for node in site.nodes for user in node.users if is_op(user, ASSERTS)]
    site.nodes = _ordered(softmax.graph, set(site.nodes) | set(extra))
    check_precision(site)
    check_shapes(site)
    finish_masks(site)
    site.scale_value = scale_value(site.scale)


def _ordered(graph, nodes) -> list:
    return [n for n in graph.nodes if n in nodes]


def _walk_down(site: AttentionSite):
    softmax = site.softmax
    chain = []
    cur = softmax
    dropout_seen = False
    while True:
        users = consumers(cur)
        if len(users) != 1:
            if not users:
                raise _NoMatch()
            # several users of the probabilities: attention only if one of them is a value product
            if any(is_op(user, MATMUL | EINSUM) for user in users):
                raise Reject(f"the attention probabilities ({cur.name}) are used outside the attention "
                             f"({', '.join(user.name for user in users)}), e.g. returned attention weights")
            raise _NoMatch()
        user = users[0]
        if is_op(user, MATMUL | EINSUM):
            if is_op(user, MATMUL) and user.args[0] is not cur:
                raise _NoMatch()
            return chain, user, cur
        if is_op(user, CASTS):
            _cast_step(site, cur, user, "probabilities")
            chain.append(user)
            cur = user
            continue
        if is_op(user, DROPOUT):
            if dropout_seen:
                raise Reject("two dropouts on the attention probabilities")
            dropout_seen = True
            dropout_p = user.args[1] if len(user.args) > 1 else user.kwargs.get("p", 0.5)
            train = user.args[2] if len(user.args) > 2 else user.kwargs.get("train", True)
            if not isinstance(dropout_p, (int, float)):
                raise Reject(f"dropout probability is not a constant ({dropout_p})")
            site.dropout_p = float(dropout_p)
            site.dropout_train = train
            chain.append(user)
            cur = user
            continue
        if _reaches_matmul(user):
            raise Reject(f"{op_name(user, OVERLOAD)} ({user.name}) between softmax and P @ V has no SDPA equivalent")
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


def _reached_from_product(node: fx.Node, depth: int = 4) -> bool:
    """A matmul / einsum / baddbmm is among the inputs of `node`, at most `depth` ops up."""
    if depth == 0 or not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    return any(is_op(x, MATMUL | EINSUM | {aten.baddbmm.default}) or _reached_from_product(x, depth - 1)
               for x in node.all_input_nodes)


def _reaches_matmul(node: fx.Node, depth: int = 3) -> bool:
    if depth == 0:
        return False
    for user in node.users:
        if is_op(user, MATMUL | EINSUM) or _reaches_matmul(user, depth - 1):
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
            left, right = cur.args[0], cur.args[1]
            alpha = cur.kwargs.get("alpha", 1)
            if alpha != 1:
                raise Reject(f"add with alpha={alpha} on the scores")
            scores, mask = _pick_score_operand(left, right)
            if scores is None:
                raise _NoMatch(cur)
            if not isinstance(mask, fx.Node):
                cur = scores  # adding a constant to every score does not change the softmax... but keep it exact:
                raise Reject("a scalar is added to the scores")
            if scale_seen:
                raise Reject("the scale is applied after an additive mask (the mask would be scaled)")
            _add_mask(site, mask, cur, "additive", "add")
            cur = scores
            continue
        if is_op(cur, {aten.masked_fill.Scalar, aten.masked_fill.Tensor}):
            scores, mask, fill = cur.args[0], cur.args[1], cur.args[2]
            if not is_neg_inf(fill):
                raise Reject(f"masked_fill with {float_const(fill)!r} instead of -inf is not a keep-mask "
                             "(a fully masked row would differ)")
            _add_mask(site, mask, cur, "drop", "masked_fill")
            cur = scores
            continue
        if is_op(cur, {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}):
            condition, left, right = cur.args[0], cur.args[1], cur.args[2]
            if is_neg_inf(right) and isinstance(left, fx.Node):
                _add_mask(site, condition, cur, "keep", "where")
                cur = left
            elif is_neg_inf(left) and isinstance(right, fx.Node):
                _add_mask(site, condition, cur, "drop", "where")
                cur = right
            else:
                raise Reject("where() on the scores with a value other than -inf")
            continue
        if is_op(cur, {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}):
            left, right = cur.args[0], cur.args[1]
            if cur.kwargs.get("rounding_mode") is not None:
                raise Reject("div with a rounding mode on the scores")
            op = "mul" if cur.target in (aten.mul.Tensor, aten.mul.Scalar) else "div"
            factor, scores = scale_operands(left, right, op)
            if factor is None:
                raise Reject(f"scores are multiplied by a tensor ({cur.name}), not a scalar")
            if isinstance(factor, float) and not factor > 0:
                raise Reject(f"scale {factor} is not positive")
            site.scale.append((op, factor))
            scale_seen = True
            cur = scores
            continue
        if is_op(cur, DROPOUT):
            raise Reject("dropout on the scores before the softmax (SDPA drops probabilities)")
        raise _NoMatch(cur)
    raise Reject("more than 32 ops between the softmax and the score product")


def _pick_score_operand(left, right):
    """Which operand of an add is the scores path (reaches a matmul within a few hops)?"""
    def reaches(node, depth=8):
        if not isinstance(node, fx.Node):
            return False
        if is_op(node, MATMUL | EINSUM | {aten.baddbmm.default}):
            return True
        if depth == 0 or node.op != "call_function":
            return False
        return any(reaches(x, depth - 1) for x in node.args if isinstance(x, fx.Node))
    left_reaches, right_reaches = reaches(left), reaches(right)
    if left_reaches and not right_reaches:
        return left, right
    if right_reaches and not left_reaches:
        return right, left
    if left_reaches and right_reaches:
        # both reach a product: the one with the score shape that is not a mask-like broadcast
        left_shape, right_shape = shape(left), shape(right)
        if left_shape is not None and right_shape is not None and left_shape != right_shape:
            return (left, right) if math.prod(left_shape) >= math.prod(right_shape) else (right, left)
        raise Reject("cannot tell the scores from the mask in an add of two products")
    return None, None


def _add_mask(site, mask, masked: fx.Node, kind: str, source: str) -> None:
    if not isinstance(mask, fx.Node):
        raise Reject(f"{source} mask is not a tensor")
    mask_dtype = dtype(mask)
    if kind in ("keep", "drop"):
        if mask_dtype != torch.bool:
            raise Reject(f"{source} condition has dtype {mask_dtype}, expected bool")
    else:
        if mask_dtype == torch.bool:
            raise Reject(f"a bool tensor is added to the scores ({mask.name})")
    # the mask must broadcast into the scores without enlarging them
    mask_shape, scores_shape = shape(mask), shape(masked)
    if mask_shape is None or scores_shape is None:
        raise Reject(f"unknown shape of the mask {mask.name}")
    if len(mask_shape) > len(scores_shape) \
            or any(x not in (1, y) for x, y in zip(mask_shape[::-1], scores_shape[::-1])):
        raise Reject(f"mask {mask.name} of shape {mask_shape} does not broadcast into the scores {scores_shape}")
    site.masks.append(MaskTerm(kind=kind, node=mask, source=source))
    site.masks[-1].at = masked  # type: ignore[attr-defined]


def _check_softmax(site: AttentionSite) -> None:
    softmax = site.softmax
    scores = softmax.args[0]
    scores_shape = shape(scores)
    if scores_shape is None:
        raise Reject("unknown shape of the scores")
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    if norm_dim(int(dim), len(scores_shape)) != len(scores_shape) - 1:
        raise Reject(f"softmax over dim {dim}, not the key dim (last)")
    wider = softmax_output_dtype(softmax)
    if wider is not None:
        record_change(site, softmax, dtype(scores), wider, "softmax")


def existing_sdpa(program) -> list[fx.Node]:
    """SDPA calls already in the graph (left alone by the pass)."""
    return [n for n in program.graph.nodes if is_op(n, SDPA)]


def glob_match(path: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)
