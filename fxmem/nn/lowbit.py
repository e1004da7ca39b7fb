"""Low-bit linear layers that the precision pass puts into graphs: bitsandbytes wrappers and LoRA adapters.

`QuantLinear` holds a bitsandbytes `Linear8bitLt` (LLM.int8()) or `Linear4bit` (nf4/fp4) built from an fp32 weight:
callable like `aten.linear` in any float dtype, its quantization state visible to the cost model as buffers,
movable with `.to`, saved and rebuilt exactly (`quantized_state`, `load_quantized_state`, `for_loading`), and one
4-bit layout in every mode (`standard_4bit_layout`). `LoRALinear` adds a trainable low-rank update to a frozen base
(QLoRA on a 4-bit base); `FrozenLinear` is the base where the guard reverted the 4-bit weights. Quantized weights
are frozen; the input gradient flows through.
Design: docs/design/precision.md, "The low-bit modules".
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

QUANT_KINDS = ("int8", "nf4", "fp4")


def _bnb():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes as bnb  # (optional heavy dependency: loaded when a quantized layer is made)
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
        out_f, in_f = weight.shape
        self._set_shape(kind, int(in_f), int(out_f), threshold, double_quant, compute_dtype)
        inner = self._empty_inner()
        device = weight.device
        # bitsandbytes' Int8Params quantizes on a move from the CPU only (one already on the GPU stays fp32 until
        # the first call, and its row scales then live where the aux buffers do not see them): start it there
        fp32_weight = weight.detach().to(device="cpu" if kind == "int8" else device, dtype=torch.float32, copy=True)
        bnb = _bnb()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "int8":
                inner.weight = bnb.nn.Int8Params(fp32_weight, requires_grad=False, has_fp16_weights=False)
            else:
                inner.weight = bnb.nn.Params4bit(fp32_weight, requires_grad=False, compress_statistics=double_quant,
                                                 quant_type=kind)
            inner = inner.to(device)  # quantizes
        self.inner = inner
        # the bias is added here, not by bitsandbytes (its CPU 4-bit path adds it in place, which fails when
        # autograd records the matmul)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32).clone(),
                                                           requires_grad=False)
        self._keep_standard_layout()
        with torch.no_grad():  # bitsandbytes caches state on the first call (int8): make that call a real one
            self(torch.zeros(1, in_f, dtype=compute_dtype, device=device))

    @classmethod
    def for_loading(cls, in_features: int, out_features: int, kind: str = "int8", *, threshold: float = 6.0,
                    double_quant: bool = True, compute_dtype: torch.dtype = torch.float32,
                    bias: bool = False) -> "QuantLinear":
        """A layer of this shape with no weight yet, for a saved result (`fxmem.load`): `load_quantized_state` gives
        it its bitsandbytes weight, the loader its bias (a meta placeholder until then)."""
        if kind not in QUANT_KINDS:
            raise ValueError(f"QuantLinear kind must be one of {QUANT_KINDS}, got {kind!r}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set_shape(kind, int(in_features), int(out_features), threshold, double_quant, compute_dtype)
        self.inner = self._empty_inner()
        self.inner._parameters["weight"] = None
        self.bias = (nn.Parameter(torch.empty(self.out_features, device="meta"), requires_grad=False) if bias
                     else None)
        return self

    def _set_shape(self, kind: str, in_features: int, out_features: int, threshold: float, double_quant: bool,
                   compute_dtype: torch.dtype) -> None:
        self.kind = kind
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.threshold = float(threshold)
        self.double_quant = bool(double_quant)

    def _empty_inner(self) -> nn.Module:
        """The bitsandbytes layer for this kind and shape, its weight still on the meta device."""
        bnb = _bnb()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.kind == "int8":
                return bnb.nn.Linear8bitLt(self.in_features, self.out_features, bias=False, has_fp16_weights=False,
                                           threshold=self.threshold, device="meta")
            return bnb.nn.Linear4bit(self.in_features, self.out_features, bias=False,
                                     compute_dtype=self.compute_dtype, compress_statistics=self.double_quant,
                                     quant_type=self.kind, device="meta")

    # ---------------------------------------------------------------------------------------- bookkeeping
    def aux_tensors(self) -> dict[str, torch.Tensor]:
        """Quantization state bitsandbytes keeps outside parameters (row scales, absmax, codes)."""
        weight = self.inner.weight
        out: dict[str, torch.Tensor] = {}
        if self.kind == "int8":
            scb = getattr(weight, "SCB", None)
            if scb is None:
                scb = getattr(getattr(self.inner, "state", None), "SCB", None)
            if isinstance(scb, torch.Tensor):
                out["scb"] = scb
            return out
        quant_state = getattr(weight, "quant_state", None)
        if quant_state is None:
            return out
        for name in ("absmax", "code", "offset"):
            tensor = getattr(quant_state, name, None)
            if isinstance(tensor, torch.Tensor):
                out[f"q_{name}"] = tensor
        nested_state = getattr(quant_state, "state2", None)
        if nested_state is not None:
            for name in ("absmax", "code"):
                tensor = getattr(nested_state, name, None)
                if isinstance(tensor, torch.Tensor):
                    out[f"q2_{name}"] = tensor
        return out

    def _sync_aux(self) -> None:
        for name in [n for n in self._buffers if n.startswith(("scb", "q_", "q2_"))]:
            del self._buffers[name]
        for name, tensor in self.aux_tensors().items():
            self.register_buffer(name, tensor, persistent=False)
        state = getattr(self.inner.weight, "quant_state", None)
        # what a trace needs besides tensors (it swaps the weight for one without a quant state)
        self._layout_4bit = None if state is None else _Layout4bit.of(state)

    def _keep_standard_layout(self) -> None:
        """Switch off bitsandbytes' eval-mode CPU repack on the inner layer (for code that calls `inner` itself) and
        restore the standard layout if the weight is in the CPU one; the aux buffers are (re-)read."""
        if self.kind != "int8":
            self.inner.support_avx512bf16_for_cpu = False  # Linear4bit.forward repacks only when this is true
        if not self._restore_standard_layout():
            self._sync_aux()

    def _restore_standard_layout(self) -> bool:
        """Put a 4-bit weight found in bitsandbytes' CPU inference layout back in the standard one (no change to
        the weights it computes with) and re-read the aux buffers; True when it did."""
        weight = self.inner.weight
        if self.kind == "int8" or not getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
            return False
        weight.data, weight.quant_state = standard_4bit_layout(weight.data, weight.quant_state)
        weight.compress_statistics = False
        self.inner.quant_state = weight.quant_state
        self.double_quant = False
        self._sync_aux()
        return True

    def _apply(self, fn, recurse=True):
        # move the bitsandbytes layer with its own .to (Params4bit / Int8Params carry their state), then re-read
        # the aux tensors, so that nothing is copied twice
        self._restore_standard_layout()  # Params4bit.to keeps the CPU layout, which other devices cannot run
        for name in [n for n in self._buffers if n.startswith(("scb", "q_", "q2_"))]:
            del self._buffers[name]
        self.inner._apply(fn, recurse)
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.data), requires_grad=False)
        self._sync_aux()
        return self

    # ---------------------------------------------------------------------------------------- saving
    _AUX_PREFIXES = ("scb", "q_", "q2_")

    def quantized_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The bitsandbytes weight as data, for saving: (tensors, fields).

        tensors are named as in this module's state_dict: int8 `inner.weight` (int8) and `inner.SCB` (row scales);
        4-bit `inner.weight` (packed uint8) and `inner.weight.<key>` for each item of bitsandbytes'
        `QuantState.as_dict(packed=True)` (absmax, quant_map, nested_absmax, nested_quant_map and
        `quant_state.bitsandbytes__<type>`, its non-tensor fields as JSON in a uint8 tensor). fields is JSON data:
        the kind and the `Params4bit` attributes. The weight is in the standard layout (see the module docstring);
        `load_quantized_state` also reads the CPU layout older fxmem versions saved (`cpu_packed`)."""
        bnb = _bnb()
        self._restore_standard_layout()
        weight = self.inner.weight
        if self.kind == "int8":
            if not isinstance(weight, bnb.nn.Int8Params) or weight.dtype != torch.int8:
                raise ValueError(f"QuantLinear(int8): the weight is not a quantized Int8Params "
                                 f"({type(weight).__name__}, {weight.dtype})")
            scb = self.aux_tensors().get("scb")
            if scb is None:
                raise ValueError("QuantLinear(int8): the weight has no row scales (SCB)")
            return {"inner.weight": weight.data, "inner.SCB": scb.clone()}, {"kind": "int8",
                                                                              "tensors": ["inner.SCB", "inner.weight"]}
        quant_state = getattr(weight, "quant_state", None)
        if (not isinstance(weight, bnb.nn.Params4bit) or quant_state is None
                or not getattr(weight, "bnb_quantized", False)):
            raise ValueError(f"QuantLinear({self.kind}): the weight is not a quantized Params4bit "
                             f"({type(weight).__name__})")
        tensors = {"inner.weight": weight.data}
        for key, value in quant_state.as_dict(packed=True).items():
            # small; some are shared between layers (safetensors refuses)
            tensors[f"inner.weight.{key}"] = value.clone()
        fields: dict = {"kind": self.kind, "tensors": sorted(tensors),
                        "param": {"blocksize": int(weight.blocksize),
                                  "compress_statistics": bool(weight.compress_statistics),
                                  "quant_type": str(weight.quant_type),
                                  "quant_storage": _dtype_name(weight.quant_storage)}}
        return tensors, fields

    @contextlib.contextmanager
    def without_quantized_state(self):
        """Within: the bitsandbytes weight (None), its quantization state and the aux buffers are taken out of the
        module, so describing (or pickling) it stores the structure only (`quantized_state()` has the data); put
        back on exit."""
        inner = self.inner
        weight = inner._parameters.get("weight")
        aux = {n: t for n, t in self._buffers.items() if n.startswith(self._AUX_PREFIXES)}
        inner_dict = {k: inner.__dict__[k] for k in ("state", "quant_state") if k in inner.__dict__}
        try:
            inner._parameters["weight"] = None
            for name in aux:
                del self._buffers[name]
                self._non_persistent_buffers_set.discard(name)
            if "state" in inner_dict:  # MatmulLtState: CB is the weight, SCB the scales, the rest per-call caches
                state = copy.copy(inner_dict["state"])
                for attr, value in list(vars(state).items()):
                    if isinstance(value, torch.Tensor):
                        setattr(state, attr, None)
                inner.__dict__["state"] = state
            if inner_dict.get("quant_state") is not None:
                inner.__dict__["quant_state"] = None
            yield self
        finally:
            inner._parameters["weight"] = weight
            inner.__dict__.update(inner_dict)
            for name, tensor in aux.items():
                self._buffers[name] = tensor
                self._non_persistent_buffers_set.add(name)

    def load_quantized_state(self, tensors: dict[str, torch.Tensor], fields: dict) -> None:
        """Rebuild the bitsandbytes weight from what `quantized_state()` gave (same parameter types, same state:
        the layer computes what the saved one did). Tensors stay on the device they are on."""
        bnb = _bnb()
        kind = fields.get("kind")
        if kind != self.kind:
            raise ValueError(f"QuantLinear({self.kind}): the saved state is for {kind!r}")
        missing = [k for k in fields.get("tensors", ["inner.weight"]) if k not in tensors]
        if missing:
            raise ValueError(f"QuantLinear({self.kind}): no saved tensor for {', '.join(missing)}")
        data = tensors["inner.weight"]
        inner = self.inner
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "int8":
                if data.dtype != torch.int8:
                    raise ValueError(f"QuantLinear(int8): the saved weight is {data.dtype}, not int8")
                scb = tensors["inner.SCB"].to(torch.float32)
                inner._parameters["weight"] = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False,
                                                                CB=data, SCB=scb)
                inner.init_8bit_state()  # the scales live in the layer's state, as after its first call
            else:
                qs_dict = {k[len("inner.weight."):]: v for k, v in tensors.items() if k.startswith("inner.weight.")}
                weight = bnb.nn.Params4bit.from_prequantized(data, qs_dict, requires_grad=False, device=data.device)
                param = fields.get("param", {})
                weight.blocksize = int(param.get("blocksize", weight.blocksize))
                weight.compress_statistics = bool(param.get("compress_statistics", weight.compress_statistics))
                if "quant_storage" in param:
                    weight.quant_storage = _dtype(param["quant_storage"])
                packed = fields.get("cpu_packed")
                if packed:
                    quant_state = weight.quant_state
                    quant_state.packing_format_for_cpu = True
                    quant_state.original_dtype = _dtype(packed["original_dtype"])
                    quant_state.original_nested = bool(packed["original_nested"])
                    quant_state.original_qshape = torch.Size(packed["original_qshape"])
                    if packed.get("original_storage_type"):
                        quant_state.original_storage_type = _dtype(packed["original_storage_type"])
                inner._parameters["weight"] = weight
        self._keep_standard_layout()

    def weight_bytes(self) -> int:
        """Storage bytes of the quantized weight, its quantization state and the bias."""
        seen, total = set(), 0
        tensors = [self.inner.weight] + list(self.aux_tensors().values())
        if self.bias is not None:
            tensors.append(self.bias)
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += int(storage.nbytes())
        return total

    def dense_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        count = self.in_features * self.out_features + (self.out_features if self.bias is not None else 0)
        return count * torch.empty((), dtype=dtype).element_size()

    def dequantized_weight(self) -> torch.Tensor:
        bnb = _bnb()
        self._restore_standard_layout()
        weight = self.inner.weight
        if self.kind == "int8":
            scb = self.aux_tensors()["scb"]
            return weight.data.float() * scb.float().unsqueeze(1) / 127.0
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()

    # ---------------------------------------------------------------------------------------- forward
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        dtype = inputs.dtype
        if isinstance(inputs, FakeTensor) or torch.compiler.is_exporting():
            return self._traced(inputs).to(dtype)
        if self.kind == "int8":
            output = self.inner(inputs.to(self.compute_dtype))
        else:
            output = self._matmul_4bit(inputs.to(self.compute_dtype))
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output.to(dtype)

    def _traced(self, inputs: torch.Tensor) -> torch.Tensor:
        """What a trace (torch.export, the cost model's fake tensors) records: bitsandbytes would cache fake state
        in the layer. 4-bit: the ops its CPU matmul runs, on this module's own parameter and buffers (the same
        values, bit for bit, and a captured program that computes them). int8: the work (a dequantized weight
        temporary and a matmul); its outlier decomposition cannot be recorded, so an export is refused."""
        if self.kind == "int8":
            if torch.compiler.is_exporting():
                raise NotImplementedError(
                    "an int8 QuantLinear cannot be captured (bitsandbytes' outlier decomposition has data-dependent "
                    "shapes): capture the model before quantizing it, or quantize to nf4/fp4")
            weight = torch.empty(self.out_features, self.in_features, dtype=self.compute_dtype, device=inputs.device)
        else:
            weight = self._dequantized_from_buffers().to(self.compute_dtype)
        output = torch.nn.functional.linear(inputs.to(self.compute_dtype), weight)
        return output if self.bias is None else output + self.bias.to(output.dtype)

    def _dequantized_from_buffers(self) -> torch.Tensor:
        """`bitsandbytes.functional.dequantize_4bit` of the weight, reading the parameter and the aux buffers
        (`_sync_aux`), which a trace swaps for its own, rather than the quant state, which it does not see."""
        packed, layout = self.inner.weight, self._layout_4bit
        absmax = self.q_absmax
        if layout.nested_blocksize:
            functional = _bnb().functional
            outer = functional.QuantState(absmax=self.q2_absmax, code=self.q2_code, blocksize=layout.nested_blocksize,
                                  dtype=layout.nested_dtype)
            absmax = (functional.dequantize_blockwise(absmax, outer) + self.q_offset).float()
        weight = torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, layout.blocksize, layout.quant_type,
                                                                 layout.shape, layout.dtype)
        return weight.t() if packed.shape[0] == 1 else weight

    def _matmul_4bit(self, inputs: torch.Tensor) -> torch.Tensor:
        """bitsandbytes' 4-bit matmul on the standard layout, with autograd, in every mode and on every device
        (`Linear4bit.forward` minus its eval-mode CPU repack; `weight.t()` as older bitsandbytes' `Linear4bit`
        passes it, which 0.50 takes too)."""
        self._restore_standard_layout()
        weight = self.inner.weight
        return _bnb().matmul_4bit(inputs, weight.t(), quant_state=weight.quant_state)

    def extra_repr(self) -> str:
        text = f"in={self.in_features}, out={self.out_features}, kind={self.kind}, compute={self.compute_dtype}"
        if self.kind == "int8":
            text += f", threshold={self.threshold:g}"
        else:
            text += f", double_quant={self.double_quant}"
        return text


