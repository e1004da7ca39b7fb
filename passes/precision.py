"""Precision assignment: a dtype for every edge of the graph, chosen from the policy's intent and what the kernels
can do, with the error of every decision measured and reverted when it exceeds the tolerance.

The policy says *what it wants* (`compute: bf16`, which op categories and module paths must stay fp32, which
linears to quantize); the pass decides *what is possible* per node (the design of torch.ao's FX quantization:
intent apart from capability). Four parts, each a small function over the graph:

1. Weight quantization (`weights: int8 | nf4 | fp4`, or `qlora:`): `aten.linear(x, W, b)` sites whose weight is a
   parameter, and `aten.addmm(b, x, W)` sites with parameter bias and weight (HF Conv1D, W stored (in, out)),
   become a `call_module` to `fxmem.nn.lowbit.QuantLinear` (bitsandbytes `Linear8bitLt` with the
   LLM.int8() outlier threshold, or `Linear4bit` with optional double quantization). Skip rules: module patterns
   (`skip_modules`: lm_head / classifier / score by default), layers under `min_params` weights, tied weights.
   Other large weights (convolutions, embedding tables, 3-D expert weights) stay in full precision: the intent
   names them with the ops that use them (`fxmem.weights_left`), in the report's warnings and the CLI summary.
   The state_dict changes for swapped layers only: `<path>.weight` becomes `<path>.inner.weight` (int8 / uint8
   packed) plus bitsandbytes' own state keys (`<path>.inner.SCB`, `<path>.inner.weight.absmax`, ...); every other
   name is kept. QLoRA wraps the 4-bit base in `LoRALinear` (`<path>.lora_A`, `<path>.lora_B`) and freezes every
   other parameter. A targeted linear whose 4-bit weights the guard reverts keeps its adapter, on its own weight
   (`FrozenLinear`, `<path>.base.weight`): the adapters train as asked; QLoRA with no adapter is a PolicyError.
2. Compute precision (`compute: bf16 | fp16`): every call node is classified
   - LOW: matmul-class ops (`fxmem.ops` category MATMUL, and SDPA, which stays one fused node): inputs cast to
     the low dtype;
   - FP32 island: ops in `keep_fp32` (op categories as autocast keeps them, or raw `aten.<op>` names) and every
     op under a `keep_fp32_modules` pattern: inputs cast to fp32;
   - ACC ("compact" islands only): keep-fp32 ops whose CPU/CUDA kernels already accumulate in fp32 for
     bf16/fp16 inputs (softmax, layer/group/rms norm, sum/mean, cumsum; verified here: their bf16 result equals
     `op(x.float()).bfloat16()` up to ties) run on the low-precision input, so autograd saves low-precision
     tensors, not an fp32 copy;
   - FOLLOW: everything else keeps its inputs' dtype; where float inputs disagree a cast is inserted (to the low
     dtype in `compact` mode, to the wider dtype in `autocast` mode, which is torch's type promotion made
     explicit).
   `islands: autocast` reproduces torch.autocast: parameters are cast only at matmul-class ops and fp32 islands
   keep their fp32 outputs. `islands: compact` (default) also casts parameters at every other use, so
   activations are stored in the low dtype except inside the islands. Model-written float-to-float casts
   (`x.to(q.dtype)`, `.float()` on an fp32 value: no-ops in the fp32 graph) follow the plan. Graph outputs are
   cast back to their original dtype, so the loss is computed in fp32. Redundant cast pairs are removed.
   A value that may hold finite numbers beyond the low dtype's range (an attention mask of `finfo(float32).min`)
   is cast saturating, so it still masks instead of turning into -inf (`fxmem.extreme_values`).
   `params: bf16` stores the parameters in bf16 (use `fxmem.make_optimizer`, which keeps fp32 master weights and
   fp32 optimizer state for them); `params: fp32` (default) keeps fp32 master parameters (autocast semantics:
   gradients reach the fp32 parameters through the casts).
3. Accuracy guard (`fxmem.lossguard`): each kind of change, the weights (`int8`, or `4bit` for nf4/fp4) and then
   the compute plan (`compute`), is applied whole and judged end to end against the program before it, on the
   calibration (or example) inputs: top-1 agreement for class-score outputs, relative output error, the loss or the
   user's evaluate(). When the guard refuses, the sites whose own error is largest (each re-run on the fp32 values
   of its inputs) go back to their precision first, 1, 2, 4, ... of them, until it accepts; each such site is a
   Change saying why, and a shortfall is an Intent (what was asked, what was achieved, the setting to change).
   `tolerance` is this pass's end-to-end relative-error limit (unset: the kind's default or
   verify.lossy_tolerance); `guard: false` applies everything unjudged. The whole-model output deviation and, in
   training, the loss after `loss_steps` optimizer steps are reported against the pass's input.
4. fp16 needs loss scaling in training (gradients underflow): the pass adds a note; use
   `torch.amp.GradScaler` (tested here on CPU).

The pass is lossy (`exact = False`): the PassManager rolls it back when a verdict it returns refuses.
"""
from __future__ import annotations

import copy
import fnmatch
import math
import operator
import uuid
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxmem import ops as optable
from fxmem.compare import deviation
from fxmem.errors import PolicyError
from fxmem.extreme_values import beyond_range, saturating_cast
from fxmem.intent import Intent, guard_stop
from fxmem.lossguard import exclusion_steps, first_accepted, guard_for, guard_items
from fxmem.nn.lowbit import FrozenLinear, LoRALinear, QuantLinear
from fxmem.nn.recast import cast_param, install as install_recast
from fxmem.optim import make_optimizer
from fxmem.pass_api import Change, Pass, PassContext, PassResult, register
from fxmem.program import Program, deep_copy, module_path
from fxmem.weights_left import describe as describe_weights_left, weights_left
from fxmem.step import compute_loss

aten = torch.ops.aten

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}

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
# guard items each site's own error is measured on (it only orders the back-off; every site's inputs and outputs are
# held for each item, so few)
SITE_ITEMS = 2


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


