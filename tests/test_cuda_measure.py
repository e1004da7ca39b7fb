"""Measurement and batch planning on a CUDA device. `fxmem.measure` counts live tensor storages on the device; the
caching allocator adds block rounding, cached segments and kernel workspaces on top. Both are recorded for the same
step and shown side by side; the static estimate stays within the CPU suite's tolerance of the count. And
`plan_batch(device="cuda")` is held to real steps: the batch it picks trains under an allocator capped at the
budget less the context reserve, the next size up does not fit its usable bytes."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

import fxmem

from .conftest import example_module, example_on

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda")
MIB = 2 ** 20
SMALL = {"gpt": dict(n_layer=2)}
WORKSPACES = 64 * MIB  # what kernels may allocate beside their outputs in one step (cuBLAS, cuDNN workspaces)


@pytest.mark.parametrize("name", ["gpt", "unet", "hf_gpt2"])
def test_measure_reports_the_allocator_beside_live_tensors(name):
    model, args, kwargs, loss_fn = example_on(name, DEVICE, **SMALL.get(name, {}))
    program = fxmem.capture(model, args, kwargs)
    prof = fxmem.measure(copy.deepcopy(program.module), args, kwargs, loss_fn=loss_fn)
    alloc = prof.allocator
    assert alloc is not None and prof.device.startswith(DEVICE.type)
    tracked = prof.peak - alloc["tracked_start"]
    requested = alloc["requested_peak"] - alloc["requested_start"]
    # every storage fxmem counts is an allocator block: the allocator's peak is at least fxmem's, over the step
    # and in all; what it asks for beyond is kernel workspaces
    assert alloc["allocated_peak"] >= prof.peak and prof.cuda_max_allocated == alloc["allocated_peak"]
    assert tracked <= requested <= 1.10 * tracked + WORKSPACES, (tracked, requested, alloc)
    assert "CUDA allocator on the same step" in prof.allocator_line()
    # the cost model on the device, held to the CPU suite's tolerances (test_costmodel.py)
    static = fxmem.estimate(program, loss_fn=loss_fn)
    traced = fxmem.estimate(program, loss_fn=loss_fn, method="traced")
    assert abs(static.peak / prof.peak - 1) <= 0.005, (name, static.peak, prof.peak, static.peak_at, prof.peak_at)
    assert abs(traced.peak / prof.peak - 1) <= 0.01, (name, traced.peak, prof.peak)


def test_transform_report_shows_both_measurements():
    model, args, kwargs, loss_fn = example_on("gpt", DEVICE, **SMALL["gpt"])
    res = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, policy="low", measure=True)
    text = res.report.to_markdown()
    assert text.count("CUDA allocator on the same step") == 2, text
    assert res.report.to_dict()["measured"]["after"]["allocator"]["allocated_peak"] > 0


# ============================================================================================ plan_batch

PLAN_MODEL = dict(n_layer=4, n_head=4, d_model=256, block_size=256, dropout=0.0)
PLAN_INPUTS = dict(batch=2, seq_len=256)
CONTEXT, FRAGMENTATION = 500 * 10 ** 6, 0.10  # plan_batch's CUDA reserve (its defaults)
PLAN_BUDGET = CONTEXT + 2 ** 30  # the context reserve plus 1 GiB for the step


def _batch(args, n: int):
    """The inputs at batch `n`, rows repeated as plan_batch scales them."""
    (x,) = args
    return (x.index_select(0, torch.arange(n, device=x.device) % x.shape[0]),)


def _measure_capped(module, args, loss_fn, cap: int):
    """fxmem.measure under an allocator that may hold `cap` bytes beyond what is allocated now; None on OOM."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(DEVICE).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated(DEVICE) + cap) / total,
                                             torch.cuda.current_device())  # (it needs an index)
    try:
        return fxmem.measure(module, args, loss_fn=loss_fn)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        gc.collect()
        torch.cuda.empty_cache()


def test_plan_batch_fits_and_the_next_size_up_does_not():
    """The budget is set so that the usable bytes fall halfway between the estimated peaks at the planned batch and
    one more (so an estimate a little off either way still decides the same). Trained for real under an allocator
    capped at the budget less the context reserve: the planned batch runs and peaks under the usable bytes, the
    next one peaks over them or runs out of memory."""
    model, _, _, loss_fn = example_on("gpt", DEVICE, **PLAN_MODEL)
    args = tuple(t.to(DEVICE) for t in example_module("gpt").example_inputs(**PLAN_INPUTS))
    program = fxmem.capture(model, args)
    first = fxmem.plan_batch(program, budget=PLAN_BUDGET, loss_fn=loss_fn, device="cuda")["batch"]
    peaks = [fxmem.estimate(program, _batch(args, n), loss_fn=loss_fn).peak for n in (first, first + 1)]
    budget = CONTEXT + int(sum(peaks) / 2 / (1 - FRAGMENTATION)) + 1
    plan = fxmem.plan_batch(program, budget=budget, loss_fn=loss_fn, device="cuda")
    batch, usable = plan["batch"], plan["usable"]
    assert batch == first >= 8 and peaks[0] <= usable < peaks[1], (plan, peaks)
    cap = budget - CONTEXT  # what the allocator may hold: the budget less the context reserve
    module = copy.deepcopy(program.module)
    fits = _measure_capped(module, _batch(args, batch), loss_fn, cap)
    assert fits is not None, f"out of memory at the planned batch {batch} ({plan})"
    assert fits.peak <= usable, (fits.peak, plan)
    over = _measure_capped(module, _batch(args, batch + 1), loss_fn, cap)
    assert over is None or over.peak > usable, (over.peak, plan)
