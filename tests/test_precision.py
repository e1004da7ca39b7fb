"""The precision pass: per-edge dtypes, fp32 islands, bitsandbytes weights, QLoRA, 8-bit optimizers, the guard."""
from __future__ import annotations

import copy
import importlib
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fxmem
from fxmem.errors import PolicyError
from fxmem.nn.lowbit import LoRALinear, QuantLinear
from fxmem.ops import packet
from fxmem.optim import MasterWeightOptimizer, make_optimizer, optimizer_state_bytes
from fxmem.pipeline import PassContext, pass_module
from fxmem.program import Program

ROOT = Path(__file__).resolve().parent.parent
warnings.filterwarnings("ignore")

P = pass_module("precision")

ALL = ["gpt", "hf_llama", "hf_gpt2", "hf_bert", "gcn", "gat", "gnn_stan", "unet", "vit", "mlp_digits"]
# hf_gpt2's Conv1D layers are aten.addmm(bias, x, W): swapped too
WITH_LINEARS = ["gpt", "hf_llama", "hf_gpt2", "hf_bert", "gnn_stan", "vit", "mlp_digits"]
SMALL = {"gpt": dict(n_layer=1)}


_CACHE: dict = {}


def _example(name, mode="train"):
    """(example module, captured Program), cached: passes never mutate the Program they get a snapshot of;
    tests that train a result train a deep copy."""
    key = (name, mode)
    if key not in _CACHE:
        _CACHE[key] = _capture(name, mode)
    return _CACHE[key]


def _capture(name, mode):
    ex = importlib.import_module(f"examples.{name}")
    torch.manual_seed(0)
    model = ex.build_model(**SMALL.get(name, {}))
    a = ex.example_inputs()
    args, kwargs = (a, {}) if isinstance(a, tuple) else ((), a)
    prog = fxmem.capture(model, args, kwargs, mode=mode)
    prog.refresh()
    return ex, prog


def _run(prog: Program, mode="train", loss_fn=None, policy=None, **opts):
    opts.setdefault("loss_steps", 0)
    ctx = PassContext(policy=policy, options=P.PrecisionOptions(**opts), mode=mode, optimizer="adamw", budget=None,
                      baseline=None, enabled=("precision",), loss_fn=loss_fn)
    snap = prog.snapshot()
    return P.PrecisionPass().run(snap, ctx)  # the pass refreshes the program it returns


def _float_in_dtypes(node):
    out = []
    for a in P.node_args(node):
        v = a.meta.get("fxmem_val")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out.append(v.dtype)
    return out


def _call(prog, m=None):
    m = m or prog.module
    return m(*prog.example_args, **prog.example_kwargs)


# ============================================================================================ compute precision

def test_keep_fp32_modules_make_fp32_island():
    ex, prog = _example("gpt")
    res = _run(prog, keep_fp32_modules=["h.0.mlp"])
    gm = res.program.module
    seen_island = seen_low = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.linear.default:
            path = fxmem.program.module_path(n)
            dts = set(_float_in_dtypes(n))
            if path.startswith("h.0.mlp"):
                assert dts == {torch.float32}, (path, dts)
                seen_island += 1
            else:
                assert dts == {torch.bfloat16}, (path, dts)
                seen_low += 1
    assert seen_island == 2 and seen_low >= 3
    assert any(c.module.startswith("h.0.mlp") and "keep_fp32_modules" in c.reason for c in res.changes)


