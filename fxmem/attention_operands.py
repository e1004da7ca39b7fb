"""q, k and v of an attention site, read from its two products (Q @ K^T and P @ V as matmul, bmm, baddbmm or
einsum): K's transpose and scale factors on q or k peeled, Llama's repeat_kv recognised as grouped-query
attention, and the shapes and dtypes checked against what SDPA takes."""
from __future__ import annotations

import torch
from torch import fx

from .attention_constants import scale_operands
from .attention_nodes import EINSUM, aten, consumers, dtype, is_op, norm_dim, same_shape, shape, sym_shape
from .attention_site import AttentionSite, Reject
from .node_value import node_value


def _identity_slice(node: fx.Node) -> bool:
    if not is_op(node, {aten.slice.Tensor}):
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    start, step = args[2], args[4] if args[4] is not None else 1
    return start in (None, 0) and step == 1 and same_shape(node, node.args[0])


def _peel_transpose(key_t: fx.Node) -> fx.Node | None:
    """K from K^T when K^T is a transpose of the last two dims (transpose / permute / mT)."""
    key_shape = shape(key_t)
    if key_shape is None:
        return None
    ndim = len(key_shape)
    if is_op(key_t, {aten.transpose.int}):
        dims = {norm_dim(key_t.args[1], ndim), norm_dim(key_t.args[2], ndim)}
        if dims == {ndim - 2, ndim - 1}:
            return key_t.args[0]
    if is_op(key_t, {aten.permute.default}):
        perm = [norm_dim(p, ndim) for p in key_t.args[1]]
        if perm == list(range(ndim - 2)) + [ndim - 1, ndim - 2]:
            return key_t.args[0]
    if is_op(key_t, {aten.t.default, aten.numpy_T.default}) and ndim == 2:
        return key_t.args[0]
    return None


def _peel_scale(site, node: fx.Node) -> fx.Node:
    """Scale factors applied to q or k (x * c, x / c) become part of the SDPA scale."""
    while is_op(node, {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}) \
            and node.kwargs.get("rounding_mode") is None:
        op = "mul" if node.target in (aten.mul.Tensor, aten.mul.Scalar) else "div"
        factor, scaled = scale_operands(node.args[0], node.args[1], op)
        if factor is None or len(consumers(node)) != 1:
            break
        if isinstance(factor, float) and not factor > 0:
            raise Reject(f"scale {factor} on q/k is not positive")
        site.scale.append((op, factor))
        site._peeled.append(node)  # type: ignore[attr-defined]
        node = scaled
    return node


