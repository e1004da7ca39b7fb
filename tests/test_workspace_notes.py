"""What the estimate leaves out on CUDA is named: cuDNN convolution workspaces (measured on an H200 up to 640 MiB
for one op, benchmarks/results/cuda_allocator_gap.md), never silently zero."""
from __future__ import annotations

import pytest

import fxmem
from fxmem.cli import main
from fxmem.costmodel import estimate
from fxmem.costmodel.workspaces import convolution_count

from .conftest import ROOT, example_module as load_example


@pytest.fixture(scope="module")
def unet():
    ex = load_example("unet")
    model = ex.build_model(base=8)
    return fxmem.capture(model, ex.example_inputs(batch=2, size=32)), ex.loss_fn


def test_a_cuda_estimate_names_the_convolutions_workspaces(unet):
    program, loss_fn = unet
    count = convolution_count(program)
    assert count >= 10  # the U-Net's convolutions and transposed convolutions
    notes = estimate(program, mode="train", loss_fn=loss_fn, device="cuda").notes
    assert [n for n in notes if n.startswith("not counted on CUDA")] == [
        f"not counted on CUDA: the cuDNN workspaces of {count} convolution call(s), taken and given back while each "
        "runs (forward and backward); they can raise the allocator's peak above this estimate (up to 640 MiB for "
        "one op on an H200: benchmarks/results/cuda_allocator_gap.md)"]


def test_cpu_estimates_and_models_without_convolutions_carry_no_such_note(unet):
    program, loss_fn = unet
    assert not estimate(program, mode="train", loss_fn=loss_fn).notes
    ex = load_example("gpt")
    gpt = fxmem.capture(ex.build_model(n_layer=1), ex.example_inputs(batch=2))
    assert convolution_count(gpt) == 0
    assert not estimate(gpt, mode="train", loss_fn=ex.loss_fn, device="cuda").notes


def test_the_cli_prints_the_note_for_cuda(capsys):
    code = main(["estimate", str(ROOT / "examples" / "unet.py"), "--device", "cuda"])
    out = capsys.readouterr().out
    assert code == 0
    assert "note: not counted on CUDA: the cuDNN workspaces of" in out