# ============================================================================================ small helpers

def _val(n):
    return n.meta.get("fxmem_val", n.meta.get("val")) if isinstance(n, fx.Node) else None


def orig_float_dtype(n: fx.Node) -> torch.dtype | None:
    """The float dtype of a node's (first float) output in the graph as it is now, or None."""
    for t in pytree.tree_leaves(_val(n)):
        if isinstance(t, torch.Tensor):
            return t.dtype if t.is_floating_point() else None
    return None


def _matches(path: str, patterns) -> str | None:
    for p in patterns:
        if path == p or fnmatch.fnmatchcase(path, p) or path.startswith(p + "."):
            return p
    return None


def keep_ops(keep: list[str], where: str = "passes.precision.keep_fp32") -> tuple[frozenset, frozenset]:
    """(aten packet names, fxmem.ops categories) the keep_fp32 list names; unknown entries raise PolicyError."""
    names, cats = set(), set()
    for k in keep:
        if k in KEEP_GROUPS:
            names.update(KEEP_GROUPS[k])
            if k == "loss":
                cats.add(optable.LOSS)
        elif k in CATEGORY_NAMES:
            cats.add(k)
        elif k.startswith("aten."):
            names.add(k.split(".")[1])
        else:
            raise PolicyError(f"{where}: unknown entry {k!r}; use one of {sorted(KEEP_GROUPS)}, an fxmem.ops "
                              f"category ({', '.join(CATEGORY_NAMES)}) or an op name like 'aten.gelu'")
    return frozenset(names), frozenset(cats)


def _node_args(n: fx.Node) -> list[fx.Node]:
    out = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a))
    return out


