"""4-bit linears (QLoRA bases) keep their gradients through any sequence of eval/train calls.

bitsandbytes' `Linear4bit.forward` re-lays a 4-bit weight out for its CPU inference kernel on an eval-mode call
without grad (on CPUs with AVX512-BF16, as this machine's); that kernel records no autograd. `QuantLinear` keeps
the standard layout: gradients after eval calls equal a fresh module's, and a weight found in the CPU layout is
put back (same weights, the aux buffers re-read).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxmem
from fxmem.nn.lowbit import FrozenLinear, LoRALinear, QuantLinear

warnings.filterwarnings("ignore")
bnb = pytest.importorskip("bitsandbytes")

KINDS = [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _cpu_layout(q: QuantLinear) -> bool:
    return bool(getattr(q.inner.weight.quant_state, "packing_format_for_cpu", False))


def _grad_step(module: nn.Module, x: torch.Tensor, head: torch.Tensor):
    """A training-mode forward and backward: output, and the gradients of the input and trainable parameters."""
    module.train()
    xi = x.clone().requires_grad_(True)
    y = module(xi)
    (y * head).sum().backward()
    grads = {"input": xi.grad.clone()}
    grads.update({n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad})
    module.zero_grad(set_to_none=True)
    return y.detach(), grads


def _eval_calls(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The eval-mode calls users and fxmem's verification make: under no_grad, and with grad on for an input that
    needs none."""
    module.eval()
    with torch.no_grad():
        a = module(x)
    b = module(x).detach()
    return [a, b]


def _assert_same(got: dict, want: dict):
    assert list(got) == list(want)
    for name, g in want.items():
        assert torch.equal(got[name], g), f"{name}: max diff {(got[name] - g).abs().max().item()}"


def _dense_twin(q: QuantLinear) -> nn.Linear:
    """An fp32 nn.Linear with the 4-bit layer's dequantized weights (the reference for its gradients)."""
    lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
    with torch.no_grad():
        lin.weight.copy_(q.dequantized_weight())
        if q.bias is not None:
            lin.bias.copy_(q.bias)
    return lin.requires_grad_(False)


def _quant(kind: str, double_quant: bool, out_features: int = 96, device: str = "cpu") \
        -> tuple[QuantLinear, nn.Linear]:
    torch.manual_seed(0)
    lin = nn.Linear(64, out_features).to(device)
    return QuantLinear(lin.weight, lin.bias, kind, double_quant=double_quant), lin


def _lora(base: nn.Module) -> LoRALinear:
    lora = LoRALinear(base, base.in_features, base.out_features, rank=4)
    with torch.no_grad():
        lora.lora_B.normal_(0, 0.1)  # B = 0 at init would give lora_A no gradient
    return lora


# ============================================================================================ one layer

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,double_quant", KINDS)
@pytest.mark.parametrize("wrap", ["quant", "lora"])
def test_4bit_layer_gradients_unchanged_by_eval_calls(kind, double_quant, wrap, device):
    """train step, eval calls, train step: the input and adapter gradients, the outputs in both modes, the state's
    layout and the aux buffers (and so the bytes fxmem.measure counts) are those of a module that never saw eval."""
    q, _ = _quant(kind, double_quant, device=device)
    module = _lora(q).to(device) if wrap == "lora" else q
    fresh = copy.deepcopy(module)
    torch.manual_seed(1)
    x, head = torch.randn(6, 64, device=device), torch.randn(6, 96, device=device)
    buffers_before = {n: b.nbytes for n, b in q.named_buffers()}

    y_ref, grads_ref = _grad_step(fresh, x, head)
    _grad_step(module, x, head)
    eval_outs = _eval_calls(module, x)
    with torch.no_grad():  # code that calls the bitsandbytes layer itself, in eval mode
        q.inner(x)
    y, grads = _grad_step(module, x, head)

    assert not _cpu_layout(q)
    _assert_same(grads, grads_ref)
    assert torch.equal(y, y_ref)
    for out in eval_outs + _eval_calls(module, x):  # eval outputs: the training-mode ones, before and after
        assert torch.equal(out, y_ref)
    assert {n: b.nbytes for n, b in q.named_buffers()} == buffers_before
    for name, t in q.aux_tensors().items():
        assert q.get_buffer(name) is t, name
    assert grads["input"].abs().sum() > 0
    if wrap == "lora":
        assert grads["lora_A"].abs().sum() > 0 and grads["lora_B"].abs().sum() > 0


def test_eval_call_works_when_out_features_is_not_a_multiple_of_32():
    """bitsandbytes' CPU inference layout needs out_features % 32 == 0 (it asserts); the standard one does not."""
    q, lin = _quant("nf4", True, out_features=40)
    x = torch.randn(3, 64)
    q.eval()
    with torch.no_grad():
        y = q(x)
    assert (y - lin(x)).norm() / lin(x).norm() < 0.2


def to_cpu_layout(q: QuantLinear) -> None:
    """Re-lay q's 4-bit weight out as `Linear4bit.forward` does on an eval-mode CPU call (what an older fxmem left
    in a result; the conversion is plain torch, so any CPU can make it)."""
    w = q.inner.weight
    w.data, _ = bnb.functional._convert_weight_packed_for_cpu(w.data, w.quant_state)
    assert _cpu_layout(q)


