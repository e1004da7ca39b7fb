"""The op table: for every aten op fxmem meets, its category, FLOPs, and what autograd saves for backward.

Two levels of ops appear:
- graph level: the ops in a captured Program (`aten.linear`, `aten.matmul`, `aten.dropout`, ...); passes match on
  these, and the table gives their category;
- dispatch level: what those ops decompose into when they run below autograd (`aten.addmm`, `aten.bmm`,
  `aten.clone` for a non-viewable reshape, `aten.bernoulli_` for CPU dropout, ...). This is what autograd saves
  tensors for, so the static cost model applies the `saves` rules here.

`saves(ctx)` returns which inputs ("in", i), outputs ("out", i) and tensors inside list arguments ("list", i)
autograd keeps for this op, given which tensor inputs require grad. Rules follow the derivative formulas in
PyTorch's derivatives.yaml (checked against autograd's saves in tests/test_op_saves.py for the reductions and
indexing ops). Unknown ops get a conservative default (all tensor inputs saved when the output needs grad) and are
reported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx

aten = torch.ops.aten

# categories
MATMUL = "matmul"          # mm/bmm/linear/conv: expensive, worth keeping
POINTWISE = "pointwise"
REDUCTION = "reduction"
NORM = "normalization"
VIEW = "view"              # no new storage
RANDOM = "random"
ATTENTION = "attention"
INDEXING = "indexing"      # gather/scatter/index_select/embedding
CREATION = "creation"      # arange/zeros/full: no inputs needing grad
COPY = "copy"              # clone/_to_copy/cat: a new storage, nothing saved
LOSS = "loss"
OTHER = "other"


@dataclass(frozen=True)
class SaveCtx:
    """What the save rule needs: which tensor args need grad, and the op's arguments."""
    args: tuple
    kwargs: dict
    requires_grad: tuple[bool, ...]  # per positional arg (False for non-tensors)
    device: str = "cpu"

    def rg(self, index: int) -> bool:
        return index < len(self.requires_grad) and self.requires_grad[index]

    def is_tensor(self, index: int) -> bool:
        return index < len(self.args) and isinstance(self.args[index], torch.Tensor)


Saved = list  # of ("in", i) / ("out", i) / ("kw", name) / ("list", i): a positional input, an output, a keyword
# input, the tensors inside a positional list argument (index's indices)


@dataclass(frozen=True)
class OpInfo:
    category: str
    saves: Callable[[SaveCtx], Saved] = field(default=lambda c: [])
    flops: Callable[[tuple, object], int] | None = None  # (args, out) -> FLOPs
    grad_passthrough: bool = False  # gradient flows as a view of grad_out (no new buffer)
    # input 0's gradient is grad_out as it is or a view of it, whatever grad_out's strides (a reshape of a tensor
    # whose strides are all 0 is a view): not slice/select/expand (new buffers), neg or rsub (-grad)
    grad_view: bool = False
    # how backward hands grad_out to tensor inputs without new buffers: "shared" (add: the same tensor to every
    # input of the output's shape, when alpha is 1), "sliced" (cat, stack: each input a slice of it), "expanded"
    # (sum keeping the input's dtype: grad_out expanded to the input's shape; the static walk hands it on when every
    # stride is 0), "joined" (split, unbind: the outputs' gradients joined into a new one of the input's size)
    grad_alias: str = ""
    no_grad: bool = False  # the output never requires grad, whatever the inputs (x.new_zeros(...), zeros_like(x))
    # on CUDA, cuDNN takes a workspace from the allocator while the op (forward or backward) runs: no tensor, not
    # counted by the cost model or fxmem.measure (`fxmem.costmodel.workspaces` names it)
    cuda_workspace: bool = False
    # a custom op whose registered autograd formula runs it below autograd, with grad off (fxmem's own,
    # `fxmem.nn.dropout_ops`): a dispatch mode sees it as an op without a backward until its node returns
    custom_autograd: bool = False


# ---------------------------------------------------------------------------------------------- save rules
def _none(ctx):
    return []


def _in0(ctx):
    return [("in", 0)]


def _out0(ctx):
    return [("out", 0)]


