"""The compute rewrite: casts inserted on every edge whose dtype the plan changes, and redundant casts removed."""
from __future__ import annotations

import operator

import torch
from torch import fx

from fxmem import ops as optable
from fxmem.depgroups import attr_of
from fxmem.nn.recast import cast_param, install as install_recast

from .nodes import is_param_attr, node_args, node_value, orig_float_dtype
from .options import DTYPE_NAMES, PrecisionOptions
from .plan import ACC, BATCH_NORMS, CAST_OPS, FP32, INPLACE, LOW, OPAQUE, RETARGET, Decision

aten = torch.ops.aten


def apply_plan(gm: fx.GraphModule, decisions: dict[str, Decision], opts: PrecisionOptions, low: torch.dtype,
               recast: bool = False) -> dict:
    """Insert casts on every edge whose dtype changes under the plan; returns counters.

    recast: casts of parameters become `fxmem.nn.recast.cast_param` and the module gets the recast hooks, so
    autograd saves the parameter (alive anyway) instead of its low-precision copy and casts again in backward."""
    g = gm.graph
    compact = opts.islands == "compact"
    cur: dict[fx.Node, torch.dtype | None] = {}
    casts: dict[tuple, fx.Node] = {}
    stats = {"casts_inserted": 0, "retargeted": 0, "outputs_cast": 0}

    def is_param(a):
        return is_param_attr(gm, a)

    def cast(a: fx.Node, dt: torch.dtype, before: fx.Node) -> fx.Node:
        key = (a, dt)
        c = casts.get(key)
        if c is None:
            with g.inserting_before(before):
                if recast and (is_param(a) or a.op == "placeholder") and dt != torch.float32:
                    c = g.call_function(cast_param, (a, dt))
                    stats["params_recast"] = stats.get("params_recast", 0) + 1
                else:
                    c = g.call_function(aten._to_copy.default, (a,), {"dtype": dt})
            c.name = f"{a.name}_{DTYPE_NAMES.get(dt, 'cast')}"
            c.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
            c.meta["fxmem_precision"] = "cast"
            casts[key] = c
            cur[c] = dt
            stats["casts_inserted"] += 1
        return c

    def float_inputs(n):
        return [a for a in node_args(n) if cur.get(a) is not None]

    def target_for(n, d: Decision) -> torch.dtype | None:
        ins = float_inputs(n)
        if not ins:
            return None
        if d.cls == LOW:
            return low
        if d.cls == FP32:
            return torch.float32
        if d.cls == OPAQUE:
            return None  # per input: original dtype
        if d.cls == INPLACE:
            return cur.get(n.args[0])  # the mutated tensor is never cast (a cast would mutate a copy)
        dts = {cur[a] for a in ins}
        nonparam = {cur[a] for a in ins if not is_param(a)}
        if compact:
            if low in dts or (not nonparam and ins):
                if low == torch.float16 and any(x not in (low,) for x in nonparam):
                    return torch.float32  # fp16: mixed with fp32 values promotes (range)
                return low
            return next(iter(dts)) if len(dts) == 1 else torch.float32
        # autocast: torch's type promotion, made explicit where dtypes differ
        if len(dts) == 1:
            return next(iter(dts))
        return torch.float32 if torch.float32 in dts else max(dts, key=lambda x: torch.finfo(x).bits)

    for n in list(g.nodes):
        if n.op == "placeholder":
            cur[n] = orig_float_dtype(n)
            continue
        if n.op == "get_attr":
            v = None
            try:
                obj = attr_of(gm, n.target)
                if isinstance(obj, torch.Tensor) and obj.is_floating_point():
                    v = obj.dtype
            except AttributeError:
                pass
            cur[n] = v
            continue
        if n.op == "output":
            def fix(a):
                if isinstance(a, fx.Node) and cur.get(a) is not None:
                    want = orig_float_dtype(a)
                    if want is not None and cur[a] != want:
                        stats["outputs_cast"] += 1
                        return cast(a, want, n)
                return a
            n.args = fx.node.map_arg(n.args, fix)
            continue
        d = decisions.get(n.name)
        if d is None:
            cur[n] = orig_float_dtype(n)
            continue
        if d.cls == RETARGET:
            src = n.args[0]
            if cur.get(src) is not None:
                n.replace_all_uses_with(src)
                g.erase_node(n)
                stats["retargeted"] += 1
                continue
            cur[n] = orig_float_dtype(n)
            continue
        if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default:
            src = n.args[0]
            if isinstance(src, fx.Node) and cur.get(src) is not None and n.kwargs.get("dtype") is not None \
                    and n.kwargs["dtype"] != cur[src]:
                n.kwargs = {**n.kwargs, "dtype": cur[src]}
                stats["asserts_updated"] = stats.get("asserts_updated", 0) + 1
            cur[n] = None
            continue
        if n.op == "call_function" and n.target is operator.getitem:
            parent = n.args[0]
            cur[n] = cur.get(parent) if orig_float_dtype(n) is not None and cur.get(parent) is not None \
                else orig_float_dtype(n)
            continue
        want = target_for(n, d)

        mixed = d.cls == ACC and n.op == "call_function" and optable.packet(n.target) in BATCH_NORMS
        first = n.args[0] if n.args else None

        def fix(a, n=n, want=want, d=d, mixed=mixed, first=first):
            if not isinstance(a, fx.Node) or cur.get(a) is None:
                return a
            w = want
            if d.cls == OPAQUE:
                w = orig_float_dtype(a)
            elif mixed and a is not first:
                # batch norm's mixed-dtype kernel: low-precision input, weight/bias/running statistics in fp32
                w = torch.float32
            if w is None or cur[a] == w:
                return a
            return cast(a, w, n)
        n.args = fx.node.map_arg(n.args, fix)
        n.kwargs = fx.node.map_arg(n.kwargs, fix)
        # explicit fp32 result dtypes (softmax(x, dtype=float32) in HF code) follow the plan in LOW/ACC ops
        if d.cls in (ACC, LOW) and n.target in (aten.softmax.int, aten.log_softmax.int) and len(n.args) > 2 \
                and n.args[2] == torch.float32 and want is not None and want != torch.float32:
            n.args = n.args[:2] + (None,) + tuple(n.args[3:])
        od = orig_float_dtype(n)
        if od is None:
            cur[n] = None
        elif d.cls == OPAQUE:
            cur[n] = od
        elif d.cls == FP32:
            cur[n] = torch.float32
        elif want is not None:
            cur[n] = want
        else:
            cur[n] = od
    g.lint()
    gm.recompile()
    if stats.get("params_recast"):
        install_recast(gm)
    return stats