@pytest.mark.parametrize("kind,double_quant", KINDS)
def test_weight_in_cpu_layout_is_restored_with_the_same_weights(kind, double_quant):
    """A weight in bitsandbytes' CPU inference layout is put back in the standard layout on the next call: the same
    4-bit codes, the absmax that layout computes with (bf16 values), gradients through it, aux buffers that are the
    state's tensors (none stale)."""
    q, _ = _quant(kind, double_quant)
    qs = q.inner.weight.quant_state
    codes = q.inner.weight.data.clone()
    absmax = qs.absmax.float()
    if qs.nested:
        absmax = bnb.functional.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    x = torch.randn(5, 64)
    to_cpu_layout(q)
    y_cpu_kernel = None
    if bnb.functional.has_avx512bf16():  # bitsandbytes' bf16 kernel for that layout
        with torch.no_grad():
            y_cpu_kernel = bnb.matmul_4bit(x, q.inner.weight.t(), quant_state=qs) + q.bias

    xi = x.clone().requires_grad_(True)
    y = q(xi)
    y.sum().backward()

    assert not _cpu_layout(q)
    qs = q.inner.weight.quant_state
    assert torch.equal(q.inner.weight.data, codes)
    assert not qs.nested and torch.equal(qs.absmax, absmax.to(torch.bfloat16).float())
    for name, t in q.aux_tensors().items():
        assert q.get_buffer(name) is t, name
    assert not any(n.startswith("q2_") for n, _ in q.named_buffers())
    dense = _dense_twin(q)
    assert torch.allclose(y, dense(x), rtol=1e-5, atol=1e-5)
    assert torch.allclose(xi.grad, dense.weight.sum(0).expand_as(x), rtol=1e-5, atol=1e-5)
    if y_cpu_kernel is not None:
        assert (y - y_cpu_kernel).norm() / y_cpu_kernel.norm() < 1e-2  # bf16 compute, the same weights


# ============================================================================================ a transformed model

class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(self.norm(x)))
        return self.fc3(torch.nn.functional.gelu(self.fc2(h)))


def _transformed(qlora: bool, verify: bool):
    torch.manual_seed(0)
    precision = {"enabled": True, "compute": "fp32", "weights": "nf4", "tolerance": 0.5, "loss_steps": 0}
    if qlora:
        precision["qlora"] = {"rank": 4}
    policy = {"version": 1, "extends": "low", "verify": {"enabled": verify, "lossy_tolerance": 0.5},
              "passes": {"attention": {"enabled": False}, "checkpoint": {"enabled": False},
                         "precision": precision}}
    res = fxmem.transform(_MLP(), (torch.randn(8, 64),), policy=policy)
    assert next(r for r in res.records if r.name == "precision").status == "applied"
    gm = res.module
    for mod in gm.modules():
        if isinstance(mod, LoRALinear):
            with torch.no_grad():
                mod.lora_B.normal_(0, 0.1)
    return gm


def _dense_model(gm: nn.Module) -> nn.Module:
    """The transformed module with every 4-bit layer replaced by its dequantized fp32 twin."""
    dense = copy.deepcopy(gm)
    for name, mod in list(dense.named_modules()):
        if isinstance(mod, QuantLinear):
            parent, _, leaf = name.rpartition(".")
            dense.get_submodule(parent)._modules[leaf] = _dense_twin(mod)
    return dense


@pytest.mark.parametrize("qlora", [True, False], ids=["qlora", "nf4_weights"])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
def test_transformed_model_gradients_after_eval_calls(qlora, verify):
    """The module fxmem.transform returns (its verification ran eval-mode calls), then a train step, an eval call
    and a train step: the input and every trainable parameter (the adapters; with nf4 weights alone the LayerNorm
    before the 4-bit layers) get the gradients of the same model with dense dequantized weights, and exactly those
    of a copy that never saw the eval call."""
    gm = _transformed(qlora, verify)
    assert all(not _cpu_layout(m) for m in gm.modules() if isinstance(m, QuantLinear))
    fresh, dense = copy.deepcopy(gm), _dense_model(gm)
    torch.manual_seed(1)
    x, head = torch.randn(8, 64), torch.randn(8, 64)

    _, grads_fresh = _grad_step(fresh, x, head)
    _grad_step(gm, x, head)
    eval_out = _eval_calls(gm, x)[0]
    y, grads = _grad_step(gm, x, head)
    y_dense, grads_dense = _grad_step(dense, x, head)

    _assert_same(grads, grads_fresh)
    trainable = [n for n in grads if n != "input"]
    assert trainable and all(("lora_" in n) == qlora for n in trainable)
    assert qlora or "norm.weight" in trainable
    for name, g in grads_dense.items():
        assert g.abs().sum() > 0, name
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-5), name
    assert torch.equal(eval_out, y)
    assert torch.allclose(y, y_dense, rtol=1e-5, atol=1e-5)


def test_frozen_linear_matches_the_linear_it_replaces():
    """The base of an adapter on a reverted site: nn.Linear's (out, in) weight and HF Conv1D's (in, out) weight
    (aten.addmm) give the original outputs; bf16 compute casts in and back; the weights are held, not copied."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    x = torch.randn(5, 16)
    base = FrozenLinear(lin.weight, lin.bias)
    assert torch.equal(base(x), lin(x)) and base.weight.data_ptr() == lin.weight.data_ptr()
    w_t = lin.weight.detach().t().contiguous()
    conv1d = FrozenLinear(w_t, lin.bias, transposed=True)
    assert (conv1d.in_features, conv1d.out_features) == (16, 24)
    assert torch.allclose(conv1d(x), torch.addmm(lin.bias, x, w_t), rtol=1e-6, atol=1e-6)
    low = FrozenLinear(lin.weight, lin.bias, compute_dtype=torch.bfloat16)
    y = low(x)
    assert y.dtype == torch.float32
    want = torch.nn.functional.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    assert torch.equal(y, want.float())
    assert not any(p.requires_grad for p in low.parameters())