def _is_param_attr(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op != "get_attr":
        return False
    try:
        return isinstance(_get_attr(gm, n.target), nn.Parameter)
    except AttributeError:
        return False


def _get_attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ============================================================================================ the plan

LOW, FP32, ACC, FOLLOW, OPAQUE, RETARGET, INPLACE = "low", "fp32", "acc", "follow", "opaque", "retarget", "inplace"


@dataclass
class Decision:
    node: str
    module: str
    op: str
    cls: str
    reason: str


def classify(gm: fx.GraphModule, n: fx.Node, opts: PrecisionOptions, keep_names, keep_cats, low: torch.dtype,
             reverted: set) -> Decision:
    """The class of one call node (see the module docstring)."""
    path = module_path(n)
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if getattr(mod, "fxmem_dtype_follow", False):
            return Decision(n.name, path, str(n.target), FOLLOW, "module follows its input dtype")
        return Decision(n.name, path, str(n.target), OPAQUE, f"opaque module {type(mod).__name__}: inputs in "
                                                           f"their original dtype")
    t = n.target
    if t is operator.getitem:
        return Decision(n.name, path, "getitem", FOLLOW, "")
    if not isinstance(t, torch._ops.OpOverload):
        return Decision(n.name, path, str(getattr(t, "__name__", t)), OPAQUE, "not an aten op: original dtypes")
    name = optable.packet(t)
    opname = f"aten.{name}"
    if t._schema.is_mutable:
        if name.endswith("_") and n.args and isinstance(n.args[0], fx.Node):
            return Decision(n.name, path, opname, INPLACE, "in-place op: runs in the dtype of the tensor it mutates")
        return Decision(n.name, path, opname, OPAQUE, "mutates an input: original dtypes")
    if t in CAST_OPS and _is_float_noop_cast(n):
        return Decision(n.name, path, opname, RETARGET, "float-to-float cast that is a no-op in the fp32 graph "
                                                        "follows the plan")
    pat = _matches(path, opts.keep_fp32_modules) if path else None
    if pat is not None:
        return Decision(n.name, path, opname, FP32, f"module matches keep_fp32_modules {pat!r}")
    cat = optable.category(t)
    if n.name in reverted:
        return Decision(n.name, path, opname, FP32, "reverted by the accuracy guard")
    if cat in (optable.MATMUL, optable.ATTENTION):
        return Decision(n.name, path, opname, LOW, f"{cat} op runs in {_SHORT[low]}")
    if name in keep_names or cat in keep_cats:
        acc = ACC_BF16 if low == torch.bfloat16 else ACC_FP16
        if opts.islands == "compact" and name in acc:
            return Decision(n.name, path, opname, ACC, f"keep_fp32 op; its kernel accumulates in fp32 for "
                                                       f"{_SHORT[low]} inputs (compact island)")
        return Decision(n.name, path, opname, FP32, "keep_fp32 op: fp32 island")
    return Decision(n.name, path, opname, FOLLOW, "")


def _is_float_noop_cast(n: fx.Node) -> bool:
    src = n.args[0] if n.args else None
    if not isinstance(src, fx.Node):
        return False
    a, b = orig_float_dtype(src), orig_float_dtype(n)
    if a is None or b is None or a != b:
        return False
    kw = dict(n.kwargs)
    kw.pop("dtype", None)
    kw.pop("layout", None)
    if kw.get("device") not in (None,) and _val(src) is not None and torch.device(kw["device"]) != _val(src).device:
        return False
    kw.pop("device", None)
    kw.pop("copy", None)
    kw.pop("non_blocking", None)
    return not kw.get("memory_format")


def plan(gm: fx.GraphModule, opts: PrecisionOptions, low: torch.dtype, reverted: set = frozenset()) \
        -> dict[str, Decision]:
    keep_names, keep_cats = keep_ops(opts.keep_fp32)
    out = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_module"):
            if orig_float_dtype(n) is None and not any(orig_float_dtype(a) is not None for a in _node_args(n)):
                continue  # no float tensor in or out (shapes, masks, indices)
            out[n.name] = classify(gm, n, opts, keep_names, keep_cats, low, reverted)
    return out


# ============================================================================================ the rewrite

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
    beyond = beyond_range(gm, low)  # e.g. finfo(float32).min in attention masks: their casts saturate

    def is_param(a):
        return _is_param_attr(gm, a)

    def cast(a: fx.Node, dt: torch.dtype, before: fx.Node) -> fx.Node:
        key = (a, dt)
        c = casts.get(key)
        if c is None:
            with g.inserting_before(before):
                if recast and (is_param(a) or a.op == "placeholder") and dt != torch.float32:
                    c = g.call_function(cast_param, (a, dt))
                    stats["params_recast"] = stats.get("params_recast", 0) + 1
                elif a in beyond and torch.finfo(dt).max < torch.finfo(cur[a]).max:
                    c = saturating_cast(g, a, dt)
                else:
                    c = g.call_function(aten._to_copy.default, (a,), {"dtype": dt})
            c.name = f"{a.name}_{_SHORT.get(dt, 'cast')}"
            c.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
            c.meta["fxmem_precision"] = "cast"
            casts[key] = c
            cur[c] = dt
            stats["casts_inserted"] += 1
        return c

    def float_inputs(n):
        return [a for a in _node_args(n) if cur.get(a) is not None]

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
                obj = _get_attr(gm, n.target)
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
    if dev is not None and _val(src) is not None and torch.device(dev) != _val(src).device:
        return False
    return True


# ============================================================================================ parameters

def own_path(gm: nn.Module, prefix: str) -> nn.Module:
    """Make the containers along `prefix` private to `gm` (shallow copies) and return the innermost.

    A Program snapshot shares its submodule containers with the Program it was taken from (torch's GraphModule
    copies only what the graph references and reuses existing containers), so a pass that sets an attribute on
    a container would change the rollback copy too. Copy-on-write keeps the change in this GraphModule. The mark is
    the owner's token (a string), not the owner: a container that refers to another GraphModule would make every
    deepcopy of a result copy that module too (a candidate the guard discarded), inside its own copy."""
    mod = gm
    if not prefix:
        return mod
    token = _owner_token(gm)
    for item in prefix.split("."):
        child = mod._modules[item]
        if getattr(child, "_fxmem_owner", None) != token:
            new = copy.copy(child)
            new._parameters = dict(child._parameters)
            new._buffers = dict(child._buffers)
            new._modules = dict(child._modules)
            new._non_persistent_buffers_set = set(child._non_persistent_buffers_set)
            object.__setattr__(new, "_fxmem_owner", token)
            mod._modules[item] = new
            child = new
        mod = child
    return mod


def _owner_token(gm: nn.Module) -> str:
    """A token naming `gm` as the owner of the containers `own_path` copied for it (copied along with it by
    deepcopy, which copies those containers too; a snapshot gets its own)."""
    token = gm.__dict__.get("_fxmem_owner_token")
    if token is None:
        token = uuid.uuid4().hex
        object.__setattr__(gm, "_fxmem_owner_token", token)
    return token


def _owner(gm: nn.Module, target: str):
    prefix, _, name = target.rpartition(".")
    return own_path(gm, prefix), name


def replace_params(gm: fx.GraphModule, fn, only=None) -> list[str]:
    """Replace the get_attr'd parameters with new Parameters `fn(p)` (tied parameters stay tied).

    New Parameter objects on the snapshot's own containers: the rollback copy keeps the old ones."""
    done: dict[int, nn.Parameter] = {}
    names = []
    for n in gm.graph.nodes:
        if n.op != "get_attr" or (only is not None and n.target not in only):
            continue
        try:
            p = _get_attr(gm, n.target)
        except AttributeError:
            continue
        if not isinstance(p, nn.Parameter):
            continue
        new = done.get(id(p))
        if new is None:
            new = fn(p)
            done[id(p)] = new
        owner, name = _owner(gm, n.target)
        if getattr(owner, name) is not new:
            owner._parameters[name] = new
            names.append(n.target)
    return names


# ============================================================================================ weight swaps

@dataclass
class LinearSite:
    node: fx.Node
    path: str  # module path of the nn.Linear (the weight's owner)
    weight: str  # get_attr target
    bias: str | None
    transposed: bool = False  # aten.addmm(bias, x, W) (HF Conv1D): W is (in, out)

    @property
    def x(self) -> fx.Node:
        return self.node.args[1] if self.transposed else self.node.args[0]


def linear_sites(gm: fx.GraphModule, opts: PrecisionOptions) -> tuple[list[LinearSite], list[dict]]:
    """aten.linear sites whose weight (and bias) are parameters, and the skipped ones with why."""
    sites, skipped = [], []
    uses: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                p = _get_attr(gm, n.target)
            except AttributeError:
                continue
            if isinstance(p, torch.Tensor):
                uses[id(p)] = uses.get(id(p), 0) + len(n.users)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (aten.linear.default, aten.addmm.default):
            continue
        transposed = n.target is aten.addmm.default
        if transposed:
            if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1 or len(n.args) != 3:
                continue
            w, b = n.args[2], n.args[0]
            if not (isinstance(b, fx.Node) and b.op == "get_attr" and _is_param_attr(gm, b)
                    and _get_attr(gm, b.target).dim() == 1):
                continue  # a plain matrix product, not a Conv1D layer
        else:
            w = n.args[1]
            b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and _is_param_attr(gm, w)):
            skipped.append({"node": n.name, "module": module_path(n), "why": "weight is not a parameter"})
            continue
        path = w.target.rpartition(".")[0]
        if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr" and _is_param_attr(gm, b)):
            skipped.append({"node": n.name, "module": path, "why": "bias is not a parameter"})
            continue
        p = _get_attr(gm, w.target)
        pat = _matches(path, opts.skip_modules)
        if pat is not None:
            skipped.append({"node": n.name, "module": path, "why": f"matches skip_modules {pat!r}"})
            continue
        if p.numel() < opts.min_params:
            skipped.append({"node": n.name, "module": path, "why": f"{p.numel()} weights < min_params "
                                                                   f"{opts.min_params}"})
            continue
        if uses.get(id(p), 0) != 1:
            skipped.append({"node": n.name, "module": path, "why": "weight is shared (tied) with another use"})
            continue
        if p.dim() != 2:
            skipped.append({"node": n.name, "module": path, "why": f"weight has {p.dim()} dims"})
            continue
        sites.append(LinearSite(n, path, w.target, b.target if b is not None else None, transposed))
    return sites, skipped


