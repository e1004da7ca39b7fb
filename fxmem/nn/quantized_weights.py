"""A frozen weight stored in int8 or 4 bits by bitsandbytes, given back in full precision when the graph reads it.

The precision pass puts a `QuantizedWeight` where a graph read a convolution's weight, an embedding table or a
mixture of experts' 3-D expert weights (`passes.precision.weights: int8 | nf4 | fp4`): the `get_attr` of the
parameter becomes a call of this module, which dequantizes the whole weight (or one expert: `forward(index)`) and
hands it to the op that read it. int8 is LLM.int8()'s row-wise absmax; nf4/fp4 are bitsandbytes' 4-bit blocks on
the flattened weight. Everything it holds is a persistent buffer, so the cost model, `fxmem.measure` and a saved
result see every byte. Nothing here takes a gradient; in a module with the recast hooks the dequantized weight is
saved for backward as this recipe, so backward keeps the quantized bytes only.
Design: docs/design/precision.md, part 1 (weight quantization).
"""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from .remat import register_recompute

WEIGHT_KINDS = ("int8", "nf4", "fp4")
BLOCKSIZE = 64


def _functional():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes.functional as bnb_functional  # (optional heavy dependency)
    return bnb_functional


def int8_rows(shape: tuple[int, ...], row_dims: int = 1) -> int:
    """How many rows an int8 weight of this shape is scaled by: its first `row_dims` dims."""
    return math.prod(shape[:row_dims])


class QuantizedWeight(nn.Module):
    """A frozen weight held quantized; calling it gives the dequantized weight (or one slice of dim 0)."""

    fxmem_dequantizes = True  # the precision pass: a cast of its output is a call in that dtype instead

    def __init__(self, weight: torch.Tensor, kind: str = "nf4", *, row_dims: int = 1, blocksize: int = BLOCKSIZE):
        super().__init__()
        self._configure(kind, tuple(int(d) for d in weight.shape), weight.dtype, row_dims, blocksize)
        dense = weight.detach().to(torch.float32)
        functional = _functional()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "int8":
                qweight, scales, _ = functional.int8_vectorwise_quant(dense.reshape(self.rows(), -1).contiguous())
                self._put(qweight=qweight, scales=scales)
                return
            # flat: bitsandbytes 0.50's CPU dequantize_4bit gives wrong values for some 2-D and 3-D shapes (a last
            # dim below the block size); the flat layout is the same bytes and reads right
            packed, state = functional.quantize_4bit(dense.reshape(-1), blocksize=blocksize, compress_statistics=False,
                                             quant_type=kind)
        self._put(qweight=packed, absmax=state.absmax)

    @classmethod
    def for_loading(cls, shape: tuple[int, ...], kind: str, *, dtype: torch.dtype = torch.float32,
                    row_dims: int = 1, blocksize: int = BLOCKSIZE) -> "QuantizedWeight":
        """A module of this shape whose buffers are meta placeholders, for a saved result (the loader fills them)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(kind, tuple(shape), dtype, row_dims, blocksize)
        for name, (size, buffer_dtype) in self.buffer_specs().items():
            self.register_buffer(name, torch.empty(size, dtype=buffer_dtype, device="meta"))
        return self

    def _configure(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, row_dims: int, blocksize: int) -> None:
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"QuantizedWeight kind must be one of {WEIGHT_KINDS}, got {kind!r}")
        if len(shape) < 2 or min(shape) < 1:
            raise ValueError(f"QuantizedWeight needs a weight of 2 or more non-empty dims, got shape {shape}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"QuantizedWeight holds float32/bfloat16/float16 weights, got {dtype}")
        if not 1 <= row_dims < len(shape):
            raise ValueError(f"QuantizedWeight row_dims must be from 1 to {len(shape) - 1}, got {row_dims}")
        self.kind, self.shape, self.dtype, self.blocksize = kind, shape, dtype, int(blocksize)
        self.row_dims = int(row_dims)

    def rows(self) -> int:
        """How many rows an int8 weight is scaled by (`int8_rows`)."""
        return int8_rows(self.shape, self.row_dims)

    def _put(self, **tensors: torch.Tensor) -> None:
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor.contiguous())

    def buffer_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each buffer's shape and dtype, as quantization makes them (what a saved result must hold)."""
        numel = math.prod(self.shape)
        if self.kind == "int8":
            rows = self.rows()
            return {"qweight": ((rows, numel // rows), torch.int8), "scales": ((rows,), torch.float32)}
        return {"qweight": (((numel + 1) // 2, 1), torch.uint8),
                "absmax": ((-(-numel // self.blocksize),), torch.float32)}

    # ------------------------------------------------------------------------------------------- reading
    def dequantize(self, index: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in its dtype, or in `dtype` (`index`: only slice `index` of dim 0, see `sliceable`)."""
        if index is not None and not self.sliceable():
            raise ValueError(f"QuantizedWeight{self.shape} ({self.kind}): slices of dim 0 are not quantized apart")
        shape = self.shape if index is None else self.shape[1:]
        if self.kind == "int8":
            rows = self.rows() // (1 if index is None else self.shape[0])
            qweight, scales = self.qweight, self.scales
            if index is not None:
                qweight, scales = qweight[index * rows:(index + 1) * rows], scales[index * rows:(index + 1) * rows]
            full = _functional().int8_vectorwise_dequant(qweight, scales).view(shape)
            return full if (dtype or self.dtype) == torch.float32 else full.to(dtype or self.dtype)
        return self._dequantize_4bit(shape, index, dtype or self.dtype)

    def _dequantize_4bit(self, shape: tuple[int, ...], index: int | None, dtype: torch.dtype) -> torch.Tensor:
        functional = _functional()
        packed, absmax = self.qweight, self.absmax
        if index is not None:
            numel = math.prod(shape)
            packed = packed[index * numel // 2:(index + 1) * numel // 2]
            absmax = absmax[index * numel // self.blocksize:(index + 1) * numel // self.blocksize]
        state = functional.QuantState(absmax=absmax, shape=torch.Size((math.prod(shape),)), blocksize=self.blocksize,
                              quant_type=self.kind, dtype=dtype)
        return functional.dequantize_4bit(packed, state).view(shape)

    def sliceable(self) -> bool:
        """Whether one slice of dim 0 (one expert of a 3-D weight) dequantizes alone: each has rows (int8) or
        whole 4-bit blocks of its own."""
        per_slice = math.prod(self.shape[1:])
        return self.kind == "int8" or per_slice % self.blocksize == 0

    def forward(self, index: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized weight (or slice `index`), in `dtype` when given (the precision pass's compute dtype: the
        graph casts nothing)."""
        out = self.dequantize(index, dtype)
        register_recompute(out, self.dequantize, (index, dtype))  # backward dequantizes again instead of keeping it
        return out

    # ------------------------------------------------------------------------------------------- sizes
    def quantized_bytes(self) -> int:
        """Storage bytes of everything this module holds."""
        return sum(int(t.untyped_storage().nbytes()) for t in self.buffers())

    def dense_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"shape={self.shape}, dtype={dtype}, kind={self.kind}, row_dims={self.row_dims}"
                + ("" if self.kind == "int8" else f", blocksize={self.blocksize}"))
