"""The compute plan: a class (low, fp32 island, fp32-accumulating, follow, ...) for every node that touches a float
tensor, from the options and what each kernel can do."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from fxmem import ops as optable
from fxmem.node_value import node_value
from fxmem.program import module_path

from .nodes import matching_pattern, node_args, orig_float_dtype
from .options import DTYPE_NAMES, PrecisionOptions, keep_ops

aten = torch.ops.aten


# kernels that accumulate in fp32 for bf16/fp16 inputs (opmath), so running them on the low-precision input is
# an fp32 computation with one rounding of the result. fp16 keeps reductions upcast (their results can overflow).
BATCH_NORMS = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                         "_native_batch_norm_legit_functional", "_batch_norm_with_update",
                         "_native_batch_norm_legit_no_training", "_batch_norm_no_update"})
ACC_BF16 = frozenset({"softmax", "_softmax", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
                      "rms_norm", "_fused_rms_norm", "sum", "mean", "cumsum"}) | BATCH_NORMS
ACC_FP16 = frozenset({"softmax", "_softmax", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
                      "rms_norm", "_fused_rms_norm"})

CAST_OPS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout}


LOW, FP32, ACC, FOLLOW, OPAQUE, RETARGET, INPLACE = "low", "fp32", "acc", "follow", "opaque", "retarget", "inplace"


@dataclass
class Decision:
    node: str
    module: str
    op: str
    cls: str
    reason: str


def classify(graph_module: fx.GraphModule, node: fx.Node, opts: PrecisionOptions, keep_names, keep_cats,
             low: torch.dtype, reverted: set) -> Decision:
    """The class of one call node (see the module docstring)."""
    path = module_path(node)
    if node.op == "call_module":
        mod = graph_module.get_submodule(node.target)
        if getattr(mod, "fxmem_dtype_follow", False):
            return Decision(node.name, path, str(node.target), FOLLOW, "module follows its input dtype")
        return Decision(node.name, path, str(node.target), OPAQUE, f"opaque module {type(mod).__name__}: inputs in "
                                                           f"their original dtype")
    target = node.target
    if target is operator.getitem:
        return Decision(node.name, path, "getitem", FOLLOW, "")
    if not isinstance(target, torch._ops.OpOverload):
        return Decision(node.name, path, str(getattr(target, "__name__", target)), OPAQUE,
                        "not an aten op: original dtypes")
    name = optable.packet(target)
    opname = f"aten.{name}"
    if target._schema.is_mutable:
        if name.endswith("_") and node.args and isinstance(node.args[0], fx.Node):
            return Decision(node.name, path, opname, INPLACE, "in-place op: runs in the dtype of the tensor it mutates")
        return Decision(node.name, path, opname, OPAQUE, "mutates an input: original dtypes")
    if target in CAST_OPS and _is_float_noop_cast(node):
        return Decision(node.name, path, opname, RETARGET, "float-to-float cast that is a no-op in the fp32 graph "
                                                        "follows the plan")
    pat = matching_pattern(path, opts.keep_fp32_modules) if path else None
    if pat is not None:
        return Decision(node.name, path, opname, FP32, f"module matches keep_fp32_modules {pat!r}")
    cat = optable.category(target)
    if node.name in reverted:
        return Decision(node.name, path, opname, FP32, "reverted by the accuracy guard")
    if cat in (optable.MATMUL, optable.ATTENTION):
        return Decision(node.name, path, opname, LOW, f"{cat} op runs in {DTYPE_NAMES[low]}")
    if name in keep_names or cat in keep_cats:
        acc = ACC_BF16 if low == torch.bfloat16 else ACC_FP16
        if opts.islands == "compact" and name in acc:
            return Decision(node.name, path, opname, ACC, f"keep_fp32 op; its kernel accumulates in fp32 for "
                                                       f"{DTYPE_NAMES[low]} inputs (compact island)")
        return Decision(node.name, path, opname, FP32, "keep_fp32 op: fp32 island")
    return Decision(node.name, path, opname, FOLLOW, "")


def _is_float_noop_cast(node: fx.Node) -> bool:
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node):
        return False
    source_dtype, cast_dtype = orig_float_dtype(src), orig_float_dtype(node)
    if source_dtype is None or cast_dtype is None or source_dtype != cast_dtype:
        return False
    kwargs = dict(node.kwargs)
    kwargs.pop("dtype", None)
    kwargs.pop("layout", None)
    if kwargs.get("device") not in (None,) and node_value(src) is not None \
            and torch.device(kwargs["device"]) != node_value(src).device:
        return False
    kwargs.pop("device", None)
    kwargs.pop("copy", None)
    kwargs.pop("non_blocking", None)
    return not kwargs.get("memory_format")


def plan(graph_module: fx.GraphModule, opts: PrecisionOptions, low: torch.dtype, reverted: set = frozenset()) \
        -> dict[str, Decision]:
    keep_names, keep_cats = keep_ops(opts.keep_fp32)
    out = {}
    for node in graph_module.graph.nodes:
        if node.op in ("call_function", "call_module"):
            if orig_float_dtype(node) is None and not any(orig_float_dtype(a) is not None for a in node_args(node)):
                continue  # no float tensor in or out (shapes, masks, indices)
            out[node.name] = classify(graph_module, node, opts, keep_names, keep_cats, low, reverted)
    return out