def build_quant(gm, site: LinearSite, opts: PrecisionOptions, kind: str, compute: torch.dtype) -> nn.Module:
    w = _get_attr(gm, site.weight)
    b = _get_attr(gm, site.bias) if site.bias else None
    if site.transposed:
        w = w.t()
    return QuantLinear(w, b, kind, threshold=opts.int8_threshold, double_quant=opts.double_quant,
                       compute_dtype=compute)


def install_module(gm: fx.GraphModule, path: str, mod: nn.Module, site: LinearSite) -> str:
    """Put `mod` at the linear's own path when its container holds only this linear's weight/bias (a container
    fx made for this snapshot); else under a fresh root name. Returns the target."""
    prefix, _, name = path.rpartition(".")
    parent = gm.get_submodule(prefix) if prefix else gm
    container = getattr(parent, name, None)
    own = {site.weight.rpartition(".")[2]} | ({site.bias.rpartition(".")[2]} if site.bias else set())
    if type(container) is nn.Module and not container._modules and set(container._parameters) <= own \
            and not container._buffers:
        parent = own_path(gm, prefix)
        parent._modules[name] = mod
        return path
    target = "fxmem_lowbit_" + path.replace(".", "_")
    k = 1
    while hasattr(gm, target):
        target = f"fxmem_lowbit_{path.replace('.', '_')}_{k}"
        k += 1
    gm.add_module(target, mod)
    return target


def swap_linear(gm: fx.GraphModule, site: LinearSite, mod: nn.Module) -> str:
    n = site.node
    if site.transposed:
        b_node, x_node, w_node = n.args
    else:
        x_node, w_node = n.args[0], n.args[1]
        b_node = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    target = install_module(gm, site.path, mod, site)
    with gm.graph.inserting_before(n):
        call = gm.graph.call_module(target, (x_node,))
    call.meta.update({k: v for k, v in n.meta.items() if k in ("nn_module_stack", "stack_trace", "val",
                                                                "fxmem_val")})
    call.meta["fxmem_precision"] = "quant"
    n.replace_all_uses_with(call)
    gm.graph.erase_node(n)
    for a in (w_node, b_node):
        if isinstance(a, fx.Node) and not a.users:
            gm.graph.erase_node(a)
    return target


def lora_module(base: nn.Module, qlora: QLoRAOptions, device, seed: int) -> nn.Module:
    """A LoRA adapter (`fxmem.nn.lowbit.LoRALinear`) around a frozen base linear."""
    return LoRALinear(base, base.in_features, base.out_features, rank=qlora.rank, alpha=qlora.alpha,
                      dropout=qlora.dropout, device=device, seed=seed)


def add_dense_lora(gm: fx.GraphModule, site: LinearSite, opts: PrecisionOptions, compute: torch.dtype,
                   seed: int) -> Change:
    """A LoRA adapter on a targeted linear whose 4-bit weights the guard reverted: its own weight, frozen (stored
    in bf16 with `params: bf16`, else not copied), computing in `compute` as the 4-bit base would have, is the base
    (`fxmem.nn.lowbit.FrozenLinear`), so the adapters still train where QLoRA was asked."""
    qlora = opts.qlora
    stored = torch.bfloat16 if opts.params == "bf16" else None
    w = _get_attr(gm, site.weight)
    b = _get_attr(gm, site.bias) if site.bias else None
    w_base, b_base = (t if t is None or stored is None else t.detach().to(stored) for t in (w, b))
    base = FrozenLinear(w_base, b_base, transposed=site.transposed, compute_dtype=compute)
    mod = lora_module(base, qlora, w.device, seed)
    name_before = site.node.name
    target = swap_linear(gm, site, mod)
    return Change("precision.lora", site.path, [name_before], [target],
                  f"LoRA rank {qlora.rank} on the original-precision weights (the guard reverted the 4-bit ones); "
                  f"weights frozen; state_dict: {site.weight} -> {target}.base.weight", 0,
                  {"base": "dense", "rank": qlora.rank})


def freeze_for_lora(gm: fx.GraphModule, changes: list[Change], sites: list[LinearSite], skipped: list[dict],
                    qlora: QLoRAOptions) -> Change:
    """Freeze every base parameter for QLoRA; a PolicyError when no adapter was added (nothing would train)."""
    adapted = [c for c in changes if c.kind in ("precision.quantize+lora", "precision.lora")]
    if not adapted:
        if sites:
            names = ", ".join(s.path for s in sites[:6]) + (", ..." if len(sites) > 6 else "")
            why = f"matched none of the {len(sites)} linear(s) that can take one ({names})"
        else:
            kept = [f"{sk['module']}: {sk['why']}" for sk in skipped[:3]] + (["..."] if len(skipped) > 3 else [])
            why = f"found no linear that can take one ({', '.join(kept) or 'the model has no linear'})"
        raise PolicyError(f"passes.precision.qlora.targets {qlora.targets} {why}: no LoRA adapter, so nothing "
                          f"would train")
    frozen = replace_params(gm, lambda p: nn.Parameter(p.detach(), requires_grad=False))
    n_lora = sum(p.numel() for n, p in gm.named_parameters() if "lora_" in n and p.requires_grad)
    n_dense = sum(1 for c in adapted if c.kind == "precision.lora")
    return Change("precision.freeze", "", [], [], f"QLoRA: {len(frozen)} base parameter(s) frozen; {n_lora} adapter "
                  f"weights train on {len(adapted)} linear(s)" + (f", {n_dense} of them on original-precision "
                                                                   f"weights" if n_dense else ""),
                  None, {"frozen": frozen, "lora_params": n_lora, "adapted": [c.module for c in adapted]})


