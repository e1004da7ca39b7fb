"""What the policy asks of the precision pass: its options, their checks, and the op groups `keep_fp32` names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from fxmem import ops as optable
from fxmem.errors import PolicyError


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}

# keep-fp32 op groups (names usable in `keep_fp32`), as torch.autocast keeps them in fp32
KEEP_GROUPS: dict[str, tuple[str, ...]] = {
    "softmax": ("softmax", "_softmax"),
    "log_softmax": ("log_softmax", "_log_softmax"),
    "norm": ("layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "rms_norm", "_fused_rms_norm",
             "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
             "_batch_norm_with_update", "_native_batch_norm_legit_no_training", "_batch_norm_no_update",
             "instance_norm"),
    "exp_log_pow": ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "pow", "rsqrt", "reciprocal",
                    "softplus", "erfinv", "sinh", "cosh", "tan", "acos", "asin"),
    "cumsum": ("cumsum", "cumprod"),
    "reduction": ("sum", "mean", "prod", "logsumexp", "var", "std", "var_mean", "std_mean", "norm",
                  "linalg_vector_norm", "dist", "cdist", "renorm"),
    "loss": (),  # every op of fxmem.ops category LOSS
}
# fxmem.ops category names are accepted too (e.g. "normalization" = softmax + norms in the op table)
CATEGORY_NAMES = (optable.NORM, optable.REDUCTION, optable.LOSS, optable.POINTWISE, optable.INDEXING, optable.COPY)
DEFAULT_KEEP = ["softmax", "log_softmax", "norm", "exp_log_pow", "cumsum", "reduction", "loss"]
DEFAULT_SKIP = ["lm_head", "*.lm_head", "classifier", "*.classifier", "*.classifier.*", "score", "*.score"]


@dataclass
class QLoRAOptions:
    """QLoRA: frozen 4-bit base linears plus trainable LoRA adapters on the `targets` module patterns."""
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["*"])


@dataclass
class PrecisionOptions:
    """passes.precision: compute dtype, fp32 islands, parameter dtype, bitsandbytes weights, QLoRA, guard."""
    compute: Literal["fp32", "bf16", "fp16"] = "bf16"
    keep_fp32: list[str] = field(default_factory=lambda: list(DEFAULT_KEEP))
    keep_fp32_modules: list[str] = field(default_factory=list)
    islands: Literal["compact", "autocast"] = "compact"
    params: Literal["fp32", "bf16"] = "fp32"
    recast_params: bool = True  # training, fp32 params: backward re-casts weights/inputs instead of saving copies
    weights: Literal["none", "fp32", "int8", "nf4", "fp4"] = "none"  # "fp32" = "none": weights not quantized
    double_quant: bool = True
    int8_threshold: float = 6.0
    skip_modules: list[str] = field(default_factory=lambda: list(DEFAULT_SKIP))
    min_params: int = 4096
    qlora: QLoRAOptions | None = None
    tolerance: float | None = None  # end-to-end relative output error; None = kind default / verify.lossy_tolerance
    guard: bool = True  # false: every change applied as asked, unjudged
    loss_steps: int = 2  # training: loss after this many AdamW steps vs fp32 (0 = skip)
    report_estimate: bool = True  # cost-model estimate before/after in metrics (two static traces)


def keep_ops(keep: list[str], where: str = "passes.precision.keep_fp32") -> tuple[frozenset, frozenset]:
    """(aten packet names, fxmem.ops categories) the keep_fp32 list names; unknown entries raise PolicyError."""
    names, cats = set(), set()
    for entry in keep:
        if entry in KEEP_GROUPS:
            names.update(KEEP_GROUPS[entry])
            if entry == "loss":
                cats.add(optable.LOSS)
        elif entry in CATEGORY_NAMES:
            cats.add(entry)
        elif entry.startswith("aten."):
            names.add(entry.split(".")[1])
        else:
            raise PolicyError(f"{where}: unknown entry {entry!r}; use one of {sorted(KEEP_GROUPS)}, an fxmem.ops "
                              f"category ({', '.join(CATEGORY_NAMES)}) or an op name like 'aten.gelu'")
    return frozenset(names), frozenset(cats)


def validate(opts: PrecisionOptions) -> None:
    keep_ops(opts.keep_fp32)
    if opts.params == "bf16" and opts.compute != "bf16":
        raise PolicyError(f"passes.precision.params: bf16 parameters need compute: bf16 (got compute: "
                          f"{opts.compute})")
    if opts.tolerance is not None and not (opts.tolerance > 0):
        raise PolicyError(f"passes.precision.tolerance must be > 0, got {opts.tolerance}")
    if opts.min_params < 0:
        raise PolicyError(f"passes.precision.min_params must be >= 0, got {opts.min_params}")
    if opts.qlora is not None:
        if opts.qlora.rank < 1:
            raise PolicyError(f"passes.precision.qlora.rank must be >= 1, got {opts.qlora.rank}")
        if opts.weights == "int8":
            raise PolicyError("passes.precision.qlora needs 4-bit base weights (weights: nf4 or fp4), got int8")


def weight_kind(opts: PrecisionOptions) -> str | None:
    """int8 / nf4 / fp4 when weights are quantized (QLoRA without `weights` means nf4), else None."""
    kind = opts.weights if opts.weights not in ("none", "fp32") else None
    return "nf4" if kind is None and opts.qlora is not None else kind
