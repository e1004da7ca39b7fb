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


def _identity_slice(n: fx.Node) -> bool:
    if not is_op(n, {aten.slice.Tensor}):
        return False
    a = list(n.args) + [None] * (5 - len(n.args))
    start, step = a[2], a[4] if a[4] is not None else 1
    return start in (None, 0) and step == 1 and same_shape(n, n.args[0])


def _peel_transpose(kt: fx.Node) -> fx.Node | None:
    """K from K^T when K^T is a transpose of the last two dims (transpose / permute / mT)."""
    s = shape(kt)
    if s is None:
        return None
    nd = len(s)
    if is_op(kt, {aten.transpose.int}):
        d = {norm_dim(kt.args[1], nd), norm_dim(kt.args[2], nd)}
        if d == {nd - 2, nd - 1}:
            return kt.args[0]
    if is_op(kt, {aten.permute.default}):
        perm = [norm_dim(p, nd) for p in kt.args[1]]
        if perm == list(range(nd - 2)) + [nd - 1, nd - 2]:
            return kt.args[0]
    if is_op(kt, {aten.t.default, aten.numpy_T.default}) and nd == 2:
        return kt.args[0]
    return None


def _peel_scale(site, x: fx.Node) -> fx.Node:
    """Scale factors applied to q or k (x * c, x / c) become part of the SDPA scale."""
    while is_op(x, {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}) \
            and x.kwargs.get("rounding_mode") is None:
        op = "mul" if x.target in (aten.mul.Tensor, aten.mul.Scalar) else "div"
        f, s = scale_operands(x.args[0], x.args[1], op)
        if f is None or len(consumers(x)) != 1:
            break
        if isinstance(f, float) and not f > 0:
            raise Reject(f"scale {f} on q/k is not positive")
        site.scale.append((op, f))
        site._peeled.append(x)  # type: ignore[attr-defined]
        x = s
    return x


def _parse_einsum(eq: str):
    eq = eq.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    return ops[0], ops[1], out


def qk_operands(site: AttentionSite, scores: fx.Node) -> None:
    """Set `site.q` and `site.k` (or `site.k_transposed`) from the score product, peeling scales and transposes."""
    site._peeled = []  # type: ignore[attr-defined]
    if is_op(scores, {aten.baddbmm.default}):
        q, kt = scores.args[1], scores.args[2]
    elif is_op(scores, EINSUM):
        p = _parse_einsum(scores.args[0])
        if p is None or len(scores.args[1]) != 2:
            raise Reject(f"einsum {scores.args[0]!r} is not a plain two-operand product")
        a, b, o = p
        q, kk = scores.args[1]
        # q: P i c ; k: P j c (or P c j) ; out: P i j
        if not (len(a) == len(b) == len(o) >= 3) or a[:-2] != b[:-2] or a[:-2] != o[:-2]:
            raise Reject(f"einsum {scores.args[0]!r}: batch dims of q, k and scores differ")
        i, c = a[-2], a[-1]
        if b[-2:] == o[-1] + c and o[-2:] == i + o[-1]:
            site.k = _peel_scale(site, kk)
            site.q = _peel_scale(site, q)
            return
        if b[-2:] == c + o[-1] and o[-2:] == i + o[-1]:
            q, kt = q, kk
        else:
            raise Reject(f"einsum {scores.args[0]!r} is not q k^T")
    else:
        q, kt = scores.args[0], scores.args[1]
    kt = _peel_scale(site, kt)
    k = _peel_transpose(kt)
    if k is None:
        site.k_transposed = kt
    else:
        site.k = _peel_scale(site, k)
    site.q = _peel_scale(site, q)


def v_operand(site: AttentionSite, out: fx.Node, p: fx.Node) -> None:
    """Set `site.v` from the value product `out` of the probabilities `p`."""
    if is_op(out, EINSUM):
        pe = _parse_einsum(out.args[0])
        if pe is None or len(out.args[1]) != 2 or out.args[1][0] is not p:
            raise Reject(f"einsum {out.args[0]!r} is not P @ V")
        a, b, o = pe
        if not (len(a) == len(b) == len(o) >= 3) or a[:-2] != b[:-2] or a[:-2] != o[:-2] \
                or not (b[-2] == a[-1] and o[-2] == a[-2] and o[-1] == b[-1]):
            raise Reject(f"einsum {out.args[0]!r} is not P @ V")
        site.v = out.args[1][1]
    else:
        site.v = out.args[1]