# ============================================================================================ measuring

class _Recorder(fx.Interpreter):
    """Runs the graph, keeping the values of the nodes named in `keep`."""

    def __init__(self, gm, keep: set):
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, object] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.keep:
            # a copy: later in-place ops (relu_) must not change what was recorded
            self.values[n.name] = pytree.tree_map(
                lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)
        return out


def record_values(gm: fx.GraphModule, inputs: list[tuple[tuple, dict]], keep: set) -> list[dict]:
    was = gm.training
    gm.eval()
    res = []
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
                r = _Recorder(gm, keep)
                r.run(*flat, enable_io_processing=False)
                res.append(r.values)
    finally:
        gm.train(was)
    return res


def _err(ref, got) -> tuple[float, float]:
    d = deviation(ref, got)
    return d.max_abs, d.rel


def site_error_compute(n: fx.Node, values: list[dict], dt: torch.dtype, seed: int = 0) -> tuple[float, float]:
    """Error of running node `n` with its float inputs in `dt` (vs its fp32 outputs), over the recorded batches."""
    mx, rels = 0.0, []
    bn = optable.packet(n.target) in BATCH_NORMS
    for vals in values:
        if n.name not in vals:
            continue

        def get(a, cast_to):
            if isinstance(a, fx.Node):
                v = vals[a.name]
                if cast_to is not None and isinstance(v, torch.Tensor) and v.is_floating_point() \
                        and not (bn and a is not n.args[0]):
                    return v.to(cast_to)
                return v
            return a
        args = fx.node.map_aggregate(n.args, lambda a: get(a, dt) if isinstance(a, fx.Node) else a)
        kwargs = fx.node.map_aggregate(n.kwargs, lambda a: get(a, dt) if isinstance(a, fx.Node) else a)
        if n.target in (aten.softmax.int, aten.log_softmax.int) and len(args) > 2 and args[2] == torch.float32:
            args = args[:2] + (None,) + tuple(args[3:])
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            got = n.target(*args, **kwargs)
        got = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, got)
        m, r = _err(vals[n.name], got)
        mx, rels = max(mx, m), rels + [r]
    return mx, (max(rels) if rels else 0.0)


def site_error_module(n: fx.Node, mod: nn.Module, values: list[dict], x_node: fx.Node | None = None) \
        -> tuple[float, float]:
    mx, rels = 0.0, []
    x_node = x_node if x_node is not None else n.args[0]
    for vals in values:
        x = vals.get(x_node.name)
        if x is None or n.name not in vals:
            continue
        with torch.no_grad():
            got = mod(x)
        m, r = _err(vals[n.name], got)
        mx, rels = max(mx, m), rels + [r]
    return mx, (max(rels) if rels else 0.0)


def output_deviation(ref_gm, gm, inputs) -> dict:
    mx, rel = 0.0, 0.0
    for args, kwargs in inputs:
        outs = []
        for m in (ref_gm, gm):
            was = m.training
            m.eval()
            try:
                with torch.no_grad():
                    outs.append(m(*args, **kwargs))
            finally:
                m.train(was)
        d = deviation(*outs)
        mx, rel = max(mx, d.max_abs), max(rel, d.rel)
    return {"max_abs": mx, "rel": rel}


def losses_after_steps(gm: fx.GraphModule, args, kwargs, loss_fn, steps: int, seed: int = 0) -> list[float]:
    """Losses of `steps` training steps (AdamW, lr 1e-3) on a deep copy (the module is not changed)."""
    m = deep_copy(gm)
    m.train()
    opt = make_optimizer(m, "adamw", lr=1e-3)
    out = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps + 1):
            loss = compute_loss(loss_fn, m(*args, **kwargs), args, kwargs)
            out.append(float(loss.detach()))
            if len(out) > steps:
                break
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return out


# ============================================================================================ the pass

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


@dataclass
class StageLog:
    """What the stages of one run of the pass record: Changes, notes, per-site rows, verdicts, intents."""
    changes: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    sites: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)  # the guard's verdicts on what was kept
    asked: list = field(default_factory=list)  # its verdicts on what was asked (the first candidate of each stage)
    intents: list = field(default_factory=list)

    def record(self, outcome) -> None:
        if outcome.verdict is not None:
            self.verdicts.append(outcome.verdict)
        if outcome.asked is not None:
            self.asked.append(outcome.asked)


def weight_kind(opts: PrecisionOptions) -> str | None:
    """int8 / nf4 / fp4 when weights are quantized (QLoRA without `weights` means nf4), else None."""
    kind = opts.weights if opts.weights not in ("none", "fp32") else None
    return "nf4" if kind is None and opts.qlora is not None else kind


def _guard(ctx: PassContext, program: Program, opts: PrecisionOptions, kind: str):
    """The guard of one kind of change made by this pass (None with `guard: false`)."""
    if not opts.guard:
        return None
    return guard_for(ctx, program, kind, section="passes.precision", tolerance=opts.tolerance)


def _by_error(rows: dict) -> list[str]:
    """Site names by their own relative error, largest first (the order the guard backs off in)."""
    return sorted(rows, key=lambda name: -rows[name] if math.isfinite(rows[name]) else -math.inf)