def _in0_out0(ctx):  # prod, amax, logsumexp: the input and the result
    return [("in", 0), ("out", 0)]


def _mm(ctx):  # a @ b: grad_a needs b, grad_b needs a
    saved = []
    if ctx.rg(0):
        saved.append(("in", 1))
    if ctx.rg(1):
        saved.append(("in", 0))
    return saved


def _addmm(ctx):  # bias + a @ b
    saved = []
    if ctx.rg(1):
        saved.append(("in", 2))
    if ctx.rg(2):
        saved.append(("in", 1))
    return saved


def _mul(ctx):
    saved = []
    if ctx.is_tensor(1):
        if ctx.rg(0):
            saved.append(("in", 1))
        if ctx.rg(1):
            saved.append(("in", 0))
    return saved


def _div(ctx):
    if not ctx.is_tensor(1):
        return []
    saved = [("in", 1)] if (ctx.rg(0) or ctx.rg(1)) else []
    if ctx.rg(1):
        saved.append(("in", 0))
    return saved


def _masked_fill(ctx):
    return [("in", 1)]


def _where(ctx):
    return [("in", 0)]


def _conv(ctx):  # one backward formula for input, weight and bias: autograd saves both whichever needs a gradient
    return [("in", 0), ("in", 1)] if ctx.rg(0) or ctx.rg(1) or ctx.rg(2) else []


def _layer_norm(ctx):  # input, weight, bias, mean, rstd
    return [("in", 0), ("in", 2), ("in", 3), ("out", 1), ("out", 2)]


def _batch_norm(ctx):  # input, weight, running stats, save_mean, save_invstd
    return [("in", 0), ("in", 1)] + [("in", i) for i in (3, 4) if ctx.is_tensor(i)] + [("out", 1), ("out", 2)]


def _batch_norm_reserve(ctx):  # the same and the reserve (`_batch_norm_with_update`, `_batch_norm_no_update`)
    return _batch_norm(ctx) + [("out", 3)]


def _group_norm(ctx):
    return [("in", 0), ("in", 1), ("out", 1), ("out", 2)]


def _sdpa_flash_cpu(ctx):  # q, k, v, out, logsumexp (+ the CPU kernel's keyword attn_mask)
    mask = [("kw", "attn_mask")] if isinstance(ctx.kwargs.get("attn_mask"), torch.Tensor) else []
    return [("in", 0), ("in", 1), ("in", 2), ("out", 0), ("out", 1)] + mask


def _sdpa_math(ctx):
    return [("in", 0), ("in", 1), ("in", 2), ("in", 3)]


def _index_args(*idx):
    def rule(ctx):
        return [("in", i) for i in idx if ctx.is_tensor(i)]
    return rule


def _nll(ctx):  # the log-probabilities, the targets, the class weights, the total weight
    return [("in", 0), ("in", 1)] + ([("in", 2)] if ctx.is_tensor(2) else []) + [("out", 1)]


def _pow(ctx):
    """x ** c: the base; c ** y: the exponent and the result; x ** y: all three (whichever needs a gradient)."""
    if ctx.is_tensor(0) and ctx.is_tensor(1):
        return [("in", 0), ("in", 1), ("out", 0)]
    return [("in", 1), ("out", 0)] if ctx.is_tensor(1) else [("in", 0)]


def _by_divisor(ctx):  # remainder, fmod: a tensor divisor needing a gradient reads both (- grad * floor(a / b))
    return [("in", 0), ("in", 1)] if ctx.is_tensor(0) and ctx.is_tensor(1) and ctx.rg(1) else []


def _scatter(ctx):  # scatter's src / value: the index, for either gradient
    return [("in", 2)] if ctx.rg(0) or ctx.rg(3) else []


def _scatter_add(ctx):  # self's gradient passes through; the source's gathers by the index
    return [("in", 2)] if ctx.rg(3) else []


def _index_add(ctx):  # self's gradient passes through; the source's selects by the index (expanded as the source)
    return [("in", 2), ("in", 3)] if ctx.rg(3) else []


def _index_copy(ctx):  # self's gradient fills the index; the source's reads it (and the source's sizes)
    return ([("in", 2)] if ctx.rg(0) or ctx.rg(3) else []) + ([("in", 3)] if ctx.rg(3) else [])