def test_autocast_islands_keep_softmax_and_norm_fp32():
    ex, prog = _example("gpt")
    res = _run(prog, islands="autocast")
    gm = res.program.module
    kinds = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = packet(n.target)
        if name in ("softmax", "layer_norm"):
            assert set(_float_in_dtypes(n)) == {torch.float32}
            assert n.meta["fxmem_val"].dtype == torch.float32
            kinds.add(name)
        if name == "linear":
            assert set(_float_in_dtypes(n)) == {torch.bfloat16}
    assert kinds == {"softmax", "layer_norm"}
    assert set(res.metrics["fp32_islands"]) >= {n for n in res.metrics["fp32_islands"] if "softmax" in n}
    assert any("softmax" in n for n in res.metrics["fp32_islands"])
    # compact (default) runs them on bf16 inputs with fp32 accumulation in the kernel: fewer activation bytes
    res_c = _run(prog)
    a_auto = res.metrics["estimate"]["activations"]["after"]
    a_comp = res_c.metrics["estimate"]["activations"]["after"]
    assert a_comp < a_auto


def test_exp_island_in_compact_mode():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(torch.exp(self.lin(x) * 0.1))

    prog = fxmem.capture(M(), (torch.randn(4, 16),), mode="train")
    prog.refresh()
    res = _run(prog)
    exp = [n for n in res.program.graph.nodes if n.op == "call_function" and packet(n.target) == "exp"][0]
    assert set(_float_in_dtypes(exp)) == {torch.float32} and exp.meta["fxmem_val"].dtype == torch.float32
    assert res.metrics["fp32_islands"] == [exp.name]
    # a keep_fp32 list without exp_log_pow lets exp follow its bf16 input
    res2 = _run(prog, keep_fp32=["softmax", "norm"])
    exp2 = [n for n in res2.program.graph.nodes if n.op == "call_function" and packet(n.target) == "exp"][0]
    assert exp2.meta["fxmem_val"].dtype == torch.bfloat16


def test_accumulating_kernels_match_fp32_compute():
    """The claim behind compact islands: these kernels accumulate in fp32 for bf16 inputs."""
    torch.manual_seed(0)
    x = (torch.randn(16, 8, 64) * 3).bfloat16()
    F = torch.nn.functional
    fns = {"softmax": lambda t: torch.softmax(t, -1), "layer_norm": lambda t: F.layer_norm(t, (64,)),
           "sum": lambda t: t.sum(-1), "mean": lambda t: t.mean(-1), "cumsum": lambda t: t.cumsum(-1),
           "rms_norm": lambda t: F.rms_norm(t, (64,)), "group_norm": lambda t: F.group_norm(t, 4),
           "batch_norm": lambda t: F.batch_norm(t, torch.zeros(8), torch.ones(8), training=True)}
    for name, f in fns.items():
        assert name in P.ACC_BF16
        a = f(x).float()
        b = f(x.float()).bfloat16().float()
        ulp = b.abs().clamp_min(1e-3) * 2 ** -7
        assert ((a - b).abs() <= ulp).all(), name
    # log_softmax does not (it stays an upcast island)
    assert "log_softmax" not in P.ACC_BF16


def test_redundant_cast_pairs_removed():
    class M(nn.Module):
        def forward(self, x):
            return (x.float() * 2).to(torch.bfloat16).float().to(torch.bfloat16) + 1

    x = torch.randn(4, 8).bfloat16()
    prog = fxmem.capture(M(), (x,), mode="inference")
    prog.refresh()
    before = sum(n.op == "call_function" and n.target in P.CAST_OPS for n in prog.graph.nodes)
    ref = prog.module(x)
    # mark the inner pair as ours (casts the pass inserted); round trips bf16 -> fp32 -> bf16 are identities
    removed = P.simplify_casts(prog.module)
    prog.refresh()
    after = sum(n.op == "call_function" and n.target in P.CAST_OPS for n in prog.graph.nodes)
    assert removed >= 2 and after == before - removed
    assert torch.equal(prog.module(x), ref)