@dataclasses.dataclass(frozen=True)
class _Layout4bit:
    """The scalars of a bitsandbytes 4-bit quant state (nested_blocksize 0: absmax not double-quantized)."""
    blocksize: int
    quant_type: str
    shape: torch.Size
    dtype: torch.dtype
    nested_blocksize: int
    nested_dtype: torch.dtype | None

    @classmethod
    def of(cls, state) -> "_Layout4bit":
        nested = state.state2 if state.nested else None
        return cls(int(state.blocksize), state.quant_type, torch.Size(state.shape), state.dtype,
                   int(nested.blocksize) if nested else 0, nested.dtype if nested else None)


def standard_4bit_layout(data: torch.Tensor, quant_state) -> tuple[torch.Tensor, object]:
    """A 4-bit weight in bitsandbytes' CPU inference layout (`packing_format_for_cpu`) back in the standard layout,
    computing with the same weights: the 4-bit codes in their original order (bitsandbytes' inverse) and the absmax
    the CPU layout holds (bf16 values, one per block) as fp32, not double-quantized. bitsandbytes' own inverse
    re-quantizes a nested absmax (the weights change) and leaves a plain one transposed in bf16 (the weights are
    wrong). The quantization state is updated in place and returned with the weight data."""
    inverse = _bnb().functional._convert_weight_packed_for_cpu_inverse
    absmax = quant_state.absmax  # (in_features / blocksize, out_features), bf16
    quant_state.original_nested = False  # the inverse then leaves absmax alone
    data, quant_state = inverse(data, quant_state)
    quant_state.absmax = absmax.t().reshape(-1).to(torch.float32).contiguous()
    quant_state.nested, quant_state.offset, quant_state.state2 = False, None, None
    return data, quant_state


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


