"""The op table's save rules (`fxmem.ops.saved`) against what autograd really keeps: for each op call here, the
storages its rule names (inputs, outputs, the tensors of a list argument) are the storages autograd's saved-tensor
hooks see packed, no more, no fewer. These are the rules a mixture-of-experts router and its dispatch run on
(topk, index, index_add): before, topk was said to keep its input where it keeps its indices, index and index_put
kept nothing (their indices sit in a list), index_add missed its source, std and norms their result, gather its
input (Mixtral's activations 1.3% under the measured ones), scatter_reduce and index_reduce their self and result
(PyG's PNA 4% under), hardtanh (ReLU6) and threshold their input, not their result.

Every op the table holds a rule for is checked, not a list: `test_every_rule_in_the_table_is_checked` runs each
op autograd records a backward for (not an in-place overload, whose rule is its out-of-place one's; not a
composite, which saves through the ops it runs) on arguments made from its schema, or on a call of its own below
where the schema's are not valid, with every tensor input requiring a gradient and with only the first one.
That found the rules for a tensor exponent (`pow`), `remainder` and `fmod` by a tensor, `masked_select`,
`_unsafe_index` (upsampling's decomposition) and `adaptive_max_pool2d` (its indices) keeping too little."""
from __future__ import annotations

import pytest
import torch

from fxmem import ops as optable
import fxmem.nn.dropout_ops  # noqa: F401 - the table's custom ops (a dropout's packed mask)

aten = torch.ops.aten


def _x():
    return torch.randn(4, 6, requires_grad=True)


def _index():
    return torch.tensor([0, 2, 1])


def _source():
    return torch.randn(3, 6, requires_grad=True)


CALLS = {
    "topk": lambda: (aten.topk.default, (_x(), 2)),
    "sort": lambda: (aten.sort.default, (_x(),)),
    "max.dim": lambda: (aten.max.dim, (_x(), 1)),
    "min.dim": lambda: (aten.min.dim, (_x(), 1)),
    "kthvalue": lambda: (aten.kthvalue.default, (_x(), 2, 1)),
    "median.dim": lambda: (aten.median.dim, (_x(), 1)),
    "mode": lambda: (aten.mode.default, (_x(), 1)),
    "max (whole)": lambda: (aten.max.default, (_x(),)),
    "median (whole)": lambda: (aten.median.default, (_x(),)),
    "max of two": lambda: (aten.max.other, (_x(), torch.randn(4, 6))),
    "var": lambda: (aten.var.correction, (_x(), [1])),
    "var_mean": lambda: (aten.var_mean.correction, (_x(), [1])),
    "std": lambda: (aten.std.correction, (_x(), [1])),
    "std_mean": lambda: (aten.std_mean.correction, (_x(), [1])),
    "linalg_vector_norm": lambda: (aten.linalg_vector_norm.default, (_x(), 2, [1])),
    "norm": lambda: (aten.norm.ScalarOpt_dim, (_x(), 2, [1])),
    "index": lambda: (aten.index.Tensor, (_x(), [_index()])),
    "index, a whole dim first": lambda: (aten.index.Tensor, (_x(), [None, _index()])),
    "index_put": lambda: (aten.index_put.default, (_x(), [_index()], _source())),
    "index_add": lambda: (aten.index_add.default, (_x(), 0, _index(), _source())),
    "index_copy": lambda: (aten.index_copy.default, (_x(), 0, _index(), _source())),
    "index_select": lambda: (aten.index_select.default, (_x(), 0, _index())),
    "gather": lambda: (aten.gather.default, (_x(), 1, torch.zeros(4, 2, dtype=torch.long))),
    "scatter": lambda: (aten.scatter.src, (_x(), 1, torch.zeros(4, 2, dtype=torch.long), torch.randn(4, 2))),
    "embedding": lambda: (aten.embedding.default, (_x(), _index())),
    "scatter_add": lambda: (aten.scatter_add.default, (_x(), 0, _index().view(3, 1).expand(3, 6), _source())),
    "scatter_reduce amax": lambda: (aten.scatter_reduce.two,
                                    (_x(), 0, _index().view(3, 1).expand(3, 6), _source(), "amax")),
    "scatter_reduce sum": lambda: (aten.scatter_reduce.two,
                                   (_x(), 0, _index().view(3, 1).expand(3, 6), _source(), "sum")),
    "hardtanh": lambda: (aten.hardtanh.default, (_x(),)),
    "threshold": lambda: (aten.threshold.default, (_x(), 0.1, 0.0)),
    "index_reduce": lambda: (aten.index_reduce.default, (_x(), 0, _index(), _source(), "mean")),
}