def _parse_einsum(equation: str):
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    lhs, out = equation.split("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    return ops[0], ops[1], out


def qk_operands(site: AttentionSite, scores: fx.Node) -> None:
    """Set `site.query` and `site.key` (or `site.key_transposed`) from the score product, peeling scales and
    transposes."""
    site._peeled = []  # type: ignore[attr-defined]
    if is_op(scores, {aten.baddbmm.default}):
        query, key_t = scores.args[1], scores.args[2]
    elif is_op(scores, EINSUM):
        parsed = _parse_einsum(scores.args[0])
        if parsed is None or len(scores.args[1]) != 2:
            raise Reject(f"einsum {scores.args[0]!r} is not a plain two-operand product")
        query_subs, key_subs, out_subs = parsed
        query, key_operand = scores.args[1]
        # q: P i c ; k: P j c (or P c j) ; out: P i j
        if not (len(query_subs) == len(key_subs) == len(out_subs) >= 3) \
                or query_subs[:-2] != key_subs[:-2] or query_subs[:-2] != out_subs[:-2]:
            raise Reject(f"einsum {scores.args[0]!r}: batch dims of q, k and scores differ")
        row_label, feature_label = query_subs[-2], query_subs[-1]
        if key_subs[-2:] == out_subs[-1] + feature_label and out_subs[-2:] == row_label + out_subs[-1]:
            site.key = _peel_scale(site, key_operand)
            site.query = _peel_scale(site, query)
            return
        if key_subs[-2:] == feature_label + out_subs[-1] and out_subs[-2:] == row_label + out_subs[-1]:
            query, key_t = query, key_operand
        else:
            raise Reject(f"einsum {scores.args[0]!r} is not q k^T")
    else:
        query, key_t = scores.args[0], scores.args[1]
    key_t = _peel_scale(site, key_t)
    key = _peel_transpose(key_t)
    if key is None:
        site.key_transposed = key_t
    else:
        site.key = _peel_scale(site, key)
    site.query = _peel_scale(site, query)


def v_operand(site: AttentionSite, out: fx.Node, probs: fx.Node) -> None:
    """Set `site.value` from the value product `out` of the probabilities `probs`."""
    if is_op(out, EINSUM):
        parsed = _parse_einsum(out.args[0])
        if parsed is None or len(out.args[1]) != 2 or out.args[1][0] is not probs:
            raise Reject(f"einsum {out.args[0]!r} is not P @ V")
        probs_subs, value_subs, out_subs = parsed
        if not (len(probs_subs) == len(value_subs) == len(out_subs) >= 3) \
                or probs_subs[:-2] != value_subs[:-2] or probs_subs[:-2] != out_subs[:-2] \
                or not (value_subs[-2] == probs_subs[-1] and out_subs[-2] == probs_subs[-2]
                        and out_subs[-1] == value_subs[-1]):
            raise Reject(f"einsum {out.args[0]!r} is not P @ V")
        site.value = out.args[1][1]
    else:
        site.value = out.args[1]


def check_shapes(site: AttentionSite) -> None:
    """q, k and v are tensors of one SDPA dtype with shapes SDPA takes (grouped-query attention recognised); sets
    `site.batch_dims`."""
    query, value = site.query, site.value
    key = site.key if site.key is not None else site.key_transposed
    for name, operand in (("q", query), ("k", key), ("v", value)):
        if not isinstance(operand, fx.Node) or node_value(operand, tensor_only=True) is None:
            raise Reject(f"{name} is not a tensor")
    dts = {dtype(query), dtype(key), dtype(value), dtype(site.scores), dtype(site.output)}
    if len(dts) != 1:
        raise Reject(f"q, k, v, scores and output have different dtypes {sorted(map(str, dts))}")
    if next(iter(dts)) not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise Reject(f"dtype {next(iter(dts))} is not supported by SDPA")
    query_shape, key_shape, value_shape = sym_shape(query), sym_shape(key), sym_shape(value)
    if not (len(query_shape) == len(key_shape) == len(value_shape)) or len(query_shape) < 3:
        raise Reject(f"q, k, v ranks {len(query_shape)}, {len(key_shape)}, {len(value_shape)}: need equal ranks >= 3 "
                     f"(batch dims)")
    if site.key is None:  # K^T layout (..., E, Lk)
        key_shape = key_shape[:-2] + (key_shape[-1], key_shape[-2])
    if query_shape[:-2] != key_shape[:-2] or query_shape[:-2] != value_shape[:-2]:
        # GQA is the only batch mismatch we accept, handled below
        _gqa(site)
        key_shape_after_gqa = sym_shape(site.key if site.key is not None else site.key_transposed)
        if site.key is None:
            key_shape_after_gqa = key_shape_after_gqa[:-2] + (key_shape_after_gqa[-1], key_shape_after_gqa[-2])
        if query_shape[:-2] != key_shape_after_gqa[:-2] or query_shape[:-2] != sym_shape(site.value)[:-2]:
            raise Reject(f"batch dims of q {query_shape[:-2]}, k {key_shape[:-2]}, v {value_shape[:-2]} differ "
                         "(broadcasting in matmul is not SDPA's)")
    else:
        _gqa(site)
    if query_shape[-1] != key_shape[-1]:
        raise Reject(f"q and k head dims differ ({query_shape[-1]} vs {key_shape[-1]})")
    if key_shape[-2] != value_shape[-2]:
        raise Reject(f"k and v sequence lengths differ ({key_shape[-2]} vs {value_shape[-2]})")
    site.batch_dims = len(query_shape) - 2
    if site.batch_dims == 1:
        site.notes.append("3-D (bmm) attention: emitted as 4-D SDPA (unsqueeze/squeeze) so fused kernels run")
    if site.batch_dims > 2:
        raise Reject(f"{len(query_shape)}-D attention (SDPA kernels take (B, H, L, E))")


def _peel_repeat_kv(node: fx.Node):
    """Llama's repeat_kv: reshape(expand(unsqueeze(x, 2)[, identity slices])) -> (x, groups) or None."""
    if not is_op(node, {aten.reshape.default, aten.view.default, aten._unsafe_view.default}):
        return None
    expanded = node.args[0]
    while _identity_slice(expanded):
        expanded = expanded.args[0]
    if not is_op(expanded, {aten.expand.default}):
        return None
    unsqueezed = expanded.args[0]
    while _identity_slice(unsqueezed):
        unsqueezed = unsqueezed.args[0]
    if not is_op(unsqueezed, {aten.unsqueeze.default}):
        return None
    base = unsqueezed.args[0]
    while _identity_slice(base):
        base = base.args[0]
    base_shape, expanded_shape, out_shape = shape(base), shape(expanded), shape(node)
    if base_shape is None or expanded_shape is None or out_shape is None or len(base_shape) != 4 \
            or len(expanded_shape) != 5:
        return None
    if norm_dim(unsqueezed.args[1], 5) != 2:
        return None
    batch, heads, length, head_dim = base_shape
    groups = expanded_shape[2]
    if expanded_shape[0] != batch or expanded_shape[1] != heads or expanded_shape[3] != length \
            or expanded_shape[4] != head_dim or out_shape != (batch, heads * groups, length, head_dim):
        return None
    return base, expanded_shape[2]


def _gqa(site: AttentionSite) -> None:
    if site.key is None:
        return
    key_repeat, value_repeat = _peel_repeat_kv(site.key), _peel_repeat_kv(site.value)
    if key_repeat and value_repeat and key_repeat[1] == value_repeat[1] and key_repeat[1] > 1:
        site.key_expanded, site.value_expanded = site.key, site.value
        site.key, site.value = key_repeat[0], value_repeat[0]
        site.gqa_groups = key_repeat[1]
