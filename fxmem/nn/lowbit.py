"""Low-bit linear layers that the precision pass puts into graphs: bitsandbytes wrappers and LoRA adapters.

`QuantLinear` holds a bitsandbytes `Linear8bitLt` (LLM.int8(), outlier threshold) or `Linear4bit` (nf4/fp4, optional
double quantization) built from an fp32 weight. It exists so that

- the graph can call it like `aten.linear` in any float dtype (input cast to the compute dtype, output cast back);
- the cost model and `fxmem.measure` see every byte it holds: bitsandbytes keeps the int8 row scales (`SCB`) and the
  4-bit quantization state (absmax, code, nested absmax/code) as plain tensor attributes of the weight, which
  `module.parameters()` never yields; they are registered here as non-persistent buffers (the state_dict is the
  bitsandbytes layer's own, unchanged);
- `.to(device)` works: the inner layer is moved with bitsandbytes' own `.to` (which is what quantizes a
  `Params4bit` on its first move) and the aux buffers are re-read from the moved weight.

`LoRALinear` adds a trainable low-rank update to a frozen base (QLoRA when the base is a 4-bit `QuantLinear`):
`y = base(x) + dropout(x) @ A^T @ B^T * alpha / rank`, B initialised to zero so the model starts unchanged.

The weights of a quantized linear are frozen (bitsandbytes' int8/4-bit weights take no gradient); the input
gradient flows through.
"""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

QUANT_KINDS = ("int8", "nf4", "fp4")


def _bnb():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes as bnb
    return bnb


class QuantLinear(nn.Module):
    """A frozen bitsandbytes linear built from an fp32 (or bf16/fp16) weight and optional bias."""

    fxmem_dtype_follow = True  # the precision pass: output dtype = input dtype, no cast needed around it

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str = "int8", *,
                 threshold: float = 6.0, double_quant: bool = True, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        if kind not in QUANT_KINDS:
            raise ValueError(f"QuantLinear kind must be one of {QUANT_KINDS}, got {kind!r}")
        if weight.dim() != 2:
            raise ValueError(f"QuantLinear needs a 2-D weight, got shape {tuple(weight.shape)}")
        bnb = _bnb()
        out_f, in_f = weight.shape
        self.kind = kind
        self.in_features, self.out_features = int(in_f), int(out_f)
        self.compute_dtype = compute_dtype
        self.threshold = float(threshold)
        self.double_quant = bool(double_quant)
        device = weight.device
        w = weight.detach().to(torch.float32).clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "int8":
                inner = bnb.nn.Linear8bitLt(in_f, out_f, bias=False, has_fp16_weights=False,
                                            threshold=threshold, device="meta")
                inner.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
            else:
                inner = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=compute_dtype,
                                          compress_statistics=double_quant, quant_type=kind, device="meta")
                inner.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=double_quant,
                                                 quant_type=kind)
            inner = inner.to(device)  # quantizes
        self.inner = inner
        # the bias is added here, not by bitsandbytes (its CPU 4-bit path adds it in place, which fails when
        # autograd records the matmul)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32).clone(),
                                                           requires_grad=False)
        self._sync_aux()
        with torch.no_grad():  # bitsandbytes repacks/caches on the first call: make that call a real one
            self.inner(torch.zeros(1, in_f, dtype=compute_dtype, device=device))

    # ---------------------------------------------------------------------------------------- bookkeeping
    def aux_tensors(self) -> dict[str, torch.Tensor]:
        """Quantization state bitsandbytes keeps outside parameters (row scales, absmax, codes)."""
        w = self.inner.weight
        out: dict[str, torch.Tensor] = {}
        if self.kind == "int8":
            scb = getattr(w, "SCB", None)
            if scb is None:
                scb = getattr(getattr(self.inner, "state", None), "SCB", None)
            if isinstance(scb, torch.Tensor):
                out["scb"] = scb
            return out
        qs = getattr(w, "quant_state", None)
        if qs is None:
            return out
        for name in ("absmax", "code", "offset"):
            t = getattr(qs, name, None)
            if isinstance(t, torch.Tensor):
                out[f"q_{name}"] = t
        s2 = getattr(qs, "state2", None)
        if s2 is not None:
            for name in ("absmax", "code"):
                t = getattr(s2, name, None)
                if isinstance(t, torch.Tensor):
                    out[f"q2_{name}"] = t
        return out

    def _sync_aux(self) -> None:
        for name in [n for n in self._buffers if n.startswith(("scb", "q_", "q2_"))]:
            del self._buffers[name]
        for name, t in self.aux_tensors().items():
            self.register_buffer(name, t, persistent=False)

    def _apply(self, fn, recurse=True):
        # move the bitsandbytes layer with its own .to (Params4bit / Int8Params carry their state), then re-read
        # the aux tensors, so that nothing is copied twice
        for name in [n for n in self._buffers if n.startswith(("scb", "q_", "q2_"))]:
            del self._buffers[name]
        self.inner._apply(fn, recurse)
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.data), requires_grad=False)
        self._sync_aux()
        return self

    def weight_bytes(self) -> int:
        """Storage bytes of the quantized weight, its quantization state and the bias."""
        seen, total = set(), 0
        tensors = [self.inner.weight] + list(self.aux_tensors().values())
        if self.bias is not None:
            tensors.append(self.bias)
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += int(st.nbytes())
        return total

    def dense_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        n = self.in_features * self.out_features + (self.out_features if self.bias is not None else 0)
        return n * torch.empty((), dtype=dtype).element_size()

    def dequantized_weight(self) -> torch.Tensor:
        bnb = _bnb()
        w = self.inner.weight
        if self.kind == "int8":
            scb = self.aux_tensors()["scb"]
            return w.data.float() * scb.float().unsqueeze(1) / 127.0
        return bnb.functional.dequantize_4bit(w.data, w.quant_state).float()

    # ---------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        if isinstance(x, FakeTensor):
            # shape propagation and the cost model run under FakeTensorMode: bitsandbytes would cache fake state
            # in the layer; model its work instead (dequantized weight temporary + matmul, as its CPU path does)
            w = torch.empty(self.out_features, self.in_features, dtype=self.compute_dtype, device=x.device)
            y = torch.nn.functional.linear(x.to(self.compute_dtype), w)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y.to(dt)
        y = self.inner(x.to(self.compute_dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(dt)

    def extra_repr(self) -> str:
        s = f"in={self.in_features}, out={self.out_features}, kind={self.kind}, compute={self.compute_dtype}"
        if self.kind == "int8":
            s += f", threshold={self.threshold:g}"
        else:
            s += f", double_quant={self.double_quant}"
        return s


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update (LoRA; QLoRA when the base is 4-bit)."""

    fxmem_dtype_follow = True

    def __init__(self, base: nn.Module, in_features: int, out_features: int, *, rank: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0, device=None, seed: int = 0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.rank, self.alpha, self.scaling = int(rank), float(alpha), float(alpha) / float(rank)
        g = torch.Generator().manual_seed(seed)
        a = torch.empty(rank, in_features)
        bound = 1.0 / math.sqrt(in_features)  # kaiming-uniform(a=sqrt(5)) as nn.Linear / peft
        a.uniform_(-bound, bound, generator=g)
        self.lora_A = nn.Parameter(a.to(device) if device is not None else a)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=device))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        h = self.dropout(x).to(self.lora_A.dtype)
        upd = (h @ self.lora_A.t()) @ self.lora_B.t()
        return y + (upd * self.scaling).to(y.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"