def test_fp16_trains_with_grad_scaler_and_notes():
    ex, prog = _example("mlp_digits")  # fp16 matmuls are slow on CPU: a small model
    res = _run(prog, loss_fn=ex.loss_fn, compute="fp16")
    assert any("GradScaler" in n for n in res.notes)
    gm = copy.deepcopy(res.program.module)
    lin = [n for n in gm.graph.nodes if n.op == "call_function" and packet(n.target) == "linear"]
    assert lin and all(set(_float_in_dtypes(n)) == {torch.float16} for n in lin)
    gm.train()
    opt = make_optimizer(gm, "adamw", lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    losses = []
    torch.manual_seed(0)
    for _ in range(8):
        loss = ex.loss_fn(gm(*prog.example_args), prog.example_args)
        losses.append(float(loss))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.05, losses


def test_params_bf16_with_fp32_master_weights():
    ex, prog = _example("mlp_digits")
    res = _run(prog, loss_fn=ex.loss_fn, params="bf16")
    gm = res.program.module
    assert all(p.dtype == torch.bfloat16 for p in gm.parameters())
    # the original program's parameters are untouched (rollback shares them)
    assert all(p.dtype == torch.float32 for p in prog.module.parameters())
    opt = make_optimizer(gm, "adamw", lr=1e-2)
    assert isinstance(opt, MasterWeightOptimizer)
    losses = []
    for _ in range(6):
        loss = ex.loss_fn(gm(*prog.example_args), prog.example_args)
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0]
    st = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert st and all(v.dtype == torch.float32 for v in st)
    n = sum(p.numel() for p in gm.parameters())
    assert optimizer_state_bytes(opt) == pytest.approx(n * 12, rel=0.01)  # exp_avg + exp_avg_sq + master


def test_cost_model_matches_measure_after_bf16():
    ex, prog = _example("gpt")
    res = _run(prog, loss_fn=ex.loss_fn)
    est = fxmem.estimate(res.program, mode="train", optimizer="adamw", loss_fn=ex.loss_fn)
    gm = copy.deepcopy(res.program.module)
    meas = fxmem.measure(gm, prog.example_args, mode="train", optimizer="adamw", loss_fn=ex.loss_fn)
    assert est.activations == pytest.approx(meas.activations, rel=0.1)
    base = fxmem.measure(copy.deepcopy(prog.module), prog.example_args, mode="train", optimizer="adamw",
                         loss_fn=ex.loss_fn)
    assert meas.activations < 0.75 * base.activations


def test_bad_options_name_the_key():
    ex, prog = _example("mlp_digits")
    with pytest.raises(PolicyError, match="passes.precision.keep_fp32"):
        _run(prog, keep_fp32=["softmax", "bogus"])
    with pytest.raises(PolicyError, match="passes.precision.params"):
        _run(prog, compute="fp16", params="bf16")
    with pytest.raises(PolicyError, match="qlora"):
        _run(prog, weights="int8", qlora=P.QLoRAOptions())


# ============================================================================================ weights

@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_nf4_swap_and_measured_weight_bytes(name):
    ex, prog = _example(name, mode="inference")
    res = _run(prog, mode="inference", compute="fp32", weights="nf4", tolerance=0.5)
    gm = res.program.module
    q = [m for m in gm.modules() if isinstance(m, QuantLinear)]
    assert q and all(m.kind == "nf4" for m in q)
    assert res.metrics["output_deviation"]["rel"] < 0.3
    # fxmem.measure counts the packed weights and the quantization state (aux buffers)
    before = fxmem.measure(copy.deepcopy(prog.module), prog.example_args, prog.example_kwargs, mode="inference")
    after = fxmem.measure(copy.deepcopy(gm), prog.example_args, prog.example_kwargs, mode="inference")
    dense = sum(c.details["dense_bytes"] for c in res.changes if c.kind == "precision.quantize")
    qb = sum(c.details["quant_bytes"] for c in res.changes if c.kind == "precision.quantize")
    assert qb <= 0.3 * dense  # the goal: nf4 linear weight bytes <= 0.3x fp32
    saved = (before.params + before.buffers) - (after.params + after.buffers)
    assert saved == pytest.approx(dense - qb, rel=0.02)
    est = fxmem.estimate(res.program, mode="inference")
    assert est.params + est.buffers == pytest.approx(after.params + after.buffers, rel=0.02)


