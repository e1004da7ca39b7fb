"""Low-bit precision on a CUDA device, through bitsandbytes' CUDA kernels: int8 (LLM.int8()) and nf4/fp4 linears
built from CUDA weights hold their quantized state on the GPU where fxmem counts it, run bitsandbytes' ops (the
CUDA native library), and give the dense dequantized layer's outputs and input gradients; the precision pass turns
a CUDA model into QLoRA and trains its adapters; the `medium` preset's bf16 compute and AdamW8bit train on the GPU.
The 4-bit eval/train layout cases run on CUDA in test_qlora_gradients.py. CPU side: test_precision*.py."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxmem
from fxmem.compare import deviation
from fxmem.nn.lowbit import LoRALinear, QuantLinear

from .conftest import OpCounter, example_on
from .test_qlora_gradients import _dense_twin

pytestmark = pytest.mark.cuda
bnb = pytest.importorskip("bitsandbytes")
warnings.filterwarnings("ignore")
DEVICE = torch.device("cuda")
# bitsandbytes ops each kind dispatches to in a training-mode forward (CUDA kernels: backends/cuda/ops.py) and the
# relative output error against the dense layer with the dequantized weights (int8 also quantizes activations)
FORWARD_OPS = {"int8": {"int8_mixed_scaled_mm"}, "nf4": {"gemm_4bit"}, "fp4": {"gemm_4bit"}}
OUTPUT_TOL = {"int8": 5e-2, "nf4": 1e-3, "fp4": 1e-3}


def test_bitsandbytes_loaded_its_cuda_library():
    from bitsandbytes.cextension import lib
    assert lib.compiled_with_cuda, type(lib).__name__


@pytest.mark.parametrize("kind", ["int8", "nf4", "fp4"])
def test_quant_linear_from_cuda_weights_runs_bitsandbytes_on_the_gpu(kind):
    torch.manual_seed(0)
    lin = nn.Linear(256, 512).to(DEVICE)
    q = QuantLinear(lin.weight, lin.bias, kind)
    weight = q.inner.weight
    assert weight.device.type == DEVICE.type and weight.dtype == (torch.int8 if kind == "int8" else torch.uint8)
    aux = dict(q.named_buffers())
    assert aux and all(t.device.type == DEVICE.type for t in aux.values())
    assert ("scb" if kind == "int8" else "q_absmax") in aux, sorted(aux)
    assert q.weight_bytes() < 0.3 * q.dense_bytes()
    dense = _dense_twin(q).to(DEVICE)

    x = torch.randn(64, 256, device=DEVICE, requires_grad=True)
    counter = OpCounter()
    with counter:
        y = q(x)
    y.square().sum().backward()
    assert FORWARD_OPS[kind] <= set(counter.ops), sorted(counter.ops)
    xd = x.detach().clone().requires_grad_(True)
    yd = dense(xd)
    yd.square().sum().backward()
    assert deviation(yd, y).rel <= OUTPUT_TOL[kind]
    assert deviation(xd.grad, x.grad).rel <= 2 * OUTPUT_TOL[kind]


def test_qlora_transform_of_a_cuda_model_trains_its_adapters():
    """The precision pass on the decoder on the GPU: nf4 bases with LoRA adapters, on the device, and a few AdamW
    steps lower the loss while the 4-bit weights stay as they were. (The guard's top-1 limit is off: on a decoder
    with random weights nf4 changes most next-token choices, and the guard would revert the bases.)"""
    model, args, kwargs, loss_fn = example_on("gpt", DEVICE, n_layer=2, dropout=0.0)
    precision = {"enabled": True, "compute": "fp32", "weights": "nf4", "tolerance": 0.5, "loss_steps": 0,
                 "qlora": {"rank": 8}}
    res = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, policy={
        "version": 1, "extends": "low", "verify": {"lossy_tolerance": 0.5, "top1_agreement": 0.0},
        "passes": {"attention": {"enabled": False}, "checkpoint": {"enabled": False}, "precision": precision}})
    rec = next(r for r in res.records if r.name == "precision")
    assert rec.status == "applied" and rec.metrics["sites_reverted"] == 0, (rec.status, rec.reason, rec.metrics)
    gm = res.module
    adapters = [m for m in gm.modules() if isinstance(m, LoRALinear)]
    assert adapters and all(isinstance(m.base, QuantLinear) for m in adapters)
    assert {p.device.type for p in gm.parameters()} == {DEVICE.type}
    trainable = [p for p in gm.parameters() if p.requires_grad]
    codes = [m.base.inner.weight.detach().clone() for m in adapters]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = _train_steps(gm, opt, (args, kwargs), loss_fn)
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(c, m.base.inner.weight) for c, m in zip(codes, adapters))


def _train_steps(gm, opt, inputs, loss_fn, steps: int = 5) -> list[float]:
    """The losses of `steps` training steps of `gm` with `opt` on `inputs` (args, kwargs)."""
    args, kwargs = inputs
    gm.train()
    losses = []
    for _ in range(steps):
        loss = loss_fn(gm(*args, **kwargs), args)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def test_medium_preset_trains_in_bf16_with_adamw8bit_on_cuda():
    """bf16 compute (tensor cores) and AdamW8bit: the preset's passes apply on the GPU, the optimizer fxmem builds
    for it keeps uint8 state on the device, and steps lower the loss."""
    model, args, kwargs, loss_fn = example_on("gpt", DEVICE, n_layer=2, dropout=0.0)
    ref = copy.deepcopy(model)
    res = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, policy="medium")
    statuses = {r.name: (r.status, r.reason) for r in res.records}
    assert statuses["precision"][0] == "applied", statuses
    assert all(status in ("applied", "unchanged") for status, _ in statuses.values()), statuses
    gm = res.module
    with torch.no_grad():
        ref.eval()
        gm.eval()
        assert deviation(ref(*args, **kwargs), gm(*args, **kwargs)).rel <= 0.05
    opt = fxmem.make_optimizer(gm, "adamw8bit")
    losses = _train_steps(gm, opt, (args, kwargs), loss_fn)
    assert losses[-1] < losses[0], losses
    states = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    assert any(t.dtype == torch.uint8 and t.device.type == DEVICE.type for t in states)