def weights_stage(program: Program, ctx: PassContext, opts: PrecisionOptions, kind: str, compute: torch.dtype,
                  log: StageLog) -> Program:
    """Swap the linears for bitsandbytes layers; the guard judges the whole model, backing off the linears whose own
    output error is largest first. Returns the program kept (the given one when nothing was accepted)."""
    sites, skipped = linear_sites(program.module, opts)
    log.notes.extend(f"{sk['module']}: linear kept ({sk['why']})" for sk in skipped)
    setting = "passes.precision.qlora" if opts.weights in ("none", "fp32") else "passes.precision.weights"
    not_covered = describe_weights_left(weights_left(program.module, opts.min_params), program.module)
    if not sites:
        log.intents.append(Intent(setting, f"{kind} weights", "quantized none", False, _no_site_reason(skipped),
                                  "lower passes.precision.min_params or narrow skip_modules", not_covered))
        return program
    guard_kind = "4bit" if kind in ("nf4", "fp4") else kind
    guard = _guard(ctx, program, opts, guard_kind)
    quant = {s.node.name: build_quant(program.module, s, opts, kind, compute) for s in sites}
    errors = _weight_site_errors(program, sites, quant, guard)
    log.sites.extend({"site": s.node.name, "module": s.path, "decision": kind, "rel": errors[s.node.name],
                      "reverted": False} for s in sites)

    def build(excluded):
        cand = program.snapshot()
        changes = swap_sites(cand, opts, kind, quant, set(excluded), compute, ctx.seed)
        cand.refresh()
        return cand, changes
    outcome = first_accepted(guard, build, exclusion_steps(_by_error(errors)), guard_kind)
    kept = outcome.program
    if kept is None:  # nothing accepted: every linear keeps its weights (QLoRA targets get a dense-base adapter)
        excluded = {s.node.name for s in sites}
        kept, changes = build(excluded) if opts.qlora is not None else (program, [
            Change("precision.reverted", s.path, [s.node.name], [s.node.name], "", 0, {"decision": kind})
            for s in sites])
    else:
        changes, excluded = outcome.payload, set(outcome.state)
    log.changes.extend(_explain_reverts(changes, outcome, errors))
    log.record(outcome)
    for row in log.sites:
        row["reverted"] = row["site"] in excluded
    stopped_by, change = guard_stop(outcome.asked)
    done = len(sites) - len(excluded)
    log.intents.append(Intent(setting, f"{kind} weights on {len(sites)} linear(s)",
                              f"quantized {done} of {len(sites)}", done == len(sites), stopped_by, change,
                              not_covered))
    return kept