def test_quantlinear_to_device_keeps_state_and_counts_bytes():
    lin = nn.Linear(128, 256)
    for kind in ("int8", "nf4", "fp4"):
        q = QuantLinear(lin.weight, lin.bias, kind)
        n_before = q.weight_bytes()
        q = q.to("cpu")
        assert q.weight_bytes() == n_before
        held = {b.untyped_storage().data_ptr() for b in q.buffers()} | \
               {p.untyped_storage().data_ptr() for p in q.parameters()}
        assert len(held) == len(q.aux_tensors()) + 2  # weight, bias, aux state
        x = torch.randn(3, 128, requires_grad=True)
        y = q(x)
        err = (y - lin(x)).norm() / lin(x).norm()
        assert err < (0.02 if kind == "int8" else 0.2)
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_skip_rules_and_tied_weights():
    ex, prog = _example("gpt", mode="inference")
    res = _run(prog, mode="inference", compute="fp32", weights="int8", min_params=10 ** 9)
    assert res.metrics["linears_quantized"] == 0
    assert any("min_params" in n for n in res.notes)
    res = _run(prog, mode="inference", compute="fp32", weights="int8", skip_modules=["*.mlp.*", "lm_head"])
    paths = {c.module for c in res.changes if c.kind == "precision.quantize" and "role" not in c.details}
    stored = {c.module for c in res.changes if c.kind == "precision.quantize" and "role" in c.details}
    assert paths and not any(".mlp." in p for p in paths)
    assert stored == {"wte.weight", "wpe.weight"}  # the embedding tables, stored quantized
    # the Program the pass got a snapshot of is unchanged (containers are copied on write)
    assert not any(isinstance(m, QuantLinear) for m in prog.module.modules())
    assert prog.module.get_parameter("h.0.attn.c_attn.weight").dtype == torch.float32
    # state_dict keeps every other name
    sd_new = set(res.program.module.state_dict())
    sd_old = set(prog.module.state_dict())
    swapped = {p + ".weight" for p in paths} | {p + ".bias" for p in paths} | stored
    assert sd_old - swapped <= sd_new
    assert all(p + ".inner.weight" in sd_new for p in paths)
    assert all(p + ".qweight" in sd_new and p + ".absmax" not in sd_new for p in stored)  # int8: qweight, scales


