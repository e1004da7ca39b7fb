"""Capture on a CUDA device: a model on the GPU whose custom autograd.Function has another backward than
autograd's is refused there as on the CPU (the gradient comparison draws its cotangents on the CPU generator and
puts them on the outputs' device), and `plan_batch` scales CUDA inputs on their device. CPU side:
test_capture_faithful.py, test_costmodel.py."""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem.errors import CaptureError

from .conftest import example_on
from .test_capture_faithful import HalfGrad, Square, _FnNet

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda")


def test_custom_function_with_other_backward_is_refused_on_cuda():
    torch.manual_seed(0)
    model, x = _FnNet(HalfGrad).to(DEVICE), torch.randn(4, 8, device=DEVICE)
    with pytest.raises(CaptureError) as e:
        fxmem.capture(model, (x,))
    assert "parameter 'fc.weight'" in str(e.value)


def test_custom_function_with_autograd_backward_is_compared_on_cuda():
    torch.manual_seed(0)
    model, x = _FnNet(Square).to(DEVICE), torch.randn(4, 8, device=DEVICE)
    program = fxmem.capture(model, (x,))
    assert any("Square" in n and "gives the same gradients" in n for n in program.notes), program.notes


def test_plan_batch_scales_inputs_on_their_device():
    model, args, kwargs, loss_fn = example_on("gpt", DEVICE, n_layer=2)
    program = fxmem.capture(model, args, kwargs)
    one = fxmem.estimate(program, loss_fn=loss_fn).peak
    plan = fxmem.plan_batch(program, budget=4 * one, loss_fn=loss_fn)
    assert plan["batch"] > args[0].shape[0] and plan["peak"] <= plan["usable"], plan