def _no_site_reason(skipped: list[dict]) -> str:
    """Why no linear could take quantized weights, from the skip rules that kept them."""
    if not skipped:
        return "the model has no linear layer"
    shown = ", ".join(f"{sk['module']}: {sk['why']}" for sk in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    return f"no linear qualifies ({shown})"


def _weight_site_errors(program: Program, sites: list, quant: dict, guard) -> dict[str, float]:
    """Each linear's own relative output error with its quantized layer, on the guard data (ordering only)."""
    if guard is None:
        return {s.node.name: float("nan") for s in sites}
    keep = {n for s in sites for n in (s.node.name, s.x.name)}
    values = record_values(program.module, guard.items[:SITE_ITEMS], keep)
    return {s.node.name: site_error_module(s.node, quant[s.node.name], values, s.x)[1] for s in sites}


def swap_sites(cand: Program, opts: PrecisionOptions, kind: str, quant: dict, excluded: set,
               compute: torch.dtype, seed: int) -> list[Change]:
    """Swap every site of `cand` not in `excluded` for its quantized layer (LoRA-wrapped for QLoRA targets); an
    excluded QLoRA target gets an adapter on its original weights. Returns the Changes."""
    gm = cand.module
    targets = opts.qlora.targets if opts.qlora is not None else []
    changes = []
    for s in linear_sites(gm, opts)[0]:
        lora = opts.qlora is not None and _matches(s.path, targets) is not None
        if s.node.name in excluded:
            changes.append(Change("precision.reverted", s.path, [s.node.name], [s.node.name], "", 0,
                                  {"decision": kind}))
            if lora:
                changes.append(add_dense_lora(gm, s, opts, compute, seed))
            continue
        changes.append(_swap_one(gm, s, opts, kind, quant[s.node.name], lora, seed))
    return changes


def _swap_one(gm, s: LinearSite, opts: PrecisionOptions, kind: str, mod: nn.Module, lora: bool, seed: int) -> Change:
    w = _get_attr(gm, s.weight)
    b = _get_attr(gm, s.bias) if s.bias else None
    dense = w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
    if lora:
        mod = lora_module(mod, opts.qlora, w.device, seed)
    name_before = s.node.name
    target = swap_linear(gm, s, mod)
    qbytes = (mod.base if lora else mod).weight_bytes()
    inner = f"{target}.{'base.' if lora else ''}"
    return Change("precision.quantize" + ("+lora" if lora else ""), s.path, [name_before], [target],
                  f"aten.linear -> bitsandbytes {kind} linear" + (f" + LoRA rank {opts.qlora.rank}" if lora else "")
                  + f"; weights frozen; state_dict: {s.weight} -> {inner}inner.weight (+ bitsandbytes state keys); "
                    f"bias -> {inner}bias", dense - qbytes, {"dense_bytes": dense, "quant_bytes": qbytes})


def _explain_reverts(changes: list[Change], outcome, errors: dict) -> list[Change]:
    """Fill in why each backed-off site kept its precision (the guard's verdict on the whole model) and each kept
    site's own error."""
    why = _back_off_why(outcome, "it")
    for c in changes:
        rel = errors.get(c.nodes_before[0] if c.nodes_before else "", float("nan"))
        c.details["rel"] = rel
        if c.kind == "precision.reverted":
            what = c.details.get("decision", "")
            c.reason = f"{what}: kept in its original precision: {why} (its own relative error {rel:.3g})"
        elif c.kind.startswith("precision.quantize"):
            c.reason += f" (site relative error {rel:.3g})"
    return changes


def _back_off_why(outcome, what: str) -> str:
    """Why a site was backed off: the guard's verdict on what was asked, and whether it accepted anything."""
    asked = outcome.asked
    if asked is None or asked.accepted:
        return "kept as it was"
    refused = f"the guard refused {what} on the whole model ({asked.reason()} on {asked.data})"
    if outcome.program is None:
        return refused + " and at every back-off step"
    return refused + "; this site's own error is among the largest, so it went back first"


def compute_stage(program: Program, ctx: PassContext, opts: PrecisionOptions, low: torch.dtype, log: StageLog,
                  metrics: dict) -> Program:
    """bf16 / fp16 compute (and bf16 parameters): the plan is applied whole and judged on the whole model; the sites
    whose own error is largest run in fp32 first until the guard accepts. Sites that cannot run in the low dtype
    always stay fp32. Returns the program kept."""
    guard = _guard(ctx, program, opts, "compute")
    errors, incapable = _compute_site_errors(program, opts, low, guard, ctx.seed, log)
    recast = opts.recast_params and opts.params == "fp32" and ctx.mode == "train"

    def build(excluded):
        cand = program.snapshot()
        changes = []
        if opts.params == "bf16":
            names = replace_params(cand.module, lambda p: nn.Parameter(p.detach().to(torch.bfloat16),
                                                                        requires_grad=p.requires_grad))
            changes.append(Change("precision.params", "", [], [], f"{len(names)} parameters stored in bf16; use "
                                  "fxmem.make_optimizer for fp32 master weights and fp32 optimizer state", None,
                                  {"params": names}))
        decisions = plan(cand.module, opts, low, set(excluded) | incapable)
        stats = apply_plan(cand.module, decisions, opts, low, recast=recast)
        cand.refresh()
        stats["casts_removed"] = simplify_casts(cand.module)
        return cand, (decisions, stats, changes)
    outcome = first_accepted(guard, build, exclusion_steps(_by_error(errors)), "compute")
    log.record(outcome)
    n = len(errors) + len(incapable)
    excluded = set(outcome.state) if outcome.program is not None else set(errors)
    for row in log.sites:
        if row["decision"].startswith(("low:", "acc:")):
            row["reverted"] = row["site"] in excluded | incapable
    stopped_by, change = guard_stop(outcome.asked)
    if incapable and not stopped_by:
        stopped_by, change = f"{len(incapable)} op(s) without a {_SHORT[low]} kernel here", "nothing to change"
    done = n - len(excluded) - len(incapable)
    log.intents.append(Intent("passes.precision.compute", f"{opts.compute} compute at {n} site(s)",
                              f"{opts.compute} at {done} of {n}", done == n, stopped_by, change))
    _record_reverts(log, errors, incapable, excluded, _back_off_why(outcome, _SHORT[low]), low)
    if outcome.program is None:
        return program
    decisions, stats, changes = outcome.payload
    log.changes.extend(changes)
    metrics.update(stats)
    _record_compute(log, metrics, decisions, low)
    return outcome.program


def _compute_site_errors(program: Program, opts, low, guard, seed: int, log: StageLog) -> tuple[dict, set]:
    """Each LOW/ACC site's own relative error in the low dtype (ordering; an overflow is an infinite error); the
    sites whose op raises in it (no kernel for the dtype here)."""
    decisions = {name: d for name, d in plan(program.module, opts, low).items() if d.cls in (LOW, ACC)}
    errors, incapable = {}, set()
    values = []
    if guard is not None and decisions:
        keep = set()
        for d in decisions.values():
            n = _node_by_name(program.module, d.node)
            keep.add(n.name)
            keep.update(a.name for a in _node_args(n))
        values = record_values(program.module, guard.items[:SITE_ITEMS], keep)
    for d in decisions.values():
        rel = float("nan")
        if values:
            try:
                rel = site_error_compute(_node_by_name(program.module, d.node), values, low, seed)[1]
            except Exception as e:  # noqa: BLE001 - an op that cannot run in the low dtype stays fp32
                incapable.add(d.node)
                d.reason += f" (could not run in {_SHORT[low]}: {type(e).__name__})"
        if d.node not in incapable:
            errors[d.node] = rel
        log.sites.append({"site": d.node, "module": d.module, "op": d.op, "decision": f"{d.cls}:{_SHORT[low]}",
                          "rel": rel, "reverted": False})
    return errors, incapable


def _record_reverts(log: StageLog, errors: dict, incapable: set, excluded: set, why: str, low) -> None:
    rows = {r["site"]: r for r in log.sites}
    for name in sorted(incapable) + [n for n in _by_error(errors) if n in excluded]:
        row = rows[name]
        reason = f"it cannot run in {_SHORT[low]} here" if name in incapable else \
            f"{why} (its own relative error {row['rel']:.3g})"
        log.changes.append(Change("precision.reverted", row["module"], [name], [name], f"{row['op']} runs in fp32: "
                                  f"{reason}", 0, {"rel": row["rel"], "decision": row["decision"]}))


def _record_compute(log: StageLog, metrics: dict, decisions: dict, low) -> None:
    """Per-module Changes of the applied plan and its counters."""
    by_cls: dict[str, int] = {}
    for d in decisions.values():
        by_cls[d.cls] = by_cls.get(d.cls, 0) + 1
    metrics["decisions"] = by_cls
    metrics["fp32_islands"] = sorted(d.node for d in decisions.values() if d.cls == FP32)
    groups: dict[str, list[Decision]] = {}
    for d in decisions.values():
        if d.cls in (LOW, ACC, FP32):
            groups.setdefault(d.module, []).append(d)
    for mod_path, ds in groups.items():
        lowd = [d.node for d in ds if d.cls == LOW]
        accd = [d.node for d in ds if d.cls == ACC]
        f32 = [d.node for d in ds if d.cls == FP32]
        reason = "; ".join(x for x in (
            f"{len(lowd)} matmul-class op(s) in {_SHORT[low]}" if lowd else "",
            f"{len(accd)} op(s) in {_SHORT[low]} with fp32 accumulation in the kernel" if accd else "",
            "fp32 island(s): " + ", ".join(sorted({d.op + ' (' + d.reason + ')' for d in ds
                                                   if d.cls == FP32})) if f32 else "") if x)
        log.changes.append(Change("precision.compute", mod_path, [d.node for d in ds], [d.node for d in ds],
                                  reason, None, {"low": lowd, "acc": accd, "fp32": f32}))


@register
class PrecisionPass(Pass):
    name = "precision"
    exact = False
    Options = PrecisionOptions

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        opts: PrecisionOptions = ctx.options
        validate(opts)
        low = DTYPES[opts.compute]
        kind = weight_kind(opts)
        log = StageLog()
        if opts.qlora is not None and opts.weights in ("none", "fp32"):
            log.notes.append("qlora: base weights quantized to nf4 (weights: none was given)")
        want_compute = low != torch.float32
        if not want_compute and kind is None and opts.params == "fp32":
            return PassResult(program, False, notes=["compute fp32, no weight quantization: nothing to do"])
        metrics: dict = {"compute": opts.compute, "islands": opts.islands, "params": opts.params,
                         "weights": opts.weights}
        est_before = _safe_estimate(ctx, program) if opts.report_estimate else None
        reference = program
        if kind is not None:
            program = weights_stage(program, ctx, opts, kind, low if want_compute else torch.float32, log)
        metrics["linears_quantized"] = sum(c.kind.startswith("precision.quantize") for c in log.changes)
        if metrics["linears_quantized"] and ctx.mode == "train" and opts.qlora is None:
            log.notes.append("quantized linears are frozen (bitsandbytes int8/4-bit weights take no gradient); "
                             "the rest of the model trains")
        if want_compute:
            program = compute_stage(program, ctx, opts, low, log, metrics)
            _training_notes(opts, ctx.mode, log)
        if opts.qlora is not None:
            _freeze_for_qlora(reference, program, opts, kind, log, metrics)
        program.refresh()
        metrics["sites"] = log.sites
        metrics["sites_reverted"] = sum(1 for s in log.sites if s["reverted"])
        metrics["guard_asked"] = [v.to_dict() for v in log.asked]
        _whole_model(reference, program, ctx, opts, metrics, log.notes)
        _estimates(ctx, program, opts, est_before, metrics, log.notes)
        modified = program is not reference
        if not modified:
            log.notes.append("the guard accepted no change: the model is left as it was")
        return PassResult(program, modified, changes=log.changes, notes=log.notes, metrics=metrics,
                          intents=log.intents, verdicts=log.verdicts)


def _training_notes(opts: PrecisionOptions, mode: str, log: StageLog) -> None:
    if opts.compute == "fp16" and mode == "train":
        log.notes.append("fp16 training needs loss scaling: gradients below 6e-8 flush to zero in fp16; use "
                         "torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()) "
                         "— tested with fxmem on CPU")
    if opts.params == "bf16" and mode == "train":
        log.notes.append("bf16 parameters: build the optimizer with fxmem.make_optimizer(module, policy), which keeps "
                         "fp32 master weights and fp32 optimizer state (the cost model's estimate assumes optimizer "
                         "state in the parameter dtype)")


def _freeze_for_qlora(reference: Program, program: Program, opts: PrecisionOptions, kind: str, log: StageLog,
                      metrics: dict) -> None:
    """QLoRA: only the adapters train (a PolicyError naming the linears of `reference` when no adapter was added)."""
    sites, skipped = linear_sites(reference.module, opts)
    log.changes.append(freeze_for_lora(program.module, log.changes, sites, skipped, opts.qlora))
    metrics["lora_params"] = log.changes[-1].details["lora_params"]
    dense_sites = [c.module for c in log.changes if c.kind == "precision.lora"]
    if dense_sites:
        log.notes.append(f"qlora: {len(dense_sites)} targeted linear(s) whose {kind} weights the accuracy guard "
                         f"reverted keep their original weights, frozen, under a LoRA adapter (adapter training as "
                         f"asked, no 4-bit saving there): {', '.join(dense_sites)}")


def _whole_model(reference: Program, program: Program, ctx: PassContext, opts: PrecisionOptions, metrics: dict,
                 notes: list) -> None:
    """The whole model against the pass's input: output deviation on the guard data, and in training the losses
    after `loss_steps` optimizer steps (report figures)."""
    if not opts.guard or program is reference:
        return
    inputs = guard_items(ctx, reference)[0]
    try:
        metrics["output_deviation"] = output_deviation(reference.module, program.module, inputs)
    except Exception as e:  # noqa: BLE001
        notes.append(f"output deviation not measured: {type(e).__name__}: {e}")
    if ctx.mode == "train" and opts.loss_steps > 0:
        try:
            args, kwargs = inputs[0]
            metrics["loss_fp32"] = losses_after_steps(reference.module, args, kwargs, ctx.loss_fn, opts.loss_steps,
                                                      ctx.seed)
            metrics["loss_new"] = losses_after_steps(program.module, args, kwargs, ctx.loss_fn, opts.loss_steps,
                                                     ctx.seed)
        except Exception as e:  # noqa: BLE001
            notes.append(f"loss after {opts.loss_steps} steps not measured: {type(e).__name__}: {e}")


def _estimates(ctx: PassContext, program: Program, opts: PrecisionOptions, est_before, metrics: dict,
               notes: list) -> None:
    if not opts.report_estimate:
        return
    est_after = _safe_estimate(ctx, program)
    if est_before is None or est_after is None:
        notes.append("cost-model estimate before/after not available (the static estimate failed)")
        return
    metrics["estimate"] = {k: {"before": getattr(est_before, k), "after": getattr(est_after, k)}
                           for k in ("params", "activations", "optimizer_state", "peak")}


def _node_by_name(gm, name):
    for n in gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(name)


def _safe_estimate(ctx: PassContext, program):
    try:
        return ctx.estimate(program)
    except Exception:  # noqa: BLE001 - the estimate is a report figure here, not a decision input
        return None


__all__ = ["PrecisionOptions", "QLoRAOptions", "PrecisionPass", "plan", "apply_plan", "simplify_casts",
           "linear_sites", "KEEP_GROUPS", "ACC_BF16", "ACC_FP16", "DTYPES"]
_ = math