def check_shapes(site: AttentionSite) -> None:
    """q, k and v are tensors of one SDPA dtype with shapes SDPA takes (grouped-query attention recognised); sets
    `site.batch_dims`."""
    q, v = site.q, site.v
    k = site.k if site.k is not None else site.k_transposed
    for name, n in (("q", q), ("k", k), ("v", v)):
        if not isinstance(n, fx.Node) or node_value(n, tensor_only=True) is None:
            raise Reject(f"{name} is not a tensor")
    dts = {dtype(q), dtype(k), dtype(v), dtype(site.scores), dtype(site.output)}
    if len(dts) != 1:
        raise Reject(f"q, k, v, scores and output have different dtypes {sorted(map(str, dts))}")
    if next(iter(dts)) not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise Reject(f"dtype {next(iter(dts))} is not supported by SDPA")
    sq, sk, sv = sym_shape(q), sym_shape(k), sym_shape(v)
    if not (len(sq) == len(sk) == len(sv)) or len(sq) < 3:
        raise Reject(f"q, k, v ranks {len(sq)}, {len(sk)}, {len(sv)}: need equal ranks >= 3 (batch dims)")
    if site.k is None:  # K^T layout (..., E, Lk)
        sk = sk[:-2] + (sk[-1], sk[-2])
    if sq[:-2] != sk[:-2] or sq[:-2] != sv[:-2]:
        # GQA is the only batch mismatch we accept, handled below
        _gqa(site)
        sk2 = sym_shape(site.k if site.k is not None else site.k_transposed)
        if site.k is None:
            sk2 = sk2[:-2] + (sk2[-1], sk2[-2])
        if sq[:-2] != sk2[:-2] or sq[:-2] != sym_shape(site.v)[:-2]:
            raise Reject(f"batch dims of q {sq[:-2]}, k {sk[:-2]}, v {sv[:-2]} differ (broadcasting in "
                         "matmul is not SDPA's)")
    else:
        _gqa(site)
    if sq[-1] != sk[-1]:
        raise Reject(f"q and k head dims differ ({sq[-1]} vs {sk[-1]})")
    if sk[-2] != sv[-2]:
        raise Reject(f"k and v sequence lengths differ ({sk[-2]} vs {sv[-2]})")
    site.batch_dims = len(sq) - 2
    if site.batch_dims == 1:
        site.notes.append("3-D (bmm) attention: emitted as 4-D SDPA (unsqueeze/squeeze) so fused kernels run")
    if site.batch_dims > 2:
        raise Reject(f"{len(sq)}-D attention (SDPA kernels take (B, H, L, E))")


def _peel_repeat_kv(x: fx.Node):
    """Llama's repeat_kv: reshape(expand(unsqueeze(x, 2)[, identity slices])) -> (x, groups) or None."""
    if not is_op(x, {aten.reshape.default, aten.view.default, aten._unsafe_view.default}):
        return None
    e = x.args[0]
    while _identity_slice(e):
        e = e.args[0]
    if not is_op(e, {aten.expand.default}):
        return None
    u = e.args[0]
    while _identity_slice(u):
        u = u.args[0]
    if not is_op(u, {aten.unsqueeze.default}):
        return None
    base = u.args[0]
    while _identity_slice(base):
        base = base.args[0]
    sb, se, sx = shape(base), shape(e), shape(x)
    if sb is None or se is None or sx is None or len(sb) != 4 or len(se) != 5:
        return None
    if norm_dim(u.args[1], 5) != 2:
        return None
    b, h, n, d = sb
    if se[0] != b or se[1] != h or se[3] != n or se[4] != d or sx != (b, h * se[2], n, d):
        return None
    return base, se[2]


def _gqa(site: AttentionSite) -> None:
    if site.k is None:
        return
    rk, rv = _peel_repeat_kv(site.k), _peel_repeat_kv(site.v)
    if rk and rv and rk[1] == rv[1] and rk[1] > 1:
        site.k_expanded, site.v_expanded = site.k, site.v
        site.k, site.v = rk[0], rv[0]
        site.gqa_groups = rk[1]