def test_qlora_trains_only_adapters():
    ex, prog = _example("gpt")
    res = _run(prog, loss_fn=ex.loss_fn, compute="bf16", guard=False,  # every targeted linear gets nf4 + LoRA
               qlora=P.QLoRAOptions(rank=8, alpha=16, targets=["*.attn.*", "*.mlp.*"]))
    gm = copy.deepcopy(res.program.module)
    loras = [m for m in gm.modules() if isinstance(m, LoRALinear)]
    assert loras and all(isinstance(m.base, QuantLinear) and m.base.kind == "nf4" for m in loras)
    trainable = [n for n, p in gm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    losses = _adamw_losses(gm, ex.loss_fn, prog, steps=12)
    assert losses[-1] < losses[0] - 0.2, losses
    assert res.metrics["lora_params"] == sum(p.numel() for n, p in gm.named_parameters() if "lora_" in n)


def test_qlora_adapters_stay_on_sites_whose_nf4_the_guard_reverted():
    """When the guard refuses nf4 (here a relative-error limit no 4-bit weight meets), the targeted linears keep a
    LoRA adapter on their original weights (frozen, FrozenLinear base), so adapters train, said in a Change per site
    and a note; the model starts unchanged (compute fp32: exactly) and its loss falls."""
    from fxmem.nn.lowbit import FrozenLinear
    ex, prog = _example("gpt")
    res = _run(prog, loss_fn=ex.loss_fn, compute="fp32", tolerance=1e-6,
               qlora=P.QLoRAOptions(rank=8, alpha=16, targets=["*.attn.*", "*.mlp.*"]))
    reverted = {c.module for c in res.changes if c.kind == "precision.reverted"}
    dense = {c.module for c in res.changes if c.kind == "precision.lora"}
    assert reverted and dense == {m for m in reverted if ".attn." in m or ".mlp." in m} and dense
    assert any("guard reverted keep their original weights" in n for n in res.notes)
    gm = copy.deepcopy(res.program.module)
    loras = [m for m in gm.modules() if isinstance(m, LoRALinear)]
    assert len(loras) == len(dense) + res.metrics["linears_quantized"]
    assert sum(isinstance(m.base, FrozenLinear) for m in loras) == len(dense)
    trainable = [n for n, p in gm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    freeze = next(c for c in res.changes if c.kind == "precision.freeze")
    assert freeze.details["lora_params"] == res.metrics["lora_params"] > 0
    gm.eval()
    with torch.no_grad():
        assert torch.equal(_call(prog, gm), _call(prog, copy.deepcopy(prog.module).eval()))
    losses = _adamw_losses(gm, ex.loss_fn, prog, steps=8)
    assert losses[-1] < losses[0] - 0.2, losses


def test_qlora_that_adds_no_adapter_is_a_policy_error():
    """Targets that match no linear would freeze every parameter with nothing to train: refused, naming the key."""
    ex, prog = _example("gpt")
    with pytest.raises(PolicyError, match=r"passes.precision.qlora.targets \['nothing.\*'\] matched none of the"):
        _run(prog, loss_fn=ex.loss_fn, compute="fp32", tolerance=0.5, qlora=P.QLoRAOptions(targets=["nothing.*"]))


# ============================================================================================ optimizers

def test_adamw8bit_trains_and_state_size():
    ex = importlib.import_module("examples.mlp_digits")
    torch.manual_seed(0)
    m = ex.build_model()
    x = ex.example_inputs()
    sizes = {}
    for name in ("adamw", "adamw8bit", "paged_adamw8bit"):
        mm = copy.deepcopy(m)
        opt = make_optimizer(mm, name, lr=3e-3)
        losses = []
        for _ in range(15):
            loss = ex.loss_fn(mm(*x), x)
            losses.append(float(loss))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert losses[-1] < losses[0] - 0.3, (name, losses)
        sizes[name] = optimizer_state_bytes(opt)
        if name == "paged_adamw8bit":
            assert any("unpaged" in n for n in opt.fxmem_notes)
    # the cost model's figure is the real state size
    from fxmem.costmodel import optimizer_state_bytes as est_bytes
    assert est_bytes("adamw8bit", list(m.parameters())) == pytest.approx(sizes["adamw8bit"], rel=0.02)
    assert est_bytes("adamw", list(m.parameters())) == pytest.approx(sizes["adamw"], rel=0.02)
    # on a model of large matrices (tensors under 4096 values keep fp32 state in bitsandbytes) the 8-bit state is
    # about a quarter of AdamW's
    torch.manual_seed(0)
    gm = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    xb = torch.randn(8, 512)
    big = {}
    for name in ("adamw", "adamw8bit"):
        mm = copy.deepcopy(gm)
        opt = make_optimizer(mm, name)
        mm(xb).square().mean().backward()
        opt.step()
        big[name] = optimizer_state_bytes(opt)
    assert big["adamw8bit"] <= 0.26 * big["adamw"], big


def test_make_optimizer_reads_policy_and_rejects_unknown():
    class Pol:
        optimizer = "adam8bit"
    m = nn.Linear(128, 128)
    import bitsandbytes as bnb
    assert isinstance(make_optimizer(m, Pol()), bnb.optim.Adam8bit)
    assert isinstance(make_optimizer(m, "adamw"), torch.optim.AdamW)
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer(m, "lion")


# ============================================================================================ accuracy guard

def test_guard_refusing_everything_keeps_every_site_and_says_why():
    """A limit no bf16 plan meets (relative error 1e-7): the guard refuses every candidate, every matmul stays fp32,
    each site is a Change naming the guard's verdict, and the intent records the shortfall."""
    ex, prog = _example("mlp_digits")
    res = _run(prog, loss_fn=ex.loss_fn, tolerance=1e-7)
    rev = [c for c in res.changes if c.kind == "precision.reverted"]
    assert rev and all("the guard refused bf16 on the whole model (relative output error" in c.reason for c in rev)
    assert res.metrics["sites_reverted"] == len(rev) and not res.modified
    for n in res.program.graph.nodes:
        if n.op == "call_function" and packet(n.target) in ("linear", "addmm"):
            assert set(_float_in_dtypes(n)) == {torch.float32}
    (intent,) = res.intents
    assert not intent.complete and intent.achieved == f"bf16 at 0 of {len(rev)}"
    assert "relative output error" in intent.stopped_by and "passes.precision.tolerance (now 1e-07)" in intent.change


def test_guard_backs_off_the_largest_site_errors_first():
    """Refused whole, nf4 goes back to fp32 first on the sites whose own error is largest, 1, 2, 4, ... of them,
    until the whole model is within the limit (outputs judged as values: relative error decides)."""
    from fxmem.policy_loader import load_policy
    values = load_policy({"version": 1, "verify": {"outputs": "values"}})
    ex, prog = _example("gpt", mode="inference")
    full = _run(prog, mode="inference", compute="fp32", weights="nf4", policy=values, tolerance=10.0)
    n = _quantized(full.metrics)
    assert n == len(full.metrics["sites"]) > 2 and full.intents[0].complete
    limit = 0.5 * full.verdicts[0].measures["rel_error"]
    res = _run(prog, mode="inference", compute="fp32", weights="nf4", policy=values, tolerance=limit)
    (verdict,) = res.verdicts
    assert verdict.accepted and verdict.measures["rel_error"] <= limit and list(verdict.limits) == ["rel_error"]
    rows = res.metrics["sites"]
    reverted = {r["site"] for r in rows if r["reverted"]}
    worst = sorted(rows, key=lambda r: -r["rel"])[:len(reverted)]
    assert 0 < len(reverted) < n and reverted == {r["site"] for r in worst}
    assert _quantized(res.metrics) == n - len(reverted)
    assert res.metrics["guard_asked"][0]["accepted"] is False
    # int8 costs less: the kind's default limits take it whole on the same model
    r8 = _run(prog, mode="inference", compute="fp32", weights="int8", policy=values)
    assert _quantized(r8.metrics) == len(r8.metrics["sites"]) > 0 and r8.modified


def _quantized(metrics: dict) -> int:
    """Sites quantized: linears and weights stored quantized (the gpt example's embedding tables)."""
    return metrics["linears_quantized"] + metrics["weights_stored_quantized"]


def test_loss_after_steps_recorded():
    ex, prog = _example("mlp_digits")
    res = _run(prog, loss_fn=ex.loss_fn, loss_steps=2)
    a, b = res.metrics["loss_fp32"], res.metrics["loss_new"]
    assert len(a) == len(b) == 3
    assert abs(a[-1] - b[-1]) < 0.05 * abs(a[-1])


def test_through_pass_manager_with_policy():
    """The policy validates passes.precision against PrecisionOptions; the manager applies and verifies it."""
    from fxmem.costmodel import estimate
    from fxmem.pipeline import PassManager
    from fxmem.policy_loader import load_policy
    off = {k: {"enabled": False} for k in ("attention", "pruning", "gating", "checkpoint", "offload")}
    pol = load_policy({"version": 1, "name": "t", "mode": "train", "optimizer": "adamw8bit",
                       "passes": {**off, "precision": {"enabled": True, "compute": "bf16", "weights": "fp32",
                                                        "loss_steps": 0}}})
    assert isinstance(pol.passes["precision"].options, P.PrecisionOptions)
    ex, prog = _example("mlp_digits")
    pm = PassManager(pol, loss_fn=ex.loss_fn)
    out = pm.run(prog.snapshot(), estimate(prog, mode="train", loss_fn=ex.loss_fn))
    rec = [r for r in pm.records if r.name == "precision"][0]
    assert rec.status == "applied", rec.reason
    assert rec.deviation["vs_original"]["rel"] < 1e-2
    import bitsandbytes as bnb
    assert isinstance(fxmem.make_optimizer(out.module, pol), bnb.optim.AdamW8bit)


def test_sdpa_stays_one_fused_node_in_bf16():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.proj = nn.Linear(32, 32)

        def forward(self, x, mask):
            q, k, v = self.qkv(x).view(2, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.proj(y.transpose(1, 2).reshape(2, 8, 32))

    torch.manual_seed(0)
    x, mask = torch.randn(2, 8, 32), torch.randn(2, 4, 8, 8)  # a float (additive) mask
    prog = fxmem.capture(Attn(), (x, mask), mode="train")
    prog.refresh()
    res = _run(prog, report_estimate=False)
    sdpa = [n for n in res.program.graph.nodes if n.op == "call_function"
            and packet(n.target) == "scaled_dot_product_attention"]
    assert len(sdpa) == 1
    assert set(_float_in_dtypes(sdpa[0])) == {torch.bfloat16}  # q, k, v and the float mask
    assert sdpa[0].meta["fxmem_val"].dtype == torch.bfloat16
    assert res.metrics["output_deviation"]["rel"] < 1e-2


def test_params_bf16_with_batch_norm_trains():
    """Batch norm with bf16 parameters: its mixed kernel gets fp32 weight/bias and running statistics."""
    ex, prog = _example("unet")
    res = _run(prog, loss_fn=ex.loss_fn, params="bf16", report_estimate=False)
    gm = copy.deepcopy(res.program.module)
    for n in res.program.graph.nodes:
        if n.op == "call_function" and packet(n.target) == "batch_norm":
            dts = _float_in_dtypes(n)
            assert dts[0] == torch.bfloat16 and set(dts[1:]) == {torch.float32}
    opt = make_optimizer(gm, "adamw", lr=1e-2)
    gm.train()
    losses = []
    for _ in range(3):
        loss = ex.loss_fn(gm(*prog.example_args), prog.example_args)
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# ============================================================================================ recast parameters

def _grads_of(m, prog, loss_fn):
    m.zero_grad(set_to_none=True)
    out = _call(prog, m)
    from fxmem.step import compute_loss
    compute_loss(loss_fn, out, prog.example_args, prog.example_kwargs).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_recast_params_frees_weight_copies_bit_exact():
    """fp32 master params + bf16 compute: backward casts the weights again instead of saving bf16 copies.
    Gradients are bit-identical to saving them; the measured activations drop by the copies' bytes, and the static
    and traced estimates see the same drop."""
    from fxmem.nn.recast import _calls, installed
    ex, prog = _example("gpt")
    kept = _run(prog, loss_fn=ex.loss_fn, recast_params=False)
    rec = _run(prog, loss_fn=ex.loss_fn)
    assert rec.metrics["params_recast"] > 0 and "params_recast" not in kept.metrics
    assert installed(rec.program.module) and not installed(kept.program.module)
    casts = [n for n in rec.program.graph.nodes if n.target is P.cast_param]
    assert casts and all(n.args[1] == torch.bfloat16 for n in casts)
    m_keep, m_rec = copy.deepcopy(kept.program.module), copy.deepcopy(rec.program.module)
    assert installed(m_rec), "deepcopy keeps the recast hooks"
    m_keep.eval(), m_rec.eval()
    g_keep, g_rec = _grads_of(m_keep, prog, ex.loss_fn), _grads_of(m_rec, prog, ex.loss_fn)
    assert g_keep.keys() == g_rec.keys() and all(torch.equal(g_keep[k], g_rec[k]) for k in g_keep)
    assert not _calls()
    meas = {}
    for name, r in (("keep", kept), ("recast", rec)):
        meas[name] = fxmem.measure(copy.deepcopy(r.program.module), prog.example_args, mode="train",
                                   optimizer="adamw", loss_fn=ex.loss_fn)
    # the matmul weights' bf16 copies are what autograd kept; casts used only by ops that save nothing (bias
    # adds, embeddings) were freed at once anyway
    mm_copies = sum(n.meta["fxmem_val"].numel() * 2 for n in casts if n.meta["fxmem_val"].dim() == 2
                    and any(u.target in (torch.ops.aten.linear.default, torch.ops.aten.mm.default)
                            for u in n.users))
    assert meas["keep"].activations - meas["recast"].activations >= mm_copies > 0
    for method in ("static", "traced"):
        for name, r in (("keep", kept), ("recast", rec)):
            est = fxmem.estimate(r.program, mode="train", optimizer="adamw", loss_fn=ex.loss_fn, method=method)
            assert est.activations == meas[name].activations, (method, name)
            assert est.peak == pytest.approx(meas[name].peak, rel=0.01), (method, name)
    # a snapshot (what later passes get) keeps the hooks too
    assert installed(rec.program.snapshot().module)


def test_recast_scope_is_left_when_forward_raises():
    from fxmem.nn.recast import _calls
    ex, prog = _example("gpt")
    rec = _run(prog, loss_fn=ex.loss_fn)
    m = copy.deepcopy(rec.program.module)
    bad = torch.full_like(prog.example_args[0], 10 ** 6)  # token ids out of the embedding's range
    with pytest.raises(Exception):
        m(bad)
    assert not _calls()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_recast_module_saves_and_loads(tmp_path):
    from fxmem.nn.recast import installed
    ex = importlib.import_module("examples.gpt")
    torch.manual_seed(0)
    model = ex.build_model(n_layer=1)
    x = ex.example_inputs()
    res = fxmem.transform(model, x, policy={"version": 1, "passes": {"precision": {"enabled": True}}},
                          loss_fn=ex.loss_fn)
    assert installed(res.module)
    res.save(tmp_path / "r")
    loaded = fxmem.load(tmp_path / "r")
    assert installed(loaded)
    res.module.eval(), loaded.eval()
    torch.testing.assert_close(loaded(*x), res.module(*x), atol=0, rtol=0)


def test_recast_refuses_a_parameter_changed_before_backward():
    ex, prog = _example("gpt")
    m = copy.deepcopy(_run(prog, loss_fn=ex.loss_fn).program.module)
    out = _call(prog, m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # an optimizer step before backward
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        ex.loss_fn(out, prog.example_args).backward()


def test_recast_module_under_torch_compile_has_no_graph_breaks():
    """Users stack torch.compile on the result: the recast hooks step aside while compiling (no graph breaks) and
    the gradients agree with eager bf16 to bf16 rounding."""
    import torch._dynamo
    ex, prog = _example("gpt")
    m = copy.deepcopy(_run(prog, loss_fn=ex.loss_fn).program.module).eval()
    ref = copy.deepcopy(m)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(m)
    m.zero_grad(set_to_none=True)
    ex.loss_fn(compiled(*prog.example_args, **prog.example_kwargs), prog.example_args).backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    r = _grads_of(ref, prog, ex.loss_fn)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert g.keys() == r.keys()
    for k in r:
        torch.testing.assert_close(g[k], r[k], atol=5e-3, rtol=5e-2, msg=k)
    torch._dynamo.reset()


def _adamw_losses(gm, loss_fn, prog, steps: int) -> list[float]:
    """The losses of `steps` seeded AdamW training steps of `gm` on the program's example inputs."""
    gm.train()
    opt = make_optimizer(gm, "adamw", lr=1e-2)
    losses = []
    torch.manual_seed(0)
    for _ in range(steps):
        loss = loss_fn(gm(*prog.example_args), prog.example_args)
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses
