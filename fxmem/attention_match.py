"""Find hand-written attention in a captured (aten-level) graph: `find_attention(program) -> [AttentionSite]`.

Anchored on every softmax. From the softmax the matcher walks

    down  through dtype casts that do not change the dtype, `_assert_tensor_metadata`, and one dropout, to the
          value product  P @ V  (matmul / bmm / einsum);
    up    through the masks (additive `add`, `masked_fill(-inf)`, `where(cond, s, -inf)`, `baddbmm`'s bias), the
          scale (`mul` / `div` by a constant, a 0-dim constant tensor or a shape-derived python scalar, on the scores,
          on q or on k), to the score product  Q @ K^T  (matmul / bmm / einsum), peeling K's transpose (transpose,
          permute, mT) and Llama's repeat_kv (unsqueeze -> expand -> reshape) for grouped-query attention.

A softmax that does not sit between two such products (a classifier head, a gating softmax) is not an attention
site. A site that is attention but cannot be rewritten *provably* exactly carries `reason` (why not) and the pass
reports "not rewritten: <reason>". Every check is explicit: the softmax dim, the scale value, the mask's dtype
semantics (bool keep-mask vs additive) and that it does not enlarge the score shape, dropout placement, dtypes,
that no intermediate (scores, probabilities) is used outside the attention, and batch shapes that SDPA accepts.

A causal mask is reported as `causal=True` only when it provably is the top-left causal mask SDPA's `is_causal`
means: a keep-mask read from a constant buffer (or an in-graph `tril(ones)`) whose values are exactly
lower-triangular ones, sliced from index 0 on both of its last two dims to exactly the score matrix's size.
"""
from __future__ import annotations

import fnmatch
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .program import Program, module_path

aten = torch.ops.aten

SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
MATMUL = {aten.matmul.default, aten.bmm.default}
EINSUM = {aten.einsum.default}
# ops that pass the probabilities through unchanged when they keep the dtype
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default, aten.clone.default,
         aten.contiguous.default, aten.alias.default}
DROPOUT = {aten.dropout.default}
ASSERTS = {aten._assert_tensor_metadata.default}
SDPA = {aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_attention_math.default}
INT_MAX = 2 ** 62


@dataclass
class MaskTerm:
    """One mask applied to the scores. kind: 'keep' (bool, True = attend), 'drop' (bool, True = masked out),
    'additive' (float, added to the scores)."""
    kind: str
    node: fx.Node
    causal: bool = False  # a keep/drop mask that is provably the top-left causal mask
    source: str = ""  # how it was recognised, for the report


@dataclass
class AttentionSite:
    """A matched attention computation softmax(scale * Q K^T + masks) [-> dropout] @ V."""
    module: str  # module path of the softmax
    softmax: fx.Node
    scores: fx.Node | None = None  # the Q @ K^T node
    output: fx.Node | None = None  # the P @ V node, whose uses the rewrite replaces
    nodes: list = field(default_factory=list)  # every node the rewrite replaces, graph order
    q: fx.Node | None = None
    k: fx.Node | None = None  # (..., Lk, E) layout (transpose peeled); None when `k_transposed` must be used
    k_transposed: fx.Node | None = None  # K^T as it is in the graph, when no transpose node could be peeled
    v: fx.Node | None = None
    k_expanded: fx.Node | None = None  # the repeat_kv outputs, used when GQA is not emitted
    v_expanded: fx.Node | None = None
    scale: list = field(default_factory=list)  # factors: ("mul"|"div", float | fx.Node)
    scale_value: float | None = None  # the product at the example inputs
    masks: list = field(default_factory=list)  # MaskTerm
    causal: bool = False  # the only mask is provably causal -> is_causal=True
    dropout_p: float = 0.0
    dropout_train: Any = False  # bool or the ModeFlag node
    gqa_groups: int = 1  # query heads per key/value head (1 = no grouping)
    batch_dims: int = 2  # number of leading dims of q (3-D bmm form has 1)
    reason: str | None = None  # why it is not rewritten (None = rewritable)
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def mask(self) -> fx.Node | None:
        """The single mask node (when there is exactly one), for consumers that only want to know."""
        return self.masks[0].node if len(self.masks) == 1 else None

    def describe(self) -> str:
        parts = [f"scale={self.scale_value:.6g}" if self.scale_value is not None else "scale=?"]
        if self.causal:
            parts.append("causal")
        for m in self.masks:
            if not (self.causal and m.causal):
                parts.append(f"mask:{m.kind}")
        if self.dropout_p:
            parts.append(f"dropout={self.dropout_p:g}")
        if self.gqa_groups > 1:
            parts.append(f"gqa={self.gqa_groups}")
        return ", ".join(parts)


