"""Which scaled_dot_product_attention kernel (flash, memory-efficient, cuDNN, math) a rewritten attention site
gets on its device: SDPA's dispatcher is asked first, then each backend is tried in turn on small inputs of the
site's dtypes and shapes, in train mode (with grad and dropout) and in eval."""
from __future__ import annotations

import warnings

import torch
from torch import fx

from .attention_nodes import val
from .nn.attention import sdpa_dropout

BACKEND_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def dispatcher_choice(q, k, v, mask, dropout_p, is_causal, scale, gqa):
    """The backend SDPA's dispatcher picks for this call (`torch._fused_sdp_choice`: on CUDA, torch orders the fused
    kernels by device and version, cuDNN first on Hopper); None where it cannot say."""
    from torch.nn.attention import SDPBackend
    try:
        code = torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa)
        return SDPBackend(code).name
    except Exception:  # noqa: BLE001 - an older torch or an unsupported call: the fixed order decides
        return None


def probe_order(first) -> tuple:
    """The backends to try in turn: the dispatcher's choice, then the fixed order."""
    return ((first,) if first in BACKEND_ORDER else ()) + tuple(b for b in BACKEND_ORDER if b != first)


def probe_backend(node: fx.Node) -> dict:
    """Which SDPA kernel runs for this SDPA call node on this device, in train mode (with grad, dropout) and in
    eval: the kernel, and why when it is the math one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    args = node.args
    if node.target is sdpa_dropout:
        q, k, v, mask, p, _, is_causal, scale, gqa = args
    else:
        q, k, v = args
        kw = node.kwargs
        mask, p, is_causal, scale, gqa = (kw.get("attn_mask"), kw.get("dropout_p", 0.0), kw.get("is_causal", False),
                                          kw.get("scale"), kw.get("enable_gqa", False))
    qv, kv, vv = val(q), val(k), val(v)
    if not all(isinstance(t, torch.Tensor) for t in (qv, kv, vv)):
        return {}
    device = qv.device

    def small(t, rows=None):
        s = [int(x) for x in t.shape]
        s[0] = min(s[0], 2)
        if len(s) >= 2:
            s[-2] = min(s[-2], 64)
        if rows is not None and len(s) >= 1:
            s[-1] = min(s[-1], rows)
        return torch.randn(s, dtype=t.dtype, device=device)

    def mk_mask(lq, lk):
        if mask is None:
            return None
        mv = val(mask)
        s = [int(x) for x in mv.shape]
        if len(s) >= 2:
            s[-2] = min(s[-2], lq) if s[-2] != 1 else 1
            s[-1] = min(s[-1], lk) if s[-1] != 1 else 1
        if len(s) >= 4:
            s[0] = min(s[0], 2)
        if mv.dtype == torch.bool:
            return torch.ones(s, dtype=torch.bool, device=device)
        return torch.zeros(s, dtype=mv.dtype, device=device)

    sc = float(scale) if isinstance(scale, (int, float)) else None
    results = {}
    for phase, train in (("train", True), ("eval", False)):
        qs, ks, vs = small(qv), small(kv), small(vv)
        m = mk_mask(qs.shape[-2], ks.shape[-2])
        grad = train and bool(getattr(qv, "requires_grad", False) or getattr(kv, "requires_grad", False))
        for t in (qs, ks, vs):
            t.requires_grad_(grad)
        dp = float(p) if train else 0.0
        chosen = None
        for name in probe_order(dispatcher_choice(qs, ks, vs, m, dp, bool(is_causal), sc, bool(gqa))):
            be = getattr(SDPBackend, name, None)
            if be is None:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with sdpa_kernel([be]):
                        o = torch.nn.functional.scaled_dot_product_attention(
                            qs, ks, vs, attn_mask=m, dropout_p=dp, is_causal=bool(is_causal), scale=sc,
                            enable_gqa=bool(gqa))
                        if grad:
                            o.sum().backward()
                chosen = name.lower().replace("_attention", "")
                break
            except Exception:  # noqa: BLE001 - this backend cannot run this call
                continue
        results[phase] = chosen or "none"
    summary = (results["train"] if results["train"] == results["eval"]
               else f"train: {results['train']}, eval: {results['eval']}")
    out = {"device": str(device), "train": results["train"], "eval": results["eval"], "summary": summary}
    if "math" in (results["train"], results["eval"]):
        why = []
        if p and results["train"] == "math":
            why.append(f"dropout_p={p:g} in train mode")
        if gqa and results["train"] == "math":
            why.append("enable_gqa")
        out["fallback"] = ("the math SDPA kernel runs " + ("in train mode" if results["eval"] != "math" else
                                                           "in both modes")
                           + (f" ({', '.join(why)})" if why else "")
                           + ": it materialises the score matrix, so the memory win is smaller there")
    return out
