"""Weight streaming (frozen teacher, inference) and gradient/optimizer offload: exactness, state_dict, memory."""
from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
from torch import nn

import fxmem
from fxmem.costmodel import estimate
from fxmem.errors import PolicyError
from fxmem.nn.offload import OffloadedOptimizer, WeightStreamer
from fxmem.program import Program

from .conftest import StarvedWorker, example_module


def _policy(**opts):
    return {"version": 1, "passes": {"offload": {"activations": False, "weights": True, **opts}}}


def _streamers(gm):
    return [m for m in gm.modules() if isinstance(m, WeightStreamer)]


# ============================================================================================ frozen teacher (KD)

@pytest.fixture(scope="module")
def gat():
    from fxmem.modelfile import split_inputs
    ex = example_module("gat")
    torch.manual_seed(0)
    model = ex.build_model()
    args, kwargs = split_inputs(ex.example_inputs(copies=3))
    ref = copy.deepcopy(model)
    res = fxmem.transform(model, args, kwargs, policy=_policy(), loss_fn=ex.loss_fn)
    return ex, ref, res, args, kwargs


def test_teacher_weights_leave_the_module_and_state_dict_is_unchanged(gat):
    ex, ref, res, args, kwargs = gat
    gm = res.module
    (ws,) = _streamers(gm)
    assert ws.names == ["teacher.convs.0", "teacher.convs.1"]
    teacher = {n for n, _ in ref.named_parameters() if n.startswith("teacher.")}
    assert teacher and not teacher & {n for n, _ in gm.named_parameters()}
    assert ws.bytes_offloaded == sum(p.numel() * p.element_size() for n, p in ref.named_parameters()
                                     if n in teacher)
    sd, sd_ref = gm.state_dict(), ref.state_dict()
    assert set(sd_ref) <= set(sd)
    for k, v in sd_ref.items():
        assert torch.equal(sd[k], v), k
    # the weights live in a scratch safetensors file of our own, mapped and already unlinked (unlink_early)
    assert os.path.basename(os.path.dirname(ws._path)).startswith("fxmem-offload-weights-")
    assert ws._dir is None and not os.path.exists(ws._path)


def test_teacher_streaming_is_exact_in_training(gat):
    ex, ref, res, args, kwargs = gat
    a, b = copy.deepcopy(ref), copy.deepcopy(res.module)
    for m in (a, b):
        m.train()
    torch.manual_seed(1)
    la = ex.loss_fn(a(*args, **kwargs), kwargs or args)
    torch.manual_seed(1)
    lb = ex.loss_fn(b(*args, **kwargs), kwargs or args)
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    gb = dict(b.named_parameters())
    for n, p in a.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.grad, gb[n].grad), n


def test_cost_model_sees_streamed_weights_as_transient(gat):
    ex, ref, res, args, kwargs = gat
    before = fxmem.estimate(copy.deepcopy(ref), args, kwargs, loss_fn=ex.loss_fn)
    prog = Program(res.module, args, kwargs, "train")
    prog.refresh()
    after = estimate(prog, loss_fn=ex.loss_fn)
    (ws,) = _streamers(res.module)
    assert before.params - after.params == ws.bytes_offloaded


def test_load_state_dict_updates_streamed_weights(gat):
    ex, ref, res, args, kwargs = gat
    gm = copy.deepcopy(res.module)
    sd = gm.state_dict()
    k = "teacher.convs.1.lin.weight"
    sd[k] = torch.full_like(sd[k], 0.5)
    gm.load_state_dict(sd)
    assert torch.equal(gm.state_dict()[k], sd[k])
    (ws,) = _streamers(gm)
    i = ws.names.index("teacher.convs.1")
    fetched = dict(zip([qn for qn, _, _ in ws.spec[i]], ws.fetch(i)))
    assert torch.equal(fetched[k], sd[k])


