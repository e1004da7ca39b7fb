"""The compute rewrite: casts inserted on every edge whose dtype the plan changes, and redundant casts removed."""
from __future__ import annotations

import operator

import torch
from torch import fx

from fxmem import ops as optable
from fxmem.depgroups import attr_of
from fxmem.extreme_values import beyond_range, saturating_cast
from fxmem.nn.recast import cast_param, install as install_recast
from fxmem.node_value import node_value

from .nodes import is_param_attr, node_args, orig_float_dtype
from .options import DTYPE_NAMES, PrecisionOptions
from .plan import ACC, BATCH_NORMS, CAST_OPS, FP32, INPLACE, LOW, OPAQUE, RETARGET, Decision

aten = torch.ops.aten


def apply_plan(graph_module: fx.GraphModule, decisions: dict[str, Decision], opts: PrecisionOptions, low: torch.dtype,
               recast: bool = False) -> dict:
    """Insert casts on every edge whose dtype changes under the plan; returns counters.

    recast: casts of parameters become `fxmem.nn.recast.cast_param` and the module gets the recast hooks, so
    autograd saves the parameter (alive anyway) instead of its low-precision copy and casts again in backward."""
    rewrite = CastRewrite(graph_module, decisions, opts, low, recast)
    for node in list(graph_module.graph.nodes):
        rewrite.visit(node)
    for node in list(graph_module.graph.nodes):
        if not node.users and rewrite.dequantizes(node):  # read in the low dtype only: its own call gives that
            graph_module.graph.erase_node(node)
    graph_module.graph.lint()
    graph_module.recompile()
    if rewrite.stats.get("params_recast"):
        install_recast(graph_module)
    return rewrite.stats