def _t(*shape) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def _long(high: int, *shape) -> torch.Tensor:
    return torch.randint(0, high, shape)


# calls for ops whose schema-made arguments are not valid (shapes that must agree, ranges, keyword-only arguments):
# name -> (op, args[, kwargs])
SHAPED_CALLS = {
    # (fxmem's own: a dropout's packed mask, 24 elements in 3 bytes)
    "masked_scale": lambda: (torch.ops.fxmem.masked_scale.default,
                             (_t(4, 6), torch.randint(0, 256, (3,), dtype=torch.uint8), 1.25)),
    "mm": lambda: (aten.mm.default, (_t(4, 6), _t(6, 3))),
    "bmm": lambda: (aten.bmm.default, (_t(2, 4, 6), _t(2, 6, 3))),
    "addmm": lambda: (aten.addmm.default, (_t(3), _t(4, 6), _t(6, 3))),
    "baddbmm": lambda: (aten.baddbmm.default, (_t(2, 4, 3), _t(2, 4, 6), _t(2, 6, 3))),
    "convolution": lambda: (aten.convolution.default,
                            (_t(2, 3, 8, 8), _t(4, 3, 3, 3), _t(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
    "_convolution": lambda: (aten._convolution.default, (_t(2, 3, 8, 8), _t(4, 3, 3, 3), _t(4), [1, 1], [1, 1],
                                                         [1, 1], False, [0, 0], 1, False, False, True, True)),
    "native_layer_norm": lambda: (aten.native_layer_norm.default, (_t(4, 6), [6], _t(6), _t(6), 1e-5)),
    "native_group_norm": lambda: (aten.native_group_norm.default, (_t(2, 4, 3, 3), _t(4), _t(4), 2, 4, 9, 2, 1e-5)),
    "native_batch_norm": lambda: (aten.native_batch_norm.default,
                                  (_t(2, 3, 4, 4), _t(3), _t(3), torch.zeros(3), torch.ones(3), True, 0.1, 1e-5)),
    "_native_batch_norm_legit.no_stats": lambda: (aten._native_batch_norm_legit.no_stats,
                                                  (_t(2, 3, 4, 4), _t(3), _t(3), True, 0.1, 1e-5)),
    "_native_batch_norm_legit_functional": lambda: (
        aten._native_batch_norm_legit_functional.default,
        (_t(2, 3, 4, 4), _t(3), _t(3), torch.zeros(3), torch.ones(3), True, 0.1, 1e-5)),
    "_native_batch_norm_legit_no_training": lambda: (
        aten._native_batch_norm_legit_no_training.default,
        (_t(2, 3, 4, 4), _t(3), _t(3), torch.zeros(3), torch.ones(3), 0.1, 1e-5)),
    "_batch_norm_no_update": lambda: (aten._batch_norm_no_update.default,
                                      (_t(2, 3, 4, 4), _t(3), _t(3), torch.zeros(3), torch.ones(3), 0.1, 1e-5)),
    "masked_fill.Tensor": lambda: (aten.masked_fill.Tensor, (_t(4, 6), torch.rand(4, 6) > 0.5, torch.tensor(0.5))),
    "clamp": lambda: (aten.clamp.default, (_t(4, 6), -0.5, 0.5)),
    "clamp.Tensor": lambda: (aten.clamp.Tensor, (_t(4, 6), _t(4, 6), _t(4, 6))),
    "div.Tensor_mode": lambda: (aten.div.Tensor_mode, (_t(4, 6), _t(4, 6)), {"rounding_mode": "floor"}),
    "div.Scalar_mode": lambda: (aten.div.Scalar_mode, (_t(4, 6), 2.0), {"rounding_mode": "floor"}),
    "round.decimals": lambda: (aten.round.decimals, (_t(4, 6),), {"decimals": 1}),
    "norm.ScalarOpt_dim_dtype": lambda: (aten.norm.ScalarOpt_dim_dtype, (_t(4, 6), 2, [1], False),
                                         {"dtype": torch.float64}),
    "norm.ScalarOpt_dtype": lambda: (aten.norm.ScalarOpt_dtype, (_t(4, 6), 2), {"dtype": torch.float64}),
    "sort.stable": lambda: (aten.sort.stable, (_t(4, 6),), {"stable": True, "dim": 1}),
    "bernoulli": lambda: (aten.bernoulli.default, (torch.rand(4, 6, requires_grad=True),)),
    "bernoulli.Tensor": lambda: (aten.bernoulli.Tensor, (_t(4, 6), torch.rand(4, 6))),
    "scatter.reduce": lambda: (aten.scatter.reduce, (_t(4, 6), 1, _long(6, 4, 2), torch.randn(4, 2)),
                               {"reduce": "add"}),
    "scatter.value_reduce": lambda: (aten.scatter.value_reduce, (_t(4, 6), 1, _long(6, 4, 2), 0.5),
                                     {"reduce": "add"}),
    "repeat": lambda: (aten.repeat.default, (_t(4, 6), [2, 1])),
    "max_pool3d_with_indices": lambda: (aten.max_pool3d_with_indices.default, (_t(1, 2, 4, 4, 4), [2, 2, 2])),
    "nll_loss_forward": lambda: (aten.nll_loss_forward.default, (_t(4, 6), _long(6, 4), None, 1, -100)),
    "nll_loss2d_forward": lambda: (aten.nll_loss2d_forward.default, (_t(2, 3, 4, 4), _long(3, 2, 4, 4), None, 1,
                                                                     -100)),
    "binary_cross_entropy": lambda: (aten.binary_cross_entropy.default,
                                     (torch.rand(4, 6, requires_grad=True), torch.rand(4, 6))),
    "_ctc_loss": lambda: (aten._ctc_loss.default, (_t(8, 2, 5).log_softmax(-1), _long(4, 2, 3) + 1, [8, 8], [3, 3])),
    "_ctc_loss.Tensor": lambda: (aten._ctc_loss.Tensor, (_t(8, 2, 5).log_softmax(-1), _long(4, 2, 3) + 1,
                                                         torch.tensor([8, 8]), torch.tensor([3, 3]))),
    "permute": lambda: (aten.permute.default, (_t(4, 6), [1, 0])),
    "as_strided": lambda: (aten.as_strided.default, (_t(4, 6), [2, 2], [1, 1])),
    "_reshape_alias": lambda: (aten._reshape_alias.default, (_t(4, 6), [24], [1])),
    "view_as_real": lambda: (aten.view_as_real.default, (torch.randn(4, 3, dtype=torch.cfloat, requires_grad=True),)),
    "view_as_complex": lambda: (aten.view_as_complex.default, (_t(4, 3, 2),)),
    "adaptive_max_pool2d": lambda: (aten.adaptive_max_pool2d.default, (_t(2, 3, 4, 4), [2, 2])),
    "masked_select": lambda: (aten.masked_select.default, (_t(4, 6), torch.rand(4, 6) > 0.5)),
    "_unsafe_index": lambda: (aten._unsafe_index.Tensor, (_t(4, 6), [_long(4, 3)])),
    "pow.Tensor_Tensor": lambda: (aten.pow.Tensor_Tensor, (torch.rand(4, 6, requires_grad=True) + 0.5, _t(4, 6))),
    "pow.Scalar": lambda: (aten.pow.Scalar, (2.0, _t(4, 6))),
    "remainder.Tensor": lambda: (aten.remainder.Tensor, (_t(4, 6), torch.rand(4, 6, requires_grad=True) + 0.5)),
    "fmod.Tensor": lambda: (aten.fmod.Tensor, (_t(4, 6), torch.rand(4, 6, requires_grad=True) + 0.5)),
    "where": lambda: (aten.where.self, (torch.rand(4, 6) > 0.5, _t(4, 6), _t(4, 6))),
}

# table ops no call here checks, and why
UNCHECKED = {
    "CUDA kernels": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable"),
    "no CPU kernel": ("mm.dtype", "bmm.dtype", "addmm.dtype", "baddbmm.dtype"),
    "integer or bool inputs only (no gradient)": ("bitwise_and", "bitwise_or", "bitwise_not", "bincount",
                                                  "repeat_interleave.Tensor"),
    "random draws of a generator (no gradient)": ("rand_like.generator", "randn_like.generator"),
}


def _unchecked(op) -> bool:
    name = str(op).removeprefix("aten.")
    return any(name == entry or name.split(".")[0] == entry for entries in UNCHECKED.values() for entry in entries)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _packed_storages(op, args, kwargs=None) -> tuple[set, object]:
    """The storages autograd packs while `op(*args, **kwargs)` runs, and its output."""
    packed = set()

    def pack(tensor):
        packed.add(_storage(tensor))
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = op(*args, **(kwargs or {}))
    return packed, out


def _named_storages(op, args, out, kwargs=None) -> set:
    """The storages the op table's rule for this call names (a slot naming a non-tensor: a marker that fails)."""
    requires_grad = tuple(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args)
    slots, known = optable.saved(op, optable.SaveCtx(tuple(args), dict(kwargs or {}), requires_grad))
    assert known, op
    outs = out if isinstance(out, (tuple, list)) else (out,)
    named = set()
    for kind, position in slots:
        value = args[position] if kind in ("in", "list") and position < len(args) else \
            outs[position] if kind == "out" and position < len(outs) else (kwargs or {}).get(position)
        if kind == "list":
            named.update(_storage(tensor) for tensor in value if isinstance(tensor, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            named.add(_storage(value))
        else:
            named.add(f"{kind} {position} (not a tensor)")
    return named


@pytest.mark.parametrize("name", CALLS)
def test_the_op_table_names_what_autograd_keeps(name):
    torch.manual_seed(0)
    op, args = CALLS[name]()
    packed, out = _packed_storages(op, args)
    assert packed, f"{name}: autograd kept nothing (the case checks nothing)"
    assert _named_storages(op, args, out) == packed


# ------------------------------------------------------------------ every rule, on arguments made from its schema

SCHEMA_SHAPES = [(4, 6), (2, 3, 4, 5), (2, 3, 8)]


class _NotMade(Exception):
    """An argument type the schema-made calls do not fill."""


def _schema_argument(argument, shape):
    """A value for one positional schema argument; None to stop at an argument with a default (left to it)."""
    kind, name = str(argument.type), argument.name
    if kind == "Tensor":
        if name in ("index", "indices"):
            return _long(2, *shape)
        if name in ("mask", "condition"):
            return torch.rand(*shape) > 0.5
        return _t(*shape)
    if kind.startswith("Optional["):
        return None
    if argument.has_default_value():
        return _NotMade
    if kind in ("int", "SymInt"):
        return 1 if "dim" in name else 2
    if kind in ("List[int]", "List[SymInt]"):
        return [1] if "dim" in name else list(shape) if name in ("size", "shape") else [2] * max(1, len(shape) - 2)
    if kind in ("number", "float"):
        return 0.5
    if kind == "bool":
        return False
    if kind == "List[Tensor]":
        return [_t(*shape), _t(*shape)]
    if kind == "List[Optional[Tensor]]":
        return [_long(2, 3)]
    raise _NotMade(kind)


def _schema_args(op, shape) -> tuple:
    args = []
    for argument in op._schema.arguments:
        if argument.kwarg_only:
            continue
        value = _schema_argument(argument, shape)
        if value is _NotMade:
            break
        args.append(value)
    return tuple(args)


def _composite(op) -> bool:
    """Whether autograd records the ops `op` runs rather than `op` (CompositeImplicitAutograd); an overload only
    TorchScript knows (`numpy_T.a`) counts as one: it never reaches autograd."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    except RuntimeError:
        return True


def _checked_ops() -> list:
    """The table's ops autograd records a backward for, under their own name."""
    ops = []
    for op, info in optable.OPS.items():
        if op._schema.is_mutable or info.no_grad or _unchecked(op):
            continue
        if not any("Tensor" in str(a.type) for a in op._schema.arguments) or _composite(op):
            continue
        ops.append(op)
    return ops


_SHAPED = {str(call()[0]): name for name, call in {**CALLS, **SHAPED_CALLS}.items()}


def _a_call(op):
    """(args, kwargs) of a call of `op` that runs: its own call above, or one made from its schema."""
    name = _SHAPED.get(str(op))
    if name is not None:
        call = {**CALLS, **SHAPED_CALLS}[name]()
        return call[1], (call[2] if len(call) > 2 else {})
    for shape in SCHEMA_SHAPES:
        try:
            args = _schema_args(op, shape)
            op(*args)
            return args, {}
        except (_NotMade, RuntimeError, IndexError, NotImplementedError, TypeError):
            continue
    pytest.fail(f"{op}: no call runs on arguments made from its schema; add one to SHAPED_CALLS (or UNCHECKED, "
                "with why)")


def _only_first_needs_grad(args: tuple) -> tuple:
    """`args` with only the first tensor that requires grad still requiring it (the others detached; in a list
    argument, the list's first)."""
    first = [True]

    def keep_first(a):
        if isinstance(a, (list, tuple)):
            return type(a)(keep_first(t) for t in a)
        if isinstance(a, torch.Tensor) and a.requires_grad:
            if first[0]:
                first[0] = False
                return a
            return a.detach()
        return a
    return tuple(keep_first(a) for a in args)


@pytest.mark.parametrize("op", _checked_ops(), ids=str)
def test_every_rule_in_the_table_is_checked(op):
    """Each op with every tensor input requiring grad, then with only the first: the rule names what autograd
    keeps."""
    torch.manual_seed(0)
    args, kwargs = _a_call(op)
    for call_args in (args, _only_first_needs_grad(args)):
        packed, out = _packed_storages(op, call_args, kwargs)
        assert _named_storages(op, call_args, out, kwargs) == packed, [
            (i, tuple(a.shape), a.requires_grad) for i, a in enumerate(call_args) if isinstance(a, torch.Tensor)]