class _NoMatch(Exception):
    """Not attention at all (leave silently)."""


class _Reject(Exception):
    """Attention, but not provably rewritable: the message is the reason."""


# ============================================================================================ helpers

def _is(n, targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def val(n) -> Any:
    """Concrete example value (FakeTensor / python scalar) if refreshed, else the symbolic export value."""
    if not isinstance(n, fx.Node):
        return n
    v = n.meta.get("fxmem_val")
    return v if v is not None else n.meta.get("val")


def sym_shape(n) -> tuple | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    if v is None:
        v = n.meta.get("fxmem_val") if isinstance(n, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    return tuple(str(s) for s in v.shape)


def _as_int(s) -> int:
    try:
        return int(s)
    except Exception:  # noqa: BLE001 - an unbacked / symbolic size: its example hint
        hint = getattr(getattr(s, "node", None), "hint", None)
        return int(hint) if hint is not None else -1


def shape(n) -> tuple | None:
    v = val(n)
    return tuple(_as_int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def dtype(n):
    v = val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def same_shape(a, b) -> bool:
    """Provably the same shape: symbolic shapes equal (and concrete example shapes equal)."""
    sa, sb = sym_shape(a), sym_shape(b)
    if sa is None or sb is None or sa != sb:
        return False
    return shape(a) == shape(b)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if not _is(u, ASSERTS)]


def _single_user(n: fx.Node, what: str) -> fx.Node:
    us = _users(n)
    if len(us) != 1:
        raise _Reject(f"the {what} ({n.name}) is used outside the attention ({len(us)} users: "
                      f"{', '.join(u.name for u in us)}), e.g. returned attention weights")
    return us[0]


def _float_const(x) -> float | None:
    """A python number, or the value of a 0-dim constant tensor (get_attr / lifted constant)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node):
        if x.op == "get_attr":
            t = _get_attr(x)
            if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.requires_grad:
                return float(t.reshape(()).item())
        if _is(x, {aten.lift_fresh_copy.default, aten.clone.default, aten.detach.default}):
            return _float_const(x.args[0])
        if _is(x, {aten.scalar_tensor.default}):
            return _float_const(x.args[0])
        if _is(x, {aten.full.default}) and not x.args[0]:
            return _float_const(x.args[1])
        t = _const_tensor(x)
        if t is not None and t.numel() == 1:
            return float(t.reshape(()).item())
    return None


_RANDOM_WORDS = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "empty")


def _const_tensor(x, depth: int = 6):
    """Fold a small constant subgraph (e.g. `torch.tensor(64.).sqrt()`): every input a constant, no random ops."""
    if not isinstance(x, fx.Node):
        return x
    if x.op == "get_attr":
        t = _get_attr(x)
        ok = isinstance(t, torch.Tensor) and t.numel() <= 16 and not t.requires_grad  # a learned scale is no constant
        return t.detach() if ok else None
    if depth == 0 or x.op != "call_function" or not isinstance(x.target, torch._ops.OpOverload):
        return None
    if x.target in (aten.detach_.default, aten.detach.default, aten.alias.default, aten.clone.default,
                    aten.lift_fresh_copy.default):
        return _const_tensor(x.args[0], depth - 1)
    if any(w in str(x.target) for w in _RANDOM_WORDS) or x.target._schema.is_mutable:
        return None
    args = []
    for a in x.args:
        if isinstance(a, fx.Node):
            v = _const_tensor(a, depth - 1)
            if v is None:
                return None
            args.append(v)
        elif isinstance(a, (list, tuple)) and any(isinstance(e, fx.Node) for e in a):
            return None
        else:
            args.append(a)
    if any(isinstance(v, fx.Node) for v in x.kwargs.values()):
        return None
    try:
        with torch.no_grad():
            out = x.target(*args, **x.kwargs)
    except Exception:  # noqa: BLE001 - not foldable
        return None
    return out if isinstance(out, torch.Tensor) and out.numel() <= 16 else None


def _get_attr(n: fx.Node):
    obj = n.graph.owning_module
    for part in str(n.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _is_scalar_node(x) -> bool:
    """A python scalar computed in the graph from shapes (SymInt/SymFloat arithmetic, sym_size)."""
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    v = x.meta.get("val", x.meta.get("fxmem_val"))
    return isinstance(v, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(v, bool)


def _scalar_example(x) -> float | None:
    v = x.meta.get("fxmem_val", x.meta.get("val"))
    try:
        return float(v)
    except (TypeError, ValueError):
        try:
            return float(v.node.hint)
        except Exception:  # noqa: BLE001
            return None


def _scale_factor(x) -> float | fx.Node | None:
    """A scale operand: python number / constant 0-dim tensor -> float; shape-derived scalar -> its node."""
    c = _float_const(x)
    if c is not None:
        return c
    if _is_scalar_node(x):
        return x
    return None


def _is_neg_inf(x) -> bool:
    c = _float_const(x)
    return c is not None and c == float("-inf")


def _depends_on(n: fx.Node, target: fx.Node, limit: int = 2000) -> bool:
    seen, stack = set(), [n]
    while stack and len(seen) < limit:
        m = stack.pop()
        if m is target:
            return True
        if m in seen:
            continue
        seen.add(m)
        stack.extend(a for a in m.all_input_nodes)
    return False


# ============================================================================================ causal proof

def _identity_slice(n: fx.Node) -> bool:
    if not _is(n, {aten.slice.Tensor}):
        return False
    a = list(n.args) + [None] * (5 - len(n.args))
    start, step = a[2], a[4] if a[4] is not None else 1
    return start in (None, 0) and step == 1 and same_shape(n, n.args[0])


def _tril_source(n: fx.Node) -> tuple[torch.Tensor | None, str]:
    """The constant whose (top-left) slice `n` is, if n = slice*(const) with every slice starting at 0."""
    while _is(n, {aten.slice.Tensor, aten.alias.default, aten.detach.default}):
        if n.target is not aten.slice.Tensor:  # a full slice is captured as alias
            n = n.args[0]
            continue
        a = list(n.args) + [None] * (5 - len(n.args))
        if a[2] not in (None, 0) or (a[4] not in (None, 1)):
            return None, "slice does not start at 0"
        n = a[0]
    if isinstance(n, fx.Node) and n.op == "get_attr":
        t = _get_attr(n)
        return (t if isinstance(t, torch.Tensor) else None), f"buffer {n.target}"
    if _is(n, {aten.tril.default}) and (len(n.args) < 2 or n.args[1] == 0):
        base = n.args[0]
        if _is(base, {aten.ones.default, aten.ones_like.default}) or (
                _is(base, {aten.full.default}) and _float_const(base.args[1]) == 1.0):
            s = shape(base)
            if s is not None:
                return torch.ones(s).tril(), "tril(ones)"
    return None, "not a constant buffer"


def _is_lower_tri_ones(t: torch.Tensor) -> bool:
    if t.dim() < 2 or any(s != 1 for s in t.shape[:-2]):
        return False
    m = t.reshape(t.shape[-2], t.shape[-1]) != 0
    want = torch.ones(m.shape, dtype=torch.bool, device=m.device).tril()
    return bool(torch.equal(m, want))


def _causal_keep(mask: fx.Node, scores_like: fx.Node, kind: str) -> tuple[bool, str]:
    """Is `mask` (a keep- or drop-mask) provably the top-left causal mask of the scores' last two dims?"""
    node, polarity = mask, kind  # polarity: keep = True attends
    # peel eq(x, 0) / ne(x, 0) / logical_not / bool casts
    for _ in range(4):
        if _is(node, {aten.eq.Scalar}) and _float_const(node.args[1]) == 0.0:
            node, polarity = node.args[0], ("drop" if polarity == "keep" else "keep")
            continue
        if _is(node, {aten.ne.Scalar}) and _float_const(node.args[1]) == 0.0:
            node = node.args[0]
            continue
        if _is(node, {aten.logical_not.default, aten.bitwise_not.default}):
            node, polarity = node.args[0], ("drop" if polarity == "keep" else "keep")
            continue
        if _is(node, {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}):
            node = node.args[0]
            continue
        break
    if polarity != "keep":
        return False, ""
    src, how = _tril_source(node)
    if src is None or not _is_lower_tri_ones(src):
        return False, ""
    s, m = sym_shape(scores_like), sym_shape(node)
    if s is None or m is None or len(m) < 2 or m[-2:] != s[-2:] or any(x != "1" for x in m[:-2]):
        return False, ""
    return True, f"{how} sliced to the score shape"


# ============================================================================================ the matcher

def find_attention(program: Program | fx.GraphModule) -> list[AttentionSite]:
    """Every attention computation in the graph, rewritable (`site.ok`) or with the reason it is not."""
    if isinstance(program, Program) and any(
            n.op == "call_function" and "fxmem_val" not in n.meta for n in program.graph.nodes):
        program.refresh()  # concrete example shapes for the checks
    graph = program.graph
    sites = []
    claimed: set = set()
    for n in list(graph.nodes):
        if not _is(n, SOFTMAX):
            continue
        site = AttentionSite(module=module_path(n), softmax=n)
        try:
            _match(site)
        except _NoMatch:
            continue
        except _Reject as e:
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
    chain_up, scores = _walk_up(site)
    site.scores = scores
    _qk(site, scores)
    _pv(site, out_node, p_node)
    # ---- checks
    _check_softmax(site)
    nodes = set(chain_up) | {sm} | set(chain_down) | {scores, out_node}
    site.nodes = _ordered(sm.graph, nodes)
    for n in site.nodes:
        if n is out_node:
            continue
        for u in n.users:
            if u not in nodes and not _is(u, ASSERTS):
                raise _Reject(f"intermediate {n.name} ({_opname(n)}) is used outside the attention by {u.name} "
                              f"(e.g. returned attention weights)")
    # assert nodes hanging off the chain go too
    extra = [u for n in site.nodes for u in n.users if _is(u, ASSERTS)]
    site.nodes = _ordered(sm.graph, set(site.nodes) | set(extra))
    _check_shapes(site)
    _finish_masks(site)
    site.scale_value = _scale_value(site.scale)


def _opname(n) -> str:
    return str(getattr(n.target, "__name__", n.target))


def _ordered(graph, nodes) -> list:
    return [n for n in graph.nodes if n in nodes]


def _walk_down(site: AttentionSite):
    sm = site.softmax
    chain = []
    cur = sm
    dropout_seen = False
    while True:
        us = _users(cur)
        if len(us) != 1:
            if not us:
                raise _NoMatch()
            # several users of the probabilities: attention only if one of them is a value product
            if any(_is(u, MATMUL | EINSUM) for u in us):
                raise _Reject(f"the attention probabilities ({cur.name}) are used outside the attention "
                              f"({', '.join(u.name for u in us)}), e.g. returned attention weights")
            raise _NoMatch()
        u = us[0]
        if _is(u, MATMUL | EINSUM):
            if _is(u, MATMUL) and u.args[0] is not cur:
                raise _NoMatch()
            return chain, u, cur
        if _is(u, CASTS):
            if dtype(u) != dtype(cur):
                if _reaches_matmul(u):
                    raise _Reject(f"the probabilities are cast from {dtype(cur)} to {dtype(u)} before P @ V")
                raise _NoMatch()
            chain.append(u)
            cur = u
            continue
        if _is(u, DROPOUT):
            if dropout_seen:
                raise _Reject("two dropouts on the attention probabilities")
            dropout_seen = True
            p = u.args[1] if len(u.args) > 1 else u.kwargs.get("p", 0.5)
            train = u.args[2] if len(u.args) > 2 else u.kwargs.get("train", True)
            if not isinstance(p, (int, float)):
                raise _Reject(f"dropout probability is not a constant ({p})")
            site.dropout_p = float(p)
            site.dropout_train = train
            chain.append(u)
            cur = u
            continue
        if _reaches_matmul(u):
            raise _Reject(f"{_opname(u)} ({u.name}) between softmax and P @ V has no SDPA equivalent")
        raise _NoMatch()


def _reaches_matmul(n: fx.Node, depth: int = 3) -> bool:
    if depth == 0:
        return False
    for u in n.users:
        if _is(u, MATMUL | EINSUM) or _reaches_matmul(u, depth - 1):
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
        if _is(cur, MATMUL | EINSUM):
            return chain, cur
        if _is(cur, {aten.baddbmm.default}):
            beta = cur.kwargs.get("beta", 1)
            alpha = cur.kwargs.get("alpha", 1)
            if beta != 1:
                raise _Reject(f"baddbmm with beta={beta}")
            if alpha != 1:
                site.scale.append(("mul", float(alpha)))
            _add_mask(site, cur.args[0], cur, "additive", "baddbmm bias")
            chain.append(cur)
            return chain, cur
        chain.append(cur)
        if _is(cur, CASTS):
            if dtype(cur) != dtype(cur.args[0]):
                raise _Reject(f"scores are cast from {dtype(cur.args[0])} to {dtype(cur)} before the softmax")
            cur = cur.args[0]
            continue
        if _is(cur, {aten.add.Tensor}):
            a, b = cur.args[0], cur.args[1]
            alpha = cur.kwargs.get("alpha", 1)
            if alpha != 1:
                raise _Reject(f"add with alpha={alpha} on the scores")
            s, m = _pick_score_operand(a, b)
            if s is None:
                raise _NoMatch()
            if not isinstance(m, fx.Node):
                cur = s  # adding a constant to every score does not change the softmax... but keep it exact:
                raise _Reject("a scalar is added to the scores")
            if scale_seen:
                raise _Reject("the scale is applied after an additive mask (the mask would be scaled)")
            _add_mask(site, m, cur, "additive", "add")
            cur = s
            continue
        if _is(cur, {aten.masked_fill.Scalar, aten.masked_fill.Tensor}):
            s, m, fill = cur.args[0], cur.args[1], cur.args[2]
            if not _is_neg_inf(fill):
                raise _Reject(f"masked_fill with {_float_const(fill)!r} instead of -inf is not a keep-mask "
                              "(a fully masked row would differ)")
            _add_mask(site, m, cur, "drop", "masked_fill")
            cur = s
            continue
        if _is(cur, {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}):
            c, a, b = cur.args[0], cur.args[1], cur.args[2]
            if _is_neg_inf(b) and isinstance(a, fx.Node):
                _add_mask(site, c, cur, "keep", "where")
                cur = a
            elif _is_neg_inf(a) and isinstance(b, fx.Node):
                _add_mask(site, c, cur, "drop", "where")
                cur = b
            else:
                raise _Reject("where() on the scores with a value other than -inf")
            continue
        if _is(cur, {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}):
            a, b = cur.args[0], cur.args[1]
            if cur.kwargs.get("rounding_mode") is not None:
                raise _Reject("div with a rounding mode on the scores")
            op = "mul" if cur.target in (aten.mul.Tensor, aten.mul.Scalar) else "div"
            f, s = _scale_operands(a, b, op)
            if f is None:
                raise _Reject(f"scores are multiplied by a tensor ({cur.name}), not a scalar")
            if isinstance(f, float) and not f > 0:
                raise _Reject(f"scale {f} is not positive")
            site.scale.append((op, f))
            scale_seen = True
            cur = s
            continue
        if _is(cur, DROPOUT):
            raise _Reject("dropout on the scores before the softmax (SDPA drops probabilities)")
        raise _NoMatch()
    raise _NoMatch()


def _pick_score_operand(a, b):
    """Which operand of an add is the scores path (reaches a matmul within a few hops)?"""
    def reaches(n, depth=8):
        if not isinstance(n, fx.Node):
            return False
        if _is(n, MATMUL | EINSUM | {aten.baddbmm.default}):
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
        raise _Reject("cannot tell the scores from the mask in an add of two products")
    return None, None


def _scale_operands(a, b, op):
    if op == "mul":
        fb, fa = _scale_factor(b), _scale_factor(a)
        if fb is not None and isinstance(a, fx.Node) and not _is_scalar_node(a):
            return fb, a
        if fa is not None and isinstance(b, fx.Node) and not _is_scalar_node(b):
            return fa, b
        return None, None
    fb = _scale_factor(b)
    if fb is not None and isinstance(a, fx.Node):
        return fb, a
    return None, None


def _add_mask(site, m, at: fx.Node, kind: str, source: str) -> None:
    if not isinstance(m, fx.Node):
        raise _Reject(f"{source} mask is not a tensor")
    md = dtype(m)
    if kind in ("keep", "drop"):
        if md != torch.bool:
            raise _Reject(f"{source} condition has dtype {md}, expected bool")
    else:
        if md == torch.bool:
            raise _Reject(f"a bool tensor is added to the scores ({m.name})")
        if md is not None and md != dtype(at):
            raise _Reject(f"additive mask dtype {md} differs from the scores' {dtype(at)}")
    # the mask must broadcast into the scores without enlarging them
    ms, os_ = shape(m), shape(at)
    if ms is None or os_ is None:
        raise _Reject(f"unknown shape of the mask {m.name}")
    if len(ms) > len(os_) or any(x not in (1, y) for x, y in zip(ms[::-1], os_[::-1])):
        raise _Reject(f"mask {m.name} of shape {ms} does not broadcast into the scores {os_}")
    site.masks.append(MaskTerm(kind=kind, node=m, source=source))
    site.masks[-1].at = at  # type: ignore[attr-defined]


def _peel_transpose(kt: fx.Node) -> fx.Node | None:
    """K from K^T when K^T is a transpose of the last two dims (transpose / permute / mT)."""
    s = shape(kt)
    if s is None:
        return None
    nd = len(s)
    if _is(kt, {aten.transpose.int}):
        d = {_norm_dim(kt.args[1], nd), _norm_dim(kt.args[2], nd)}
        if d == {nd - 2, nd - 1}:
            return kt.args[0]
    if _is(kt, {aten.permute.default}):
        perm = [_norm_dim(p, nd) for p in kt.args[1]]
        if perm == list(range(nd - 2)) + [nd - 1, nd - 2]:
            return kt.args[0]
    if _is(kt, {aten.t.default, aten.numpy_T.default}) and nd == 2:
        return kt.args[0]
    return None


def _peel_scale(site, x: fx.Node) -> fx.Node:
    """Scale factors applied to q or k (x * c, x / c) become part of the SDPA scale."""
    while _is(x, {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}) \
            and x.kwargs.get("rounding_mode") is None:
        op = "mul" if x.target in (aten.mul.Tensor, aten.mul.Scalar) else "div"
        f, s = _scale_operands(x.args[0], x.args[1], op)
        if f is None or len(_users(x)) != 1:
            break
        if isinstance(f, float) and not f > 0:
            raise _Reject(f"scale {f} on q/k is not positive")
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


def _qk(site: AttentionSite, scores: fx.Node) -> None:
    site._peeled = []  # type: ignore[attr-defined]
    if _is(scores, {aten.baddbmm.default}):
        q, kt = scores.args[1], scores.args[2]
    elif _is(scores, EINSUM):
        p = _parse_einsum(scores.args[0])
        if p is None or len(scores.args[1]) != 2:
            raise _Reject(f"einsum {scores.args[0]!r} is not a plain two-operand product")
        a, b, o = p
        q, kk = scores.args[1]
        # q: P i c ; k: P j c (or P c j) ; out: P i j
        if not (len(a) == len(b) == len(o) >= 3) or a[:-2] != b[:-2] or a[:-2] != o[:-2]:
            raise _Reject(f"einsum {scores.args[0]!r}: batch dims of q, k and scores differ")
        i, c = a[-2], a[-1]
        if b[-2:] == o[-1] + c and o[-2:] == i + o[-1]:
            site.k = _peel_scale(site, kk)
            site.q = _peel_scale(site, q)
            return
        if b[-2:] == c + o[-1] and o[-2:] == i + o[-1]:
            q, kt = q, kk
        else:
            raise _Reject(f"einsum {scores.args[0]!r} is not q k^T")
    else:
        q, kt = scores.args[0], scores.args[1]
    kt = _peel_scale(site, kt)
    k = _peel_transpose(kt)
    if k is None:
        site.k_transposed = kt
    else:
        site.k = _peel_scale(site, k)
    site.q = _peel_scale(site, q)


def _pv(site: AttentionSite, out: fx.Node, p: fx.Node) -> None:
    if _is(out, EINSUM):
        pe = _parse_einsum(out.args[0])
        if pe is None or len(out.args[1]) != 2 or out.args[1][0] is not p:
            raise _Reject(f"einsum {out.args[0]!r} is not P @ V")
        a, b, o = pe
        if not (len(a) == len(b) == len(o) >= 3) or a[:-2] != b[:-2] or a[:-2] != o[:-2] \
                or not (b[-2] == a[-1] and o[-2] == a[-2] and o[-1] == b[-1]):
            raise _Reject(f"einsum {out.args[0]!r} is not P @ V")
        site.v = out.args[1][1]
    else:
        site.v = out.args[1]


def _check_softmax(site: AttentionSite) -> None:
    sm = site.softmax
    x = sm.args[0]
    s = shape(x)
    if s is None:
        raise _Reject("unknown shape of the scores")
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    if _norm_dim(int(dim), len(s)) != len(s) - 1:
        raise _Reject(f"softmax over dim {dim}, not the key dim (last)")
    if sm.target is aten.softmax.int:
        dt = sm.args[2] if len(sm.args) > 2 else sm.kwargs.get("dtype")
        if dt is not None and dt != dtype(x):
            raise _Reject(f"softmax computed in {dt} on {dtype(x)} scores (SDPA's precision differs)")
    if sm.target is aten._softmax.default and len(sm.args) > 2 and sm.args[2]:
        raise _Reject("softmax with half_to_float")


def _check_shapes(site: AttentionSite) -> None:
    q, v = site.q, site.v
    k = site.k if site.k is not None else site.k_transposed
    for name, n in (("q", q), ("k", k), ("v", v)):
        if not isinstance(n, fx.Node) or not isinstance(val(n), torch.Tensor):
            raise _Reject(f"{name} is not a tensor")
    dts = {dtype(q), dtype(k), dtype(v), dtype(site.softmax)}
    if len(dts) != 1:
        raise _Reject(f"q, k, v and scores have different dtypes {sorted(map(str, dts))}")
    if next(iter(dts)) not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise _Reject(f"dtype {next(iter(dts))} is not supported by SDPA")
    sq, sk, sv = sym_shape(q), sym_shape(k), sym_shape(v)
    if not (len(sq) == len(sk) == len(sv)) or len(sq) < 3:
        raise _Reject(f"q, k, v ranks {len(sq)}, {len(sk)}, {len(sv)}: need equal ranks >= 3 (batch dims)")
    if site.k is None:  # K^T layout (..., E, Lk)
        sk = sk[:-2] + (sk[-1], sk[-2])
    if sq[:-2] != sk[:-2] or sq[:-2] != sv[:-2]:
        # GQA is the only batch mismatch we accept, handled below
        _gqa(site)
        sk2 = sym_shape(site.k if site.k is not None else site.k_transposed)
        if site.k is None:
            sk2 = sk2[:-2] + (sk2[-1], sk2[-2])
        if sq[:-2] != sk2[:-2] or sq[:-2] != sym_shape(site.v)[:-2]:
            raise _Reject(f"batch dims of q {sq[:-2]}, k {sk[:-2]}, v {sv[:-2]} differ (broadcasting in "
                          "matmul is not SDPA's)")
    else:
        _gqa(site)
    if sq[-1] != sk[-1]:
        raise _Reject(f"q and k head dims differ ({sq[-1]} vs {sk[-1]})")
    if sk[-2] != sv[-2]:
        raise _Reject(f"k and v sequence lengths differ ({sk[-2]} vs {sv[-2]})")
    site.batch_dims = len(sq) - 2
    if site.batch_dims == 1:
        site.notes.append("3-D (bmm) attention: emitted as 4-D SDPA (unsqueeze/squeeze) so fused kernels run")
    if site.batch_dims > 2:
        raise _Reject(f"{len(sq)}-D attention (SDPA kernels take (B, H, L, E))")


def _peel_repeat_kv(x: fx.Node):
    """Llama's repeat_kv: reshape(expand(unsqueeze(x, 2)[, identity slices])) -> (x, groups) or None."""
    if not _is(x, {aten.reshape.default, aten.view.default, aten._unsafe_view.default}):
        return None
    e = x.args[0]
    while _identity_slice(e):
        e = e.args[0]
    if not _is(e, {aten.expand.default}):
        return None
    u = e.args[0]
    while _identity_slice(u):
        u = u.args[0]
    if not _is(u, {aten.unsqueeze.default}):
        return None
    base = u.args[0]
    while _identity_slice(base):
        base = base.args[0]
    sb, se, sx = shape(base), shape(e), shape(x)
    if sb is None or se is None or sx is None or len(sb) != 4 or len(se) != 5:
        return None
    if _norm_dim(u.args[1], 5) != 2:
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


def _finish_masks(site: AttentionSite) -> None:
    for m in site.masks:
        if m.kind in ("keep", "drop"):
            m.causal, how = _causal_keep(m.node, site.scores, m.kind)
            if m.causal:
                m.source += f" ({how})"
    if len(site.masks) == 1 and site.masks[0].causal:
        site.causal = True
    elif any(m.causal for m in site.masks):
        site.notes.append("causal mask combined with another mask: passed as an explicit attn_mask")
    for m in site.masks:
        if m.kind in ("keep", "drop") and not m.causal:
            site.notes.append("bool mask: a row whose every key is masked gives 0 with SDPA where the original "
                              "softmax gives NaN")
            break


def _scale_value(factors) -> float | None:
    v = 1.0
    for op, f in factors:
        x = f if isinstance(f, float) else _scalar_example(f)
        if x is None:
            return None
        v = v * x if op == "mul" else v / x
    return v


def existing_sdpa(program) -> list[fx.Node]:
    """SDPA calls already in the graph (left alone by the pass)."""
    return [n for n in program.graph.nodes if _is(n, SDPA)]


def emit_scale(graph: fx.Graph, factors) -> float | fx.Node:
    """The SDPA `scale` argument: a float, or a python-scalar node computed from shape-derived factors."""
    const = 1.0
    dyn = []
    for op, f in factors:
        if isinstance(f, float):
            const = const * f if op == "mul" else const / f
        else:
            dyn.append((op, f))
    if not dyn:
        return float(const)
    cur: Any = float(const)
    for op, f in dyn:
        cur = graph.call_function(operator.mul if op == "mul" else operator.truediv, (cur, f))
    return graph.call_function(float, (cur,))


def glob_match(path: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


_ = re  # (kept for future equation parsing with ellipses)


@dataclass
class Projection:
    """Where q or k comes from: heads of a linear layer `x @ W[rows]^T + b[rows]`, viewed as (B, H, T, dh)."""
    x: fx.Node
    weight: fx.Node  # get_attr
    bias: fx.Node | None
    offset: int  # first output row of this projection in W (fused qkv layers)
    heads: int
    head_dim: int


def trace_projection(n: fx.Node) -> Projection | None:
    """q/k = linear(x, W, b)[..., rows].view(B, T, H, dh).transpose(1, 2), with an optional split of a fused qkv."""
    if not _is(n, {aten.transpose.int}) or {_norm_dim(n.args[1], 4), _norm_dim(n.args[2], 4)} != {1, 2}:
        return None
    v = n.args[0]
    if not _is(v, {aten.view.default, aten.reshape.default, aten._unsafe_view.default}):
        return None
    s4 = shape(v)
    if s4 is None or len(s4) != 4:
        return None
    src, offset = v.args[0], 0
    if src.op == "call_function" and src.target is operator.getitem and _is(src.args[0], {aten.split.Tensor}):
        sp, i = src.args[0], src.args[1]
        dim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
        size = sp.args[1]
        if not isinstance(size, int) or _norm_dim(dim, 3) != 2:
            return None
        offset, src = i * size, sp.args[0]
    if not _is(src, {aten.linear.default}):
        return None
    x, w = src.args[0], src.args[1]
    b = src.args[2] if len(src.args) > 2 else None
    if not (isinstance(w, fx.Node) and w.op == "get_attr") or (b is not None and not (
            isinstance(b, fx.Node) and b.op == "get_attr")):
        return None
    return Projection(x=x, weight=w, bias=b, offset=offset, heads=s4[2], head_dim=s4[3])
