"""fxmem.distribute: the transformed GraphModule under DDP and FSDP2 (2 processes, gloo, 127.0.0.1, CPU).

One spawn runs both modes (process start-up and capture dominate the time): each rank trains its half of the
batch for a few steps; the parent trains the same captured module on the whole batch in one process. Losses
(averaged over ranks), gradients and parameters must match. The cost model's per-rank estimate is checked
against the measured per-rank peak.
"""
from __future__ import annotations

import copy
import os
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp

STEPS = 3
WORLD = 2
CFG = dict(n_layer=2, n_head=2, d_model=64, dropout=0.0)
INPUTS = dict(batch=8, seq_len=32)


def _transform(policy: dict):
    """The decoder at CFG, built from seed 0 and transformed under `policy`; (result, example inputs)."""
    import fxmem
    import examples.gpt as ex
    torch.manual_seed(0)
    model = ex.build_model(**CFG)
    x = ex.example_inputs(**INPUTS)
    return fxmem.transform(model, x, policy={"version": 1, **policy}), x


def _build():
    """Capture + activation offload regions (the full fxmem path); the module is saved once and loaded by ranks."""
    res, x = _transform({"passes": {"offload": {"min_bytes": 0, "bandwidth": "10GB/s", "compute_rate": "1GFLOP/s"}}})
    return res, x[0]


def _build_checkpointed(granularity: str):
    """The same model checkpointed at 60% of its peak. `sub-block`: regions inside the blocks (h.0.attn, h.0.mlp),
    which distribute outlines with the rest of their block; `auto` picks regions joining one block's MLP to the next
    block's first norm, so no block is one call and FSDP2 shards every parameter with the root."""
    return _transform({"budget": "60%", "budget_strict": False,
                       "passes": {"checkpoint": {"enabled": True, "granularity": granularity}}})[0]


def _loss(out):
    return out.float().pow(2).mean()


def _train(mod, batches, opt):
    losses, grads = [], {}
    for s in range(STEPS):
        loss = _loss(mod(batches))
        loss.backward()
        losses.append(loss.detach().clone())
        if s == STEPS - 1:
            for n, p in mod.named_parameters():
                g = p.grad
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                grads[n] = g.detach().clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _clean(name: str) -> str:
    return name.replace("module.", "", 1) if name.startswith("module.") else name