def _max_pool(ctx):
    return [("in", 0), ("out", 1)]


def _all_tensor_inputs(ctx):
    return [("in", i) for i, a in enumerate(ctx.args) if isinstance(a, torch.Tensor)]


DEFAULT_SAVES = _all_tensor_inputs


# ---------------------------------------------------------------------------------------------- FLOPs
def _numel(value) -> int:
    return int(value.numel()) if isinstance(value, torch.Tensor) else 0


def _first_out(out):
    if isinstance(out, (tuple, list)):
        return out[0] if out else None
    return out


def _flops_mm(args, out):
    left, right = args[0], args[1]
    return 2 * left.shape[0] * left.shape[1] * right.shape[1]


def _flops_addmm(args, out):
    left, right = args[1], args[2]
    return 2 * left.shape[0] * left.shape[1] * right.shape[1] + _numel(_first_out(out))


def _flops_bmm(args, out):
    left, right = args[0], args[1]
    return 2 * left.shape[0] * left.shape[1] * left.shape[2] * right.shape[2]


def _flops_baddbmm(args, out):
    return _flops_bmm(args[1:], out) + _numel(_first_out(out))


def _flops_linear(args, out):
    inputs, weight = args[0], args[1]
    return 2 * (inputs.numel() // inputs.shape[-1]) * weight.shape[0] * weight.shape[1]


def _flops_matmul(args, out):
    left = args[0]
    output = _first_out(out)
    inner = left.shape[-1]
    return 2 * _numel(output) * inner


def _flops_conv(args, out):
    if len(args) > 6 and args[6] is True:  # aten.convolution(..., transposed=True, ...)
        return _flops_conv_transpose(args, out)
    # each output element meets in_channels / groups x kernel weights (w: out, in / groups, k...)
    weight = args[1]
    return 2 * _numel(_first_out(out)) * weight.shape[1] * math.prod(weight.shape[2:])


def _flops_conv_transpose(args, out):
    # each input element meets out_channels / groups x kernel weights (w: in, out / groups, k...); counted per output
    # element (in_channels x kernel) it would be stride^2 times too many at a 2x2 stride-2 upsampling
    weight = args[1]
    return 2 * _numel(args[0]) * weight.shape[1] * math.prod(weight.shape[2:])


def _flops_sdpa(args, out):
    query, key = args[0], args[1]
    b_h = math.prod(query.shape[:-2])
    return 4 * b_h * query.shape[-2] * key.shape[-2] * query.shape[-1]


def _flops_pointwise(args, out):
    return sum(_numel(t) for t in (out if isinstance(out, (tuple, list)) else [out]))


def _flops_reduce(args, out):
    return _numel(args[0]) if args and isinstance(args[0], torch.Tensor) else 0


def _flops_zero(args, out):
    return 0


def _flops_norm(args, out):
    return 5 * _numel(args[0])


def _flops_softmax(args, out):
    return 5 * _numel(args[0])


# ---------------------------------------------------------------------------------------------- the table
OPS: dict = {}


def _reg(ops, info):
    for op in ops:
        pkt = getattr(aten, op.split(".")[0], None)
        if pkt is None:
            continue
        if "." in op:
            overload = getattr(pkt, op.split(".", 1)[1], None)
            if overload is not None:
                OPS[overload] = info
        else:
            for name in pkt.overloads():
                OPS[getattr(pkt, name)] = info


_reg(["view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "movedim", "swapaxes",
      "numpy_T", "mT", "unsqueeze", "squeeze", "flatten", "unflatten", "view_as", "alias", "lift_fresh",
      "contiguous"], OpInfo(VIEW, _none, _flops_zero, grad_passthrough=True, grad_view=True))
_reg(["detach"], OpInfo(VIEW, _none, _flops_zero, no_grad=True))  # (a gradient never flows through it)
_reg(["expand", "expand_as", "slice", "select", "as_strided", "narrow", "diagonal", "unfold", "view_as_real",
      "view_as_complex"],
     OpInfo(VIEW, _none, _flops_zero, grad_passthrough=True))
_reg(["split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split", "unsafe_split_with_sizes",
      "unsafe_chunk"],
     OpInfo(VIEW, _none, _flops_zero, grad_passthrough=True, grad_alias="joined"))

_reg(["mm"], OpInfo(MATMUL, _mm, _flops_mm))
_reg(["bmm"], OpInfo(MATMUL, _mm, _flops_bmm))
_reg(["addmm"], OpInfo(MATMUL, _addmm, _flops_addmm))
_reg(["baddbmm"], OpInfo(MATMUL, _addmm, _flops_baddbmm))
_reg(["matmul", "einsum"], OpInfo(MATMUL, _mm, _flops_matmul))
_reg(["linear"], OpInfo(MATMUL, _mm, _flops_linear))
_reg(["convolution", "conv2d", "conv1d", "conv3d", "_convolution"],
     OpInfo(MATMUL, _conv, _flops_conv, cuda_workspace=True))
_reg(["conv_transpose1d", "conv_transpose2d", "conv_transpose3d"],
     OpInfo(MATMUL, _conv, _flops_conv_transpose, cuda_workspace=True))

_reg(["add", "add_"], OpInfo(POINTWISE, _none, _flops_pointwise, grad_passthrough=True, grad_alias="shared",
                            grad_view=True))
_reg(["sub", "sub_"], OpInfo(POINTWISE, _none, _flops_pointwise, grad_passthrough=True, grad_view=True))
_reg(["rsub", "neg"], OpInfo(POINTWISE, _none, _flops_pointwise, grad_passthrough=True))
_reg(["mul", "mul_"], OpInfo(POINTWISE, _mul, _flops_pointwise))
_reg(["div", "div_"], OpInfo(POINTWISE, _div, _flops_pointwise))
_reg(["gelu", "silu", "elu", "leaky_relu", "hardswish", "mish", "softplus", "log", "sin", "cos", "erf",
      "abs", "sqrt_", "hardtanh", "threshold"], OpInfo(POINTWISE, _in0, _flops_pointwise))
_reg(["pow", "pow_"], OpInfo(POINTWISE, _pow, _flops_pointwise))
_reg(["relu", "relu_", "sigmoid", "tanh", "exp", "rsqrt", "sqrt", "reciprocal"],
     OpInfo(POINTWISE, _out0, _flops_pointwise))
_reg(["masked_fill", "masked_fill_"], OpInfo(POINTWISE, _masked_fill, _flops_pointwise))
_reg(["where"], OpInfo(POINTWISE, _where, _flops_pointwise))
_reg(["clamp", "clamp_min", "clamp_max", "minimum", "maximum"], OpInfo(POINTWISE, _all_tensor_inputs, _flops_pointwise))
_reg(["eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "__and__", "__or__",
      "bitwise_and", "bitwise_or", "bitwise_not", "isnan", "isinf", "sign", "floor", "ceil", "round", "trunc",
      "floor_divide"], OpInfo(POINTWISE, _none, _flops_pointwise))
_reg(["remainder", "fmod"], OpInfo(POINTWISE, _by_divisor, _flops_pointwise))
_reg(["_softmax", "softmax", "_log_softmax", "log_softmax"], OpInfo(NORM, _out0, _flops_softmax))
_reg(["_safe_softmax"], OpInfo(NORM, _out0, _flops_softmax))  # SDPA math kernel (masked rows -> 0)
_reg(["native_layer_norm", "layer_norm"], OpInfo(NORM, _layer_norm, _flops_norm))
_reg(["native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "batch_norm",
      "_native_batch_norm_legit_no_training"], OpInfo(NORM, _batch_norm, _flops_norm))
_reg(["_batch_norm_with_update", "_batch_norm_no_update"], OpInfo(NORM, _batch_norm_reserve, _flops_norm))
_reg(["native_group_norm", "group_norm"], OpInfo(NORM, _group_norm, _flops_norm))
_reg(["_fused_rms_norm", "rms_norm"], OpInfo(NORM, lambda c: [("in", 0), ("out", 1)], _flops_norm))
_reg(["sum"], OpInfo(REDUCTION, _none, _flops_reduce, grad_alias="expanded"))
_reg(["mean", "cumsum", "any", "all", "argmax", "argmin", "histc", "bincount"], OpInfo(REDUCTION, _none, _flops_reduce))
_reg(["amax", "amin", "logsumexp", "prod"], OpInfo(REDUCTION, _in0_out0, _flops_reduce))
_reg(["max", "min", "var", "var_mean"], OpInfo(REDUCTION, _all_tensor_inputs, _flops_reduce))
# (autograd keeps the result too, for its backward: std's, a norm's, a full max's)
_reg(["max.default", "min.default", "median.default", "nanmedian.default", "std", "std_mean", "linalg_vector_norm",
      "norm"], OpInfo(REDUCTION, _in0_out0, _flops_reduce))
# a value chosen by index along a dim: only the indices are kept (the input's sizes suffice)
_reg(["max.dim", "min.dim", "topk", "sort", "kthvalue", "median.dim", "nanmedian.dim", "mode"],
     OpInfo(REDUCTION, lambda c: [("out", 1)], _flops_reduce))
_reg(["bernoulli", "bernoulli_", "rand_like", "randn_like", "uniform_", "normal_", "rand", "randn",
      "randint", "randperm"], OpInfo(RANDOM, _none, _flops_pointwise))
_reg(["native_dropout"], OpInfo(RANDOM, lambda c: [("out", 1)], _flops_pointwise))
_reg(["dropout", "feature_dropout", "alpha_dropout"], OpInfo(RANDOM, lambda c: [("out", 0)], _flops_pointwise))
_reg(["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
      "_scaled_dot_product_fused_attention_overrideable"], OpInfo(ATTENTION, _sdpa_flash_cpu, _flops_sdpa))
_reg(["scaled_dot_product_attention", "_scaled_dot_product_attention_math"],
     OpInfo(ATTENTION, _sdpa_math, _flops_sdpa))
_reg(["embedding"], OpInfo(INDEXING, _index_args(1), _flops_zero))
_reg(["index_select"], OpInfo(INDEXING, _index_args(2), _flops_zero))
_reg(["gather"], OpInfo(INDEXING, _index_args(0, 2), _flops_zero))
_reg(["index", "_unsafe_index"], OpInfo(INDEXING, lambda c: [("list", 1)], _flops_zero))  # the index tensors
_reg(["masked_select"], OpInfo(INDEXING, lambda c: [("in", 0), ("in", 1)], _flops_zero))  # the input and the mask
_reg(["scatter", "scatter_"], OpInfo(INDEXING, _scatter, _flops_pointwise))
# (with a reduction, neither gradient is implemented: nothing kept)
_reg(["scatter.reduce", "scatter.value_reduce", "scatter_.reduce", "scatter_.value_reduce"],
     OpInfo(INDEXING, _none, _flops_pointwise))
_reg(["scatter_add", "scatter_add_"], OpInfo(INDEXING, _scatter_add, _flops_pointwise))
# a reduction into self by index (PyG's max/min/mean aggregations): the formula reads self, the index, the source and
# the result, whatever the reduction (an in-place call saves the copy autograd makes of self, and self as the result)
_reg(["scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_"],
     OpInfo(INDEXING, lambda c: [("in", 0), ("in", 2), ("in", 3), ("out", 0)], _flops_pointwise))
_reg(["index_add", "index_add_"], OpInfo(INDEXING, _index_add, _flops_pointwise))  # the index, the source (expand_as)
_reg(["index_copy", "index_copy_"], OpInfo(INDEXING, _index_copy, _flops_pointwise))
_reg(["index_put", "index_put_"], OpInfo(INDEXING, lambda c: [("list", 1)], _flops_pointwise))
# creation ops: autograd records no backward for them, whatever their inputs (they read only shape, dtype, device)
_reg(["arange", "zeros", "ones", "full", "empty", "empty_like", "zeros_like", "ones_like", "full_like",
      "new_zeros", "new_ones", "new_empty", "new_full", "scalar_tensor", "eye", "linspace",
      "empty_strided", "sym_size", "sym_numel", "sym_stride", "_assert_tensor_metadata",
      "_local_scalar_dense", "lift_fresh_copy", "tensor"], OpInfo(CREATION, _none, _flops_zero, no_grad=True))
# ... except these, which pass gradients (tril/triu of a tensor that requires grad; in-place fills)
_reg(["tril", "triu", "fill_", "zero_"], OpInfo(CREATION, _none, _flops_zero))


def grad_free(op) -> bool:
    """The op's output never requires grad (a creation op reading only its input's shape, dtype or device)."""
    info = lookup(op)
    return info is not None and info.no_grad


def view_grad_is_new(op) -> bool:
    """A view whose backward makes its input's gradient a new buffer from its outputs' (select, slice: zeros of
    the input's shape with the gradient copied in; expand: the gradient summed; split, unbind: the outputs'
    gradients joined), not a view of it (a transpose, a reshape)."""
    info = lookup(op)
    return info is not None and info.category == VIEW and info.grad_passthrough and not info.grad_view


def view_grad_is_a_view(op) -> bool:
    """A view whose backward hands its input the output's gradient seen through the inverse view (a transpose, a
    permute, an unsqueeze), no new buffer: the op returns an alias of its input (not `_unsafe_view`'s fresh tensor)."""
    info = lookup(op)
    return info is not None and info.category == VIEW and info.grad_view and returns_alias(op)


def takes_cuda_workspace(op) -> bool:
    """The op takes a cuDNN workspace while it runs on CUDA (a convolution), which no tensor count includes."""
    info = lookup(op)
    return info is not None and info.cuda_workspace


def returns_alias(op) -> bool:
    """Whether the op's schema returns an alias of an input (a view op, not `_unsafe_view`)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(ret.alias_info is not None for ret in schema.returns)


_reg(["cat", "stack"], OpInfo(COPY, _none, _flops_zero, grad_alias="sliced"))
_reg(["clone", "_to_copy", "to", "repeat", "copy_", "copy", "roll", "flip", "pad",
      "constant_pad_nd", "repeat_interleave", "type_as", "tile", "upsample_nearest2d", "upsample_bilinear2d", "upsample_nearest1d"],
     OpInfo(COPY, _none, _flops_zero, grad_passthrough=False))
_reg(["max_pool2d_with_indices", "max_pool1d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool2d"],
     OpInfo(REDUCTION, _max_pool, _flops_reduce))
_reg(["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "avg_pool1d",
      "adaptive_avg_pool1d"], OpInfo(REDUCTION, _in0, _flops_reduce))
_reg(["nll_loss_forward", "nll_loss", "nll_loss2d_forward"], OpInfo(LOSS, _nll, _flops_reduce))
_reg(["cross_entropy_loss", "cross_entropy"], OpInfo(LOSS, _all_tensor_inputs, _flops_reduce))
_reg(["mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy_with_logits", "binary_cross_entropy",
      "kl_div", "huber_loss"], OpInfo(LOSS, _all_tensor_inputs, _flops_reduce))
# CTC (wav2vec2/HuBERT fine-tuning): the log-probabilities, targets and lengths, the losses and the alpha table
# (batch x frames x (2 x the longest target + 1): its size depends on the targets' values, see
# fxmem.fake.run_on_real_values)
_reg(["_ctc_loss"], OpInfo(LOSS, lambda c: _all_tensor_inputs(c) + [("out", 0), ("out", 1)], _flops_reduce))


_LOOKED_UP: dict = {}  # op -> entry (the table is filled at import and not changed after)


def register(op, info: OpInfo) -> None:
    """Enter an op that is not aten's (fxmem's own custom ops, `fxmem.nn.dropout_ops`) in the table."""
    OPS[op] = info
    _LOOKED_UP.pop(op, None)


def lookup(op) -> OpInfo | None:
    """The table entry for an OpOverload (or its packet), or None if unknown."""
    try:
        return _LOOKED_UP[op]
    except KeyError:
        pass
    except TypeError:  # unhashable callable
        return None
    info = OPS.get(op)
    if info is None and hasattr(op, "overloadpacket"):
        info = OPS.get(getattr(op.overloadpacket, "default", None))
    if info is None and functional_variant(op) is not None:
        info = lookup(functional_variant(op))  # clamp_ as clamp: what autograd saves of self is its value before
    _LOOKED_UP[op] = info
    return info


_FUNCTIONAL: dict = {}


def functional_variant(op):
    """The out-of-place overload an in-place op computes in place (aten.pow_.Scalar -> aten.pow.Tensor_Scalar: the
    same argument types, no mutation), or None. Its backward runs the same formula (on the value before the
    write, which autograd copies first when the formula reads it)."""
    try:
        return _FUNCTIONAL[op]
    except KeyError:
        pass
    except TypeError:  # unhashable callable
        return None
    schema = getattr(op, "_schema", None)
    name = schema.name.split("::")[-1] if schema is not None else ""
    found = None
    if schema is not None and schema.is_mutable and name.endswith("_") and not name.startswith("_"):
        packet_ = getattr(aten, name[:-1], None)
        types = [str(a.type) for a in schema.arguments]
        for overload in packet_.overloads() if packet_ is not None else ():
            candidate = getattr(packet_, overload)
            if not candidate._schema.is_mutable and [str(a.type) for a in candidate._schema.arguments] == types:
                found = candidate
                break
    _FUNCTIONAL[op] = found
    return found


def category(op) -> str:
    info = lookup(op)
    if info is not None:
        return info.category
    name = getattr(op, "__name__", "")
    if name in ("getitem",):
        return VIEW
    return OTHER


QUALIFIED = "qualified"  # "aten.softmax.int": str(op), what `fxmem.nn.remat.op_named` reads back
OVERLOAD = "overload"  # "softmax.int": the op's __name__
PACKET = "packet"  # "softmax": the overload packet's name (a python function's __name__)


def op_name(op, form: str = PACKET, *, calls_only: bool = False) -> str:
    """The name of `op`: an aten OpOverload or OpOverloadPacket, a python callable, or an fx node, named by the
    op it calls in the chosen `form` (above). A callable without a __name__ is named by str().

    A node that calls no function (placeholder, get_attr, call_module, call_method, output) is named by its
    target (a module path, a method name), or "" with `calls_only` (for matching against op names).
    """
    if isinstance(op, fx.Node):
        if op.op != "call_function":
            return "" if calls_only else str(op.target)
        op = op.target
    if form == QUALIFIED:
        return str(op)
    packet_op = getattr(op, "overloadpacket", None)
    if form == PACKET and packet_op is not None:
        return str(packet_op).split(".")[-1]
    return str(getattr(op, "__name__", op))


_PACKETS: dict = {}


def packet(op) -> str:
    """The packet name of a dispatcher op ("gelu" for aten.gelu.default), cached: selective checkpoint policies
    and the cost model ask it for every op they see. A plain callable gets the last dotted part of its str(), not
    its __name__: name graph targets with `op_name`."""
    try:
        return _PACKETS[op]
    except KeyError:
        name = _PACKETS[op] = str(getattr(op, "overloadpacket", op)).split(".")[-1]
        return name
    except TypeError:  # unhashable callable
        return str(getattr(op, "overloadpacket", op)).split(".")[-1]


def flops(op, args, out) -> int:
    info = lookup(op)
    if info is None or info.flops is None:
        return _flops_pointwise(args, out)
    try:
        return int(info.flops(args, out))
    except (AttributeError, IndexError, TypeError, ValueError):
        return _flops_pointwise(args, out)


def saved(op, ctx: SaveCtx) -> tuple[Saved, bool]:
    """(saved slots, known?) for one op call."""
    info = lookup(op)
    if info is None:
        return DEFAULT_SAVES(ctx), False
    return info.saves(ctx), True


# ops with no tensor outputs or that fxmem itself inserts; never "unknown"
IGNORED = {"getitem", "count_batch", "sym_size", "_assert_tensor_metadata", "_assert_scalar"}


def ignored(op) -> bool:
    """prim ops (device, layout queries) and bookkeeping ops carry no memory and are never 'unknown'."""
    name = str(op)
    parts = name.split(".")
    if parts[0] == "prim":
        return True
    return len(parts) > 1 and parts[1] in IGNORED


def written_positions(func) -> tuple[int, ...]:
    """Positions of the arguments an op writes in place (relu_'s self, an out= tensor), from its schema."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def written_args(func, args) -> list:
    """The positional arguments `func(*args)` writes in place."""
    return [args[i] for i in written_positions(func) if i < len(args)]