def test_weight_scratch_never_on_disk_by_default(gat, tmp_path):
    """unlink_early (the default): the weights' scratch file is removed once mapped, so no copy of the weights is
    left on disk even after a hard exit; the streamer still fetches them (from the mapping), also after a copy."""
    ex, ref, res, args, kwargs = gat
    gm = copy.deepcopy(res.module)
    (ws,) = _streamers(gm)
    assert ws._dir is None
    w = {n: t.clone() for n, t in zip((qn for qn, _, _ in ws.spec[0]), ws.fetch(0))}
    ws2 = WeightStreamer({"b": [(n, t) for n, t in w.items()]}, tier="disk", scratch_root=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    assert all(torch.equal(a, b) for a, b in zip(ws2.fetch(0), w.values()))


def test_weight_scratch_removed_when_module_is_dropped(tmp_path):
    ws = WeightStreamer({"b": [("b.w", torch.ones(4))]}, tier="disk", scratch_root=str(tmp_path),
                        unlink_early=False)
    d = ws._dir
    assert os.path.isdir(d) and os.path.dirname(d) == str(tmp_path)
    del ws
    gc.collect()
    assert not os.path.exists(d)


def test_trainable_weights_are_refused():
    with pytest.raises(ValueError, match="requires grad"):
        WeightStreamer({"b": [("b.w", nn.Parameter(torch.ones(2)))]}, tier="disk")


# ============================================================================================ inference: stream blocks

@pytest.fixture(scope="module")
def gpt_inference():
    ex = example_module("gpt")
    torch.manual_seed(0)
    model = ex.build_model(n_layer=4, n_head=2, d_model=64, dropout=0.0).eval()
    x = ex.example_inputs(batch=2, seq_len=32)
    ref = copy.deepcopy(model)
    pol = _policy(max_memory={"cpu": "100KiB"})
    pol["mode"] = "inference"
    res = fxmem.transform(model, x, policy=pol)
    return ref, res, x


def test_inference_blocks_streamed_one_ahead_exact_and_lower_peak(gpt_inference):
    ref, res, x = gpt_inference
    gm = res.module
    (ws,) = _streamers(gm)
    assert [b for b in ws.names if b.startswith("h.")] == ["h.0", "h.1", "h.2", "h.3"]
    with torch.no_grad():
        assert torch.equal(gm(*x), ref(*x))
    m0 = fxmem.measure(copy.deepcopy(ref), x, mode="inference")
    m1 = fxmem.measure(copy.deepcopy(gm), x, mode="inference")
    block = max(sum(t.numel() * t.element_size() for t in ws.fetch(i)) for i in range(len(ws.names)))
    assert m1.peak < m0.peak - ws.bytes_offloaded + 3 * block  # only ~two blocks resident at a time
    prog = Program(gm, x, {}, "inference")
    prog.refresh()
    est = estimate(prog, mode="inference")
    assert abs(est.peak - m1.peak) <= 0.10 * m1.peak


def test_max_memory_keeps_blocks_resident(gpt_inference):
    ref, res, x = gpt_inference
    resident = {n for n, _ in res.module.named_parameters()}
    assert resident  # the first blocks that fit 100KiB stayed
    assert sum(p.numel() * p.element_size() for p in res.module.parameters()) <= 100 * 1024


def test_inference_streaming_leaves_the_users_parameters_as_they_were():
    """The pass set requires_grad=False on every parameter it streamed, which are the user's own (shared with the
    model passed in): the model no longer trained afterwards."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    x = (torch.randn(4, 64),)
    pol = _policy(max_memory={"cpu": "1KiB"})
    pol["mode"] = "inference"
    res = fxmem.transform(model, x, policy=pol)
    assert next(r for r in res.records if r.name == "offload").status == "applied"
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(res.module(*x), model(*x))


def test_max_memory_needs_the_device_tier():
    ex = example_module("gpt")
    model = ex.build_model(n_layer=2, n_head=2, d_model=32, dropout=0.0).eval()
    pol = _policy(max_memory={"cuda": "1GiB"})
    pol["mode"] = "inference"
    with pytest.raises(PolicyError, match="passes.offload.max_memory"):
        fxmem.transform(model, ex.example_inputs(batch=1, seq_len=8), policy=pol)


# ============================================================================================ grads + optimizer

def _mlp():
    ex = example_module("mlp_digits")
    torch.manual_seed(0)
    return ex.build_model(hidden=64)


@pytest.mark.parametrize("threshold", [None, 0, 1 << 40], ids=["always", "above-0", "never-pressure"])
def test_offloaded_optimizer_matches_device_optimizer(threshold):
    a, b = _mlp(), _mlp()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = OffloadedOptimizer(b.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), threshold=threshold)
    torch.manual_seed(1)
    xs = [torch.randn(8, 64) for _ in range(4)]
    for x in xs:
        for m, o in ((a, oa), (b, ob)):
            m(x).pow(2).mean().backward()
            if o is ob:
                moved = ob.moved
                assert all(p.grad is None for p in b.parameters()) == (threshold != 1 << 40)
            o.step()
            o.zero_grad()
        assert moved == (0 if threshold == 1 << 40 else len(ob.params))
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    # optimizer state lives with the master copies
    assert all(v["exp_avg"].device.type == "cpu" for v in ob.state.values())


def test_pass_records_grad_and_distributed_plan():
    ex = example_module("gpt")
    torch.manual_seed(0)
    model = ex.build_model(n_layer=2, n_head=2, d_model=32, dropout=0.0)
    x = ex.example_inputs(batch=2, seq_len=8)
    res = fxmem.transform(model, x, policy={"version": 1, "passes": {"offload": {
        "activations": False, "grads": True, "distributed": "fsdp", "grad_threshold": "1MiB"}}})
    plan = res.module.fxmem_offload
    assert plan["grads"] is True and plan["grad_threshold"] == 1 << 20
    assert plan["distributed"] == "fsdp" and plan["fsdp_blocks"] == ["h.0", "h.1"]


def test_make_optimizer_follows_the_grads_plan():
    """A module transformed with `grads: true` gets an OffloadedOptimizer from fxmem.make_optimizer, and training
    with it gives bit-identical parameters to the same optimizer on the untransformed module."""
    ex = example_module("mlp_digits")
    torch.manual_seed(0)
    model = ex.build_model(hidden=64)
    ref = copy.deepcopy(model)
    x = torch.randn(8, 64)
    res = fxmem.transform(model, (x,), policy={"version": 1, "optimizer": "adamw", "passes": {"offload": {
        "activations": False, "grads": True}}})
    opt = fxmem.make_optimizer(res.module, res.policy)
    assert isinstance(opt, OffloadedOptimizer) and "offload grads" in opt.fxmem_notes[0]
    ref_opt = fxmem.make_optimizer(ref, "adamw")
    assert not isinstance(ref_opt, OffloadedOptimizer)
    for _ in range(3):
        for m, o in ((ref, ref_opt), (res.module, opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    got = dict(res.module.named_parameters())
    for n, p in ref.named_parameters():
        assert torch.equal(p, got[n]), n


def test_a_prefetched_block_dies_after_its_last_use_whatever_the_io_thread_holds(tmp_path, monkeypatch):
    import weakref
    from fxmem.nn.offload import weights
    worker = StarvedWorker()
    monkeypatch.setattr(weights, "executor", lambda kind: worker)
    blocks = {f"b{i}": [(f"b{i}.w", torch.full((64, 64), float(i)))] for i in range(3)}
    ws = WeightStreamer(blocks, tier="disk", prefetch=1, scratch_root=str(tmp_path))
    ws.fetch(0)  # prefetches block 1 on the (starved) thread
    (block1,) = ws.fetch(1)
    assert len(worker.tasks) == 2 and torch.equal(block1, torch.full((64, 64), 1.0))
    storage = weakref.ref(block1.untyped_storage())
    del block1
    gc.collect()
    assert storage() is None