def _worker(rank, port, saved, x, out_path, saved_checkpointed=None, saved_segments=None):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    import fxmem
    from fxmem.distributed import distribute, estimate_rank, measure_rank
    from fxmem.program import Program
    results = {}
    gm = fxmem.load(saved)
    shard = x.chunk(WORLD)[rank]
    others = {"fsdp-checkpointed": saved_checkpointed, "fsdp-segments": saved_segments}
    modes = ("ddp", "fsdp", "fsdp-cpu-offload") + tuple(m for m, path in others.items() if path)
    for mode in modes:
        src = fxmem.load(others[mode]) if mode in others else gm
        fsdp_or_ddp = "ddp" if mode == "ddp" else "fsdp"
        mod_src = copy.deepcopy(src)
        notes = None
        if mode == "fsdp-cpu-offload":  # CPUOffloadPolicy: sharded params, grads and optimizer step on CPU
            est = None
            mod = distribute(mod_src, {"mode": "fsdp", "cpu_offload": True})
        else:
            prog = Program(copy.deepcopy(src), (shard,), {}, "train")
            prog.refresh()
            est = estimate_rank(prog, fsdp_or_ddp, WORLD, optimizer="sgd", loss_fn=lambda o, i: _loss(o))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mod = distribute(mod_src, fsdp_or_ddp)
            notes = [str(w.message) for w in caught if "fxmem.distribute" in str(w.message)]
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        losses, grads = _train(mod, shard, opt)
        avg = torch.stack(losses)
        dist.all_reduce(avg)
        avg /= WORLD
        params = {}
        for n, p in mod.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[_clean(n)] = t.detach().clone()
        meas = None
        if est is not None:
            meas = measure_rank(mod, (shard,), optimizer=torch.optim.SGD(mod.parameters(), lr=0.0),
                                loss_fn=lambda o, i: _loss(o))
            meas.pop("timeline", None)
        results[mode] = {"loss": avg, "grads": {_clean(k): v for k, v in grads.items()}, "params": params,
                         "est": est, "meas": meas, "blocks": getattr(mod_src, "fxmem_sharded_blocks", None),
                         "warnings": notes,
                         "local_param_bytes": sum(
                             (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in mod.parameters())}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    out = tmp / "rank0.pt"
    res, x = _build()
    assert any(n.startswith("offload_") for n, _ in res.module.named_children())
    res.save(tmp / "module")
    for name, granularity in (("checkpointed", "sub-block"), ("segments", "auto")):
        ck = _build_checkpointed(granularity)
        regions = [n for n, _ in ck.module.named_children() if n.startswith("ckpt_")]
        assert regions and any(n.startswith("ckpt_h_0_mlp") and "ln_1" in n for n in regions) == (name == "segments"), \
            regions
        ck.save(tmp / name)
    ctx = mp.start_processes(_worker, args=(_free_port(), str(tmp / "module"), x, str(out), str(tmp / "checkpointed"),
                                            str(tmp / "segments")), nprocs=WORLD, join=False, start_method="spawn")
    # the single-process reference, meanwhile: the whole batch in one process
    ref = copy.deepcopy(res.module)
    losses, grads = _train(ref, x, torch.optim.SGD(ref.parameters(), lr=0.1))
    params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    while not ctx.join(timeout=120):
        pass
    return torch.load(out, weights_only=False), (torch.stack(losses), grads, params)


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp-cpu-offload", "fsdp-checkpointed", "fsdp-segments"])
def test_loss_and_gradients_equal_single_process(runs, mode):
    got, (ref_loss, ref_grads, ref_params) = runs
    r = got[mode]
    torch.testing.assert_close(r["loss"], ref_loss, rtol=1e-6, atol=1e-7)
    assert r["grads"].keys() == ref_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(r["grads"][n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
        torch.testing.assert_close(r["params"][n], ref_params[n], rtol=1e-5, atol=1e-7, msg=n)


def test_fsdp_shards_blocks_found_from_the_graph(runs):
    got, (_, _, ref_params) = runs
    r = got["fsdp"]
    assert r["blocks"] == ["h.0", "h.1"]
    full = sum(p.numel() * 4 for p in ref_params.values())
    assert r["local_param_bytes"] <= full // WORLD + 4096  # each rank holds half the parameters


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp-checkpointed", "fsdp-segments"])
def test_per_rank_estimate_tracks_measured(runs, mode):
    got, _ = runs
    est, meas = got[mode]["est"]["peak"], got[mode]["meas"]["peak"]
    # stated tolerance: the per-rank estimate is within 15% of the measured per-rank peak (see the report)
    assert abs(est - meas) <= 0.15 * meas, (mode, est, meas)
    if mode != "ddp":  # the estimate shards the blocks distribute shards
        assert got[mode]["est"]["blocks"] == got[mode]["blocks"], (got[mode]["est"]["blocks"], got[mode]["blocks"])


def test_fsdp_blocks_with_checkpoint_regions(runs):
    """Regions inside a block (checkpointed attention and MLP) are outlined with the rest of it: both blocks are
    sharded apart, silently. A region joining h.0's MLP to h.1's first norm reads both blocks' parameters: neither
    can be one call, every parameter goes to the root's group, and distribute warns, naming each block and why."""
    got, _ = runs
    assert got["fsdp-checkpointed"]["blocks"] == ["h.0", "h.1"]
    assert got["fsdp-checkpointed"]["warnings"] == [] and got["fsdp"]["warnings"] == []
    seg = got["fsdp-segments"]
    assert seg["blocks"] == []
    assert len(seg["warnings"]) == 1, seg["warnings"]
    for path in ("h.0", "h.1"):
        assert f"{path}: ckpt_h_0_mlp" in seg["warnings"][0] or f"{path}: ckpt_h_1" in seg["warnings"][0], \
            seg["warnings"]
    assert seg["warnings"][0].count("reads its parameters from outside the block") == 2
