"""Activation offload on a CUDA device: tier `auto` is the pinned host tier there. Saved tensors are copied to pinned
host memory on a side stream while their region computes, come back one region ahead of backward (prefetch), and
training stays bit-exact; the device holds fewer activation bytes after forward, as the cost model estimates.
Gradient offload (OffloadedOptimizer) keeps accumulated gradients exact. The CPU side is test_offload.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem
from fxmem.costmodel import estimate
from fxmem.nn.offload import OffloadedOptimizer, OffloadRegion, OffloadRuntime
from fxmem.nn.offload.store import OffloadEntry, PackedTensor, StepStore
from fxmem.program import Program

from .conftest import on_device
from .test_offload import _Body, _gpt, _regions, _train, _transform, reference_grads, run_bodies

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def gpt_offloaded():
    model, x = _gpt()
    model, x = model.to(DEVICE), on_device(x, DEVICE)
    ref = copy.deepcopy(model)
    return ref, _transform(model, x), x


def test_auto_tier_is_pinned_host_memory_on_cuda(gpt_offloaded):
    _, res, _ = gpt_offloaded
    regions = _regions(res.module)
    assert regions, res.report.to_markdown()
    assert {m.runtime.tier for m in regions.values()} == {"cpu"}
    assert all(m.fxmem_region.tier == "cpu" for m in regions.values())


def test_training_is_bit_exact_with_dropout_on_cuda(gpt_offloaded):
    ref, res, x = gpt_offloaded
    a, b = copy.deepcopy(ref), copy.deepcopy(res.module)
    losses_a, grads_a, params_a = _train(a, x)
    losses_b, grads_b, params_b = _train(b, x)
    assert all(torch.equal(u, v) for u, v in zip(losses_a, losses_b)), (losses_a, losses_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), (name, (grads_a[name] - grads_b[name]).abs().max())
        assert torch.equal(params_a[name], params_b[name]), name
    runtime = next(iter(_regions(b).values())).runtime
    assert runtime.last_step_bytes > 0 and runtime.last_step_count > 0


def test_device_activations_drop_as_estimated(gpt_offloaded):
    """fxmem.measure counts device memory on CUDA (the pinned host copies are not): the activations after forward
    halve at least, and the static estimate of the offloaded program is what the step holds."""
    ref, res, x = gpt_offloaded
    base = fxmem.measure(copy.deepcopy(ref), x)
    after = fxmem.measure(copy.deepcopy(res.module), x)
    assert after.activations <= 0.5 * base.activations, (after.activations, base.activations)
    prog = Program(res.module, x, {}, "train")
    prog.refresh()
    est = estimate(prog)
    assert abs(est.activations - after.activations) <= 0.02 * after.activations + 4096
    assert abs(est.peak - after.peak) <= 0.05 * after.peak
    offloaded = copy.deepcopy(res.module)
    held = _allocated_after_forward(copy.deepcopy(ref), x), _allocated_after_forward(offloaded, x)
    runtime = next(iter(_regions(offloaded).values())).runtime
    assert runtime.last_step_bytes > 0
    assert held[0] - held[1] >= 0.9 * runtime.last_step_bytes, (held, runtime.last_step_bytes)


def _allocated_after_forward(module, x) -> int:
    """Device bytes the CUDA allocator holds once a training forward is done (what backward will use)."""
    module.train()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated(DEVICE)
    loss = module(*x).float().pow(2).mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(DEVICE) - start
    loss.backward()
    return held


def test_copies_run_on_a_side_stream_into_pinned_memory_and_prefetch(monkeypatch):
    """Three regions by hand (test_offload's body: views, aliasing, a tiny tensor): each write goes to pinned host
    memory on a stream that is not the compute stream, and in backward region k's tensors start coming back when
    backward enters region k + 1, before region k's first use. Gradients equal the plain bodies' bit for bit."""
    torch.manual_seed(0)
    runtime = OffloadRuntime("cpu", prefetch=1, min_bytes=0)
    regions = [OffloadRegion(_Body(), runtime, index=i, last=(i == 2), param_args=(1,)) for i in range(3)]
    weights = [nn.Parameter(torch.randn(16, 16, device=DEVICE)) for _ in range(3)]
    x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    log, streams, pinned = [], [], []
    real_write, real_read = OffloadEntry.start_write, OffloadEntry.start_read
    real_unpack, real_side = PackedTensor.unpack, StepStore.side_stream

    def start_write(self, u8):
        real_write(self, u8)
        pinned.append(self.host.is_pinned())

    def start_read(self):
        if self.buf is None:
            log.append(("read", self.slot))
        return real_read(self)

    def unpack(self):
        log.append(("use", self.entry.slot))
        return real_unpack(self)

    def side_stream(self, device):
        stream = real_side(self, device)
        streams.append((stream, torch.cuda.current_stream(device)))
        return stream

    ref, ref_grads = reference_grads(regions, x, weights)
    for cls, name, fn in ((OffloadEntry, "start_write", start_write), (OffloadEntry, "start_read", start_read),
                          (PackedTensor, "unpack", unpack), (StepStore, "side_stream", side_stream)):
        monkeypatch.setattr(cls, name, fn)
    got = run_bodies(regions, x, weights)
    got.backward()
    assert torch.equal(ref, got)
    for a, b in zip(ref_grads, [x.grad] + [w.grad for w in weights]):
        assert torch.equal(a, b)
    assert pinned and all(pinned)
    assert streams and all(side != current for side, current in streams)
    uses = [slot for kind, slot in log if kind == "use"]
    assert uses and uses[0] == 2
    for slot in (0, 1):
        assert log.index(("use", slot + 1)) < log.index(("read", slot)) < log.index(("use", slot))


def test_forward_never_waits_on_the_host_for_a_copy(gpt_offloaded, monkeypatch):
    """A region's end drops its device copies without a host-side wait: the allocator holds them until the side
    stream has copied them (record_stream); a wait would hold back the next region's kernel launches."""
    _, res, x = gpt_offloaded
    waits = []
    for cls in (torch.cuda.Event, torch.cuda.Stream):
        real = cls.synchronize
        monkeypatch.setattr(cls, "synchronize", lambda self, real=real: (waits.append(type(self)), real(self))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: waits.append("device"))
    module = copy.deepcopy(res.module).train()
    out = module(*x)
    assert waits == []
    out.float().pow(2).mean().backward()


def test_offloaded_optimizer_accumulates_gradients_exactly_on_cuda():
    """Two backward passes before a step (gradient accumulation): the second gradient is added on the host to the
    first, which an asynchronous copy may not have finished. The step equals AdamW run on the host on the gradients
    the device accumulated (the same optimizer arithmetic on the same values: bit for bit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 2048)).to(DEVICE)
    twin = copy.deepcopy(model)
    offloaded = OffloadedOptimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    batches = [torch.randn(256, 2048, device=DEVICE) for _ in range(2)]
    for module in (model, twin):
        for batch in batches:
            module(batch).square().mean().backward()
    assert offloaded.moved == 2 * len(offloaded.params)
    offloaded.step()
    host = [nn.Parameter(p.detach().cpu()) for p in twin.parameters()]
    for h, p in zip(host, twin.parameters()):
        h.grad = p.grad.cpu()
    torch.optim.AdamW(host, lr=1e-3).step()
    for got, want in zip(model.parameters(), host):
        assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()
