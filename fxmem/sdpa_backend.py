"""Which scaled_dot_product_attention kernel (flash, memory-efficient, cuDNN, math) a rewritten attention site
gets on its device: SDPA's dispatcher is asked first, then each backend is tried in turn on small inputs of the
site's dtypes and shapes, in train mode (with grad and dropout) and in eval."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import fx

from .nn.attention import sdpa_dropout
from .node_value import node_value

BACKEND_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def dispatcher_choice(query, key, value, mask, dropout_p, is_causal, scale, gqa):
    """The backend SDPA's dispatcher picks for this call (`torch._fused_sdp_choice`: on CUDA, torch orders the fused
    kernels by device and version, cuDNN first on Hopper); None where it cannot say."""
    from torch.nn.attention import SDPBackend
    try:
        code = torch._fused_sdp_choice(query, key, value, mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa)
        return SDPBackend(code).name
    except Exception:  # noqa: BLE001 - an older torch or an unsupported call: the fixed order decides
        return None


def probe_order(first) -> tuple:
    """The backends to try in turn: the dispatcher's choice, then the fixed order."""
    return ((first,) if first in BACKEND_ORDER else ()) + tuple(b for b in BACKEND_ORDER if b != first)


def probe_backend(node: fx.Node) -> dict:
    """Which SDPA kernel runs for this SDPA call node on this device, in train mode (with grad, dropout) and in
    eval: the kernel, and why when it is the math one."""
    call = _SdpaCall.of(node)
    query, key, value = node_value(call.query), node_value(call.key), node_value(call.value)
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return {}
    device = query.device
    scale = float(call.scale) if isinstance(call.scale, (int, float)) else None
    results = {}
    for phase, train in (("train", True), ("eval", False)):
        small_q, small_k, small_v = _small_like(query, device), _small_like(key, device), _small_like(value, device)
        mask = _small_mask(call.mask, small_q.shape[-2], small_k.shape[-2], device)
        grad = train and bool(getattr(query, "requires_grad", False) or getattr(key, "requires_grad", False))
        for tensor in (small_q, small_k, small_v):
            tensor.requires_grad_(grad)
        kwargs = {"attn_mask": mask, "dropout_p": float(call.dropout_p) if train else 0.0,
                  "is_causal": bool(call.is_causal), "scale": scale, "enable_gqa": bool(call.gqa)}
        results[phase] = _first_backend_that_runs(small_q, small_k, small_v, kwargs, grad) or "none"
    summary = (results["train"] if results["train"] == results["eval"]
               else f"train: {results['train']}, eval: {results['eval']}")
    out = {"device": str(device), "train": results["train"], "eval": results["eval"], "summary": summary}
    if "math" in (results["train"], results["eval"]):
        out["fallback"] = _fallback_line(call, results)
    return out


@dataclass
class _SdpaCall:
    """The arguments of an SDPA call node (fx nodes or constants), from either call form."""
    query: object
    key: object
    value: object
    mask: object
    dropout_p: object
    is_causal: object
    scale: object
    gqa: object

    @classmethod
    def of(cls, node: fx.Node) -> "_SdpaCall":
        if node.target is sdpa_dropout:
            query, key, value, mask, dropout_p, _, is_causal, scale, gqa = node.args
            return cls(query, key, value, mask, dropout_p, is_causal, scale, gqa)
        query, key, value = node.args
        kwargs = node.kwargs
        return cls(query, key, value, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0),
                   kwargs.get("is_causal", False), kwargs.get("scale"), kwargs.get("enable_gqa", False))


def _small_like(tensor: torch.Tensor, device) -> torch.Tensor:
    """Random values of the tensor's dtype, at most 2 in the first dim and 64 rows."""
    shape = [int(x) for x in tensor.shape]
    shape[0] = min(shape[0], 2)
    if len(shape) >= 2:
        shape[-2] = min(shape[-2], 64)
    return torch.randn(shape, dtype=tensor.dtype, device=device)


def _small_mask(mask, query_len: int, key_len: int, device):
    """A mask of the site's dtype that lets everything through, shrunk to the small inputs (None without one)."""
    if mask is None:
        return None
    mask_value = node_value(mask)
    shape = [int(x) for x in mask_value.shape]
    if len(shape) >= 2:
        shape[-2] = min(shape[-2], query_len) if shape[-2] != 1 else 1
        shape[-1] = min(shape[-1], key_len) if shape[-1] != 1 else 1
    if len(shape) >= 4:
        shape[0] = min(shape[0], 2)
    if mask_value.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return torch.zeros(shape, dtype=mask_value.dtype, device=device)


def _first_backend_that_runs(query, key, value, kwargs: dict, grad: bool) -> str | None:
    """The first backend (the dispatcher's choice, then the fixed order) that runs this call, and its backward
    with `grad`: 'flash', 'efficient', 'cudnn' or 'math'; None when none does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    first = dispatcher_choice(query, key, value, kwargs["attn_mask"], kwargs["dropout_p"], kwargs["is_causal"],
                              kwargs["scale"], kwargs["enable_gqa"])
    for name in probe_order(first):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel([backend]):
                    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)
                    if grad:
                        out.sum().backward()
            return name.lower().replace("_attention", "")
        except Exception:  # noqa: BLE001 - this backend cannot run this call
            continue
    return None


def _fallback_line(call: _SdpaCall, results: dict) -> str:
    """Why the math kernel runs, and what that costs."""
    why = []
    if call.dropout_p and results["train"] == "math":
        why.append(f"dropout_p={call.dropout_p:g} in train mode")
    if call.gqa and results["train"] == "math":
        why.append("enable_gqa")
    return ("the math SDPA kernel runs " + ("in train mode" if results["eval"] != "math" else "in both modes")
            + (f" ({', '.join(why)})" if why else "")
            + ": it materialises the score matrix, so the memory win is smaller there")