class FrozenLinear(nn.Module):
    """A frozen dense linear computing in `compute_dtype` (input cast to it, output cast back, as `QuantLinear`):
    weight (out, in), or (in, out) with `transposed` (HF Conv1D, `aten.addmm`); the given tensors are held, not
    copied."""

    fxmem_dtype_follow = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, transposed: bool = False,
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"FrozenLinear needs a 2-D weight, got shape {tuple(weight.shape)}")
        self.transposed = bool(transposed)
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        rows, cols = (int(d) for d in weight.shape)
        self.in_features, self.out_features = (rows, cols) if transposed else (cols, rows)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        output = torch.nn.functional.linear(inputs.to(self.compute_dtype), weight.t() if self.transposed else weight,
                                            bias)
        return output.to(inputs.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, compute={self.compute_dtype}, "
                f"transposed={self.transposed}")


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
        generator = torch.Generator().manual_seed(seed)
        lora_a = torch.empty(rank, in_features)
        bound = 1.0 / math.sqrt(in_features)  # kaiming-uniform(a=sqrt(5)) as nn.Linear / peft
        lora_a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(lora_a.to(device) if device is not None else lora_a)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=device))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        for param in self.base.parameters():
            param.requires_grad_(False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        base_output = self.base(inputs)
        dropped = self.dropout(inputs).to(self.lora_A.dtype)
        upd = (dropped @ self.lora_A.t()) @ self.lora_B.t()
        return base_output + (upd * self.scaling).to(base_output.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"