def simplify_casts(gm: fx.GraphModule) -> int:
    """Remove casts to the dtype a value already has and lossless round trips (x -> wider -> x's dtype).

    Works on `fxmem_val` metadata (call after `program.refresh()`); returns the number of casts removed."""
    g = gm.graph
    removed = 0
    changed = True
    while changed:
        changed = False
        for n in list(g.nodes):
            if n.op != "call_function" or n.target not in CAST_OPS or not n.args:
                continue
            src = n.args[0]
            if not isinstance(src, fx.Node):
                continue
            dst_dt, src_dt = orig_float_dtype(n), orig_float_dtype(src)
            if dst_dt is None or src_dt is None or not _pure_dtype_cast(n):
                continue
            if dst_dt == src_dt and n.meta.get("fxmem_precision") == "cast":
                n.replace_all_uses_with(src)
                g.erase_node(n)
                removed += 1
                changed = True
                continue
            # x(a) -> cast(b) -> cast(a) with b at least as wide as a: the pair is the identity
            if src.op == "call_function" and src.target in CAST_OPS and _pure_dtype_cast(src):
                x = src.args[0]
                x_dt = orig_float_dtype(x) if isinstance(x, fx.Node) else None
                if x_dt == dst_dt and torch.finfo(src_dt).bits >= torch.finfo(x_dt).bits \
                        and not (src_dt == torch.float16 and x_dt == torch.bfloat16) \
                        and not (src_dt == torch.bfloat16 and x_dt == torch.float16):
                    n.replace_all_uses_with(x)
                    g.erase_node(n)
                    if all(u.target is aten._assert_tensor_metadata.default for u in src.users):
                        for u in list(src.users):
                            g.erase_node(u)  # checks of a value that no longer exists
                        g.erase_node(src)
                        removed += 1
                    removed += 1
                    changed = True
    g.lint()
    gm.recompile()
    return removed


def _pure_dtype_cast(n: fx.Node) -> bool:
    kw = {k: v for k, v in n.kwargs.items() if k not in ("dtype", "layout", "copy", "non_blocking")}
    if kw.get("memory_format") is not None:
        return False
    dev = kw.get("device")
    src = n.args[0]
    if dev is not None and node_value(src) is not None and torch.device(dev) != node_value(src).device:
        return False
    return True
