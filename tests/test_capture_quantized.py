"""A model that already holds fxmem's 4-bit layers (a saved result loaded again, a QLoRA model) is captured as it
computes: the captured program dequantizes from the layer's own weight and buffers with bitsandbytes' ops, so its
outputs and gradients equal the model's bit for bit, and the cost model is exact on it. An int8 layer cannot be
traced (bitsandbytes' outlier decomposition): capture refuses it, naming the module."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem
from fxmem.capture import capture
from fxmem.costmodel import estimate
from fxmem.errors import CaptureError
from fxmem.nn.lowbit import LoRALinear, QuantLinear

pytest.importorskip("bitsandbytes")


class Quantized(nn.Module):
    def __init__(self, kind: str, in_features: int, double_quant: bool = True, lora: bool = False):
        super().__init__()
        dense = nn.Linear(in_features, 96)
        self.proj = QuantLinear(dense.weight, dense.bias, kind, double_quant=double_quant)
        if lora:
            self.proj = LoRALinear(self.proj, in_features, 96, rank=4)
            nn.init.normal_(self.proj.lora_B)  # (zero at init: the update would not show)
        self.head = nn.Linear(96, 8)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)))


def _grads(model, x):
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().mean().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,in_features,double_quant,lora", [
    ("nf4", 32, True, False), ("nf4", 128, True, False), ("fp4", 48, False, False), ("nf4", 64, True, True)])
def test_a_4bit_model_is_captured_bit_exact(kind, in_features, double_quant, lora):
    torch.manual_seed(0)
    model = Quantized(kind, in_features, double_quant, lora)
    x = torch.randn(16, in_features)
    program = capture(model, (x,))
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "bitsandbytes.dequantize_4bit.default" in ops
    ref_out, ref_x_grad, ref_grads = _grads(copy.deepcopy(model), x)
    out, x_grad, grads = _grads(program.module, x)
    assert torch.equal(ref_out, out) and torch.equal(ref_x_grad, x_grad)
    assert len(grads) == len(ref_grads) == (4 if lora else 2)
    for (name, ref), got in zip(sorted(ref_grads.items()), [grads[name] for name in sorted(grads)]):
        assert torch.equal(ref, got), name


@pytest.mark.parametrize("in_features", [32, 128])
def test_the_cost_model_is_exact_on_a_captured_4bit_model(in_features):
    torch.manual_seed(0)
    model = Quantized("nf4", in_features)
    x = torch.randn(64, in_features)
    program = capture(model, (x,))
    est = estimate(program)
    measured = fxmem.measure(copy.deepcopy(program.module), (x,))
    assert (est.activations, est.peak) == (measured.activations, measured.peak)


def test_an_int8_layer_is_refused_by_name():
    torch.manual_seed(0)
    model = Quantized("int8", 32)
    with pytest.raises(CaptureError, match=r"'proj' \(QuantLinear\).*nf4/fp4"):
        capture(model, (torch.randn(4, 32),))


def test_transform_keeps_a_loaded_4bit_model_exact():
    torch.manual_seed(0)
    model = Quantized("nf4", 64, lora=True)
    x = torch.randn(32, 64)
    result = fxmem.transform(copy.deepcopy(model), (x,), policy="low")
    ref_out, ref_x_grad, ref_grads = _grads(copy.deepcopy(model), x)
    out, x_grad, grads = _grads(result.module, x)
    assert torch.equal(ref_out, out) and torch.equal(ref_x_grad, x_grad)
    assert sorted(grads) == sorted(ref_grads)
    for name in ref_grads:
        assert torch.equal(ref_grads[name], grads[name]), name