class CastRewrite:
    """One application of a plan, node by node in graph order: the dtype every value has under the plan so far
    (`dtypes`; None for non-float values), the casts made (one per value and dtype, reused), and counters."""

    def __init__(self, graph_module: fx.GraphModule, decisions: dict[str, Decision], opts: PrecisionOptions,
                 low: torch.dtype, recast: bool):
        self.gm, self.graph, self.decisions = graph_module, graph_module.graph, decisions
        self.low, self.recast, self.compact = low, recast, opts.islands == "compact"
        self.dtypes: dict[fx.Node, torch.dtype | None] = {}
        self.casts: dict[tuple, fx.Node] = {}
        self.stats = {"casts_inserted": 0, "retargeted": 0, "outputs_cast": 0}
        # e.g. finfo(float32).min in attention masks: their casts saturate
        self.beyond = beyond_range(graph_module, low)

    def visit(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            self.dtypes[node] = orig_float_dtype(node)
        elif node.op == "get_attr":
            self.dtypes[node] = self._attr_dtype(node)
        elif node.op == "output":
            node.args = fx.node.map_arg(node.args, lambda arg: self._as_output(arg, node))
        elif node.name not in self.decisions:
            self.dtypes[node] = orig_float_dtype(node)
        elif self.decisions[node.name].cls == RETARGET:
            self._retarget(node)
        elif node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            self._update_assert(node)
        elif node.op == "call_function" and node.target is operator.getitem:
            parent = node.args[0]
            self.dtypes[node] = self.dtypes.get(parent) if orig_float_dtype(node) is not None \
                and self.dtypes.get(parent) is not None else orig_float_dtype(node)
        else:
            self._cast_inputs(node, self.decisions[node.name])

    def cast(self, value: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        """`value` in `dtype`: the cast made for it earlier, or a new one inserted before `before`."""
        key = (value, dtype)
        made = self.casts.get(key)
        if made is None:
            with self.graph.inserting_before(before):
                if self.dequantizes(value):  # a stored quantized weight: dequantized in `dtype` straight away
                    made = self.graph.call_module(value.target, (value.args[0] if value.args else None, dtype))
                elif self.recast and (self.is_param(value) or value.op == "placeholder") and dtype != torch.float32:
                    made = self.graph.call_function(cast_param, (value, dtype))
                    self.stats["params_recast"] = self.stats.get("params_recast", 0) + 1
                elif value in self.beyond and torch.finfo(dtype).max < torch.finfo(self.dtypes[value]).max:
                    made = saturating_cast(self.graph, value, dtype)
                else:
                    made = self.graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
            made.name = f"{value.name}_{DTYPE_NAMES.get(dtype, 'cast')}"
            made.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
            made.meta["fxmem_precision"] = "cast"
            self.casts[key] = made
            self.dtypes[made] = dtype
            self.stats["casts_inserted"] += 1
        return made

    def is_param(self, node) -> bool:
        return is_param_attr(self.gm, node)

    def dequantizes(self, node: fx.Node) -> bool:
        """`node` calls a module that can give its output in another dtype itself (`QuantizedWeight`)."""
        return node.op == "call_module" and getattr(self.gm.get_submodule(node.target), "fxmem_dequantizes", False) \
            and len(node.args) <= 1 and not node.kwargs

    def _attr_dtype(self, node: fx.Node) -> torch.dtype | None:
        try:
            obj = attr_of(self.gm, node.target)
        except AttributeError:
            return None
        return obj.dtype if isinstance(obj, torch.Tensor) and obj.is_floating_point() else None

    def _as_output(self, arg, output: fx.Node):
        """A graph output is cast back to its original dtype (the loss is computed in fp32)."""
        if isinstance(arg, fx.Node) and self.dtypes.get(arg) is not None:
            want = orig_float_dtype(arg)
            if want is not None and self.dtypes[arg] != want:
                self.stats["outputs_cast"] += 1
                return self.cast(arg, want, output)
        return arg

    def _retarget(self, node: fx.Node) -> None:
        """A model-written float-to-float cast that is a no-op in the fp32 graph follows the plan: it goes."""
        src = node.args[0]
        if self.dtypes.get(src) is not None:
            node.replace_all_uses_with(src)
            self.graph.erase_node(node)
            self.stats["retargeted"] += 1
            return
        self.dtypes[node] = orig_float_dtype(node)

    def _update_assert(self, node: fx.Node) -> None:
        """An export-time dtype check of a value whose dtype the plan changed checks the new dtype."""
        src = node.args[0]
        if isinstance(src, fx.Node) and self.dtypes.get(src) is not None and node.kwargs.get("dtype") is not None \
                and node.kwargs["dtype"] != self.dtypes[src]:
            node.kwargs = {**node.kwargs, "dtype": self.dtypes[src]}
            self.stats["asserts_updated"] = self.stats.get("asserts_updated", 0) + 1
        self.dtypes[node] = None

    def _cast_inputs(self, node: fx.Node, decision: Decision) -> None:
        """Cast the float inputs of `node` to the dtype its class runs in; record the dtype of its result."""
        want = self._target_dtype(node, decision)
        mixed = decision.cls == ACC and node.op == "call_function" and optable.packet(node.target) in BATCH_NORMS
        first = node.args[0] if node.args else None

        def fix(arg):
            if not isinstance(arg, fx.Node) or self.dtypes.get(arg) is None:
                return arg
            dtype = want
            if decision.cls == OPAQUE:
                dtype = orig_float_dtype(arg)
            elif mixed and arg is not first:
                # batch norm's mixed-dtype kernel: low-precision input, weight/bias/running statistics in fp32
                dtype = torch.float32
            if dtype is None or self.dtypes[arg] == dtype:
                return arg
            return self.cast(arg, dtype, node)
        node.args = fx.node.map_arg(node.args, fix)
        node.kwargs = fx.node.map_arg(node.kwargs, fix)
        # explicit fp32 result dtypes (softmax(x, dtype=float32) in HF code) follow the plan in LOW/ACC ops
        if decision.cls in (ACC, LOW) and node.target in (aten.softmax.int, aten.log_softmax.int) \
                and len(node.args) > 2 and node.args[2] == torch.float32 and want is not None \
                and want != torch.float32:
            node.args = node.args[:2] + (None,) + tuple(node.args[3:])
        self.dtypes[node] = self._result_dtype(node, decision, want)

    def _result_dtype(self, node: fx.Node, decision: Decision, want: torch.dtype | None) -> torch.dtype | None:
        original = orig_float_dtype(node)
        if original is None:
            return None
        if decision.cls == OPAQUE:
            return original
        if decision.cls == FP32:
            return torch.float32
        return want if want is not None else original

    def _target_dtype(self, node: fx.Node, decision: Decision) -> torch.dtype | None:
        """The dtype the float inputs of `node` are cast to (None: each keeps its own)."""
        ins = [arg for arg in node_args(node) if self.dtypes.get(arg) is not None]
        if not ins:
            return None
        if decision.cls == LOW:
            return self.low
        if decision.cls == FP32:
            return torch.float32
        if decision.cls == OPAQUE:
            return None  # per input: original dtype
        if decision.cls == INPLACE:
            return self.dtypes.get(node.args[0])  # the mutated tensor is never cast (a cast would mutate a copy)
        dts = {self.dtypes[arg] for arg in ins}
        nonparam = {self.dtypes[arg] for arg in ins if not (self.is_param(arg) or self.dequantizes(arg))}
        if self.compact:
            if self.low in dts or (not nonparam and ins):
                if self.low == torch.float16 and any(x not in (self.low,) for x in nonparam):
                    return torch.float32  # fp16: mixed with fp32 values promotes (range)
                return self.low
            return next(iter(dts)) if len(dts) == 1 else torch.float32
        # autocast: torch's type promotion, made explicit where dtypes differ
        if len(dts) == 1:
            return next(iter(dts))
        return torch.float32 if torch.float32 in dts else max(dts, key=lambda x: torch.finfo(x).bits)


def simplify_casts(graph_module: fx.GraphModule) -> int:
    """Remove casts to the dtype a value already has and lossless round trips (x -> wider -> x's dtype).

    Works on `fxmem_val` metadata (call after `program.refresh()`); returns the number of casts removed."""
    graph = graph_module.graph
    removed = 0
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in CAST_OPS or not node.args:
                continue
            src = node.args[0]
            if not isinstance(src, fx.Node):
                continue
            dst_dt, src_dt = orig_float_dtype(node), orig_float_dtype(src)
            if dst_dt is None or src_dt is None or not _pure_dtype_cast(node):
                continue
            if dst_dt == src_dt and node.meta.get("fxmem_precision") == "cast":
                node.replace_all_uses_with(src)
                graph.erase_node(node)
                removed += 1
                changed = True
                continue
            # x(a) -> cast(b) -> cast(a) with b at least as wide as a: the pair is the identity
            if src.op == "call_function" and src.target in CAST_OPS and _pure_dtype_cast(src):
                origin = src.args[0]
                origin_dt = orig_float_dtype(origin) if isinstance(origin, fx.Node) else None
                if origin_dt == dst_dt and torch.finfo(src_dt).bits >= torch.finfo(origin_dt).bits \
                        and not (src_dt == torch.float16 and origin_dt == torch.bfloat16) \
                        and not (src_dt == torch.bfloat16 and origin_dt == torch.float16):
                    node.replace_all_uses_with(origin)
                    graph.erase_node(node)
                    if all(user.target is aten._assert_tensor_metadata.default for user in src.users):
                        for user in list(src.users):
                            graph.erase_node(user)  # checks of a value that no longer exists
                        graph.erase_node(src)
                        removed += 1
                    removed += 1
                    changed = True
    graph.lint()
    graph_module.recompile()
    return removed


def _pure_dtype_cast(node: fx.Node) -> bool:
    kwargs = {k: v for k, v in node.kwargs.items() if k not in ("dtype", "layout", "copy", "non_blocking")}
    if kwargs.get("memory_format") is not None:
        return False
    dev = kwargs.get("device")
    src = node.args[0]
    if dev is not None and node_value(src) is not None and torch.device(dev) != node_value(src).device:
        return False
    return True
