"""Saving and loading precision results: quantized linears (int8, nf4) and bf16 parameters, at the top level and
under nested modules; results that cannot be saved (weight offload) are refused before anything is written."""
from __future__ import annotations

import io
import json
import os
import warnings

import pytest
import torch
from torch import fx, nn

import fxmem
from fxmem.errors import FxmemError
from fxmem.nn.lowbit import FrozenLinear, LoRALinear, QuantLinear

warnings.filterwarnings("ignore")


class Nested(nn.Module):
    """Linears under a container (as HF `model.*`, BERT `bert.*`, `blocks.*`)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64))

    def forward(self, x):
        return self.body(x)


def _flat():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64))


def _policy(**precision):
    return {"version": 1, "extends": "low", "verify": {"lossy_tolerance": 0.5},
            "passes": {"attention": {"enabled": False}, "checkpoint": {"enabled": False},
                       "precision": {"enabled": True, **precision}}}


def _transform(model, **precision):
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    res = fxmem.transform(model, (x,), policy=_policy(**precision))
    rec = next(r for r in res.records if r.name == "precision")
    assert rec.status == "applied", rec.reason
    return res, x


def _round_trip(res, tmp_path):
    p = tmp_path / "out"
    res.save(p)
    return fxmem.load(p), p


def _same_outputs(a, b, x):
    for training in (False, True):
        a.train(training)
        b.train(training)
        with torch.no_grad():
            ya, yb = a(x), b(x)
        assert ya.dtype == yb.dtype
        assert torch.equal(ya, yb), f"training={training}: max diff {(ya - yb).abs().max().item()}"


# ============================================================================================ nested modules

def test_nested_int8_round_trip(tmp_path):
    pytest.importorskip("bitsandbytes")
    res, x = _transform(Nested(), compute="fp32", weights="int8")
    quant = [n for n, m in res.module.named_modules() if isinstance(m, QuantLinear)]
    assert quant and all(n.startswith("body.") for n in quant)
    lm, _ = _round_trip(res, tmp_path)
    assert [n for n, m in lm.named_modules() if isinstance(m, QuantLinear)] == quant
    _same_outputs(res.module, lm, x)
    assert list(lm.state_dict()) == list(res.module.state_dict())


def test_nested_bf16_params_round_trip(tmp_path):
    res, x = _transform(Nested(), compute="bf16", params="bf16")
    assert {p.dtype for n, p in res.module.named_parameters() if n.endswith("weight")} == {torch.bfloat16}
    lm, _ = _round_trip(res, tmp_path)
    assert [(n, p.dtype) for n, p in lm.named_parameters()] == [(n, p.dtype) for n, p in res.module.named_parameters()]
    _same_outputs(res.module, lm, x)
    assert list(lm.state_dict()) == list(res.module.state_dict())


def test_serialize_keeps_a_back_reference_to_the_root():
    """A submodule that refers back to its GraphModule (the precision pass's copy-on-write mark does) is the same
    module after a round trip, not a second, half-built copy of the root."""
    from fxmem.serialize import dumps

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    root = nn.Module()
    root.inner = Inner()
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_module("inner.lin", (x,)))
    gm = fx.GraphModule(root, g)
    object.__setattr__(gm.inner, "owner", gm)
    loaded = torch.load(io.BytesIO(dumps(gm)), weights_only=False)
    assert loaded.inner.owner is loaded
    xs = torch.randn(2, 4)
    assert torch.equal(loaded(xs), gm(xs))


# ============================================================================================ quantized linears

@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("evaluated", [False, True], ids=["fresh", "evaluated"])
def test_quantized_round_trip(tmp_path, kind, evaluated):
    """The bitsandbytes weights come back as the same parameter types with the same state: identical outputs,
    the same state_dict. `evaluated`: an eval-mode call first (the 4-bit layout stays the standard one)."""
    bnb = pytest.importorskip("bitsandbytes")
    res, x = _transform(_flat(), compute="fp32", weights=kind)
    gm = res.module
    assert [n for n, m in gm.named_modules() if isinstance(m, QuantLinear)] == ["0", "2"]
    if evaluated:
        gm.eval()
        with torch.no_grad():
            gm(x)
    lm, p = _round_trip(res, tmp_path)
    ptype = bnb.nn.Int8Params if kind == "int8" else bnb.nn.Params4bit
    for mod in (gm, lm):
        assert not any(getattr(getattr(q.inner.weight, "quant_state", None), "packing_format_for_cpu", False)
                       for q in mod.modules() if isinstance(q, QuantLinear))
    for name in ("0", "2"):
        assert type(lm.get_submodule(name).inner.weight) is ptype
    structure = json.loads((p / "module.json").read_text())
    assert sorted(structure["quantized"]) == ["0", "2"] and structure["quantized"]["0"]["kind"] == kind
    assert json.loads((p / "manifest.json").read_text())["format"] == 3  # an older fxmem refuses it
    _same_outputs(gm, lm, x)
    sd, sd_loaded = gm.state_dict(), lm.state_dict()
    assert list(sd_loaded) == list(sd)
    for k, v in sd.items():
        assert torch.equal(sd_loaded[k], v), k
    # the saved module is unchanged by saving (its quantized state was put back)
    assert type(gm.get_submodule("0").inner.weight) is ptype


def _older_fxmem_state(q: QuantLinear) -> tuple[dict, dict]:
    """What an older fxmem saved for a 4-bit layer after an eval-mode call: bitsandbytes' CPU layout (made here as
    `Linear4bit.forward` makes it), its fields under `cpu_packed`."""
    bnb = pytest.importorskip("bitsandbytes")
    w = q.inner.weight
    w.data, qs = bnb.functional._convert_weight_packed_for_cpu(w.data, w.quant_state)
    tensors = {"inner.weight": w.data.clone()}
    tensors.update({f"inner.weight.{k}": v.clone() for k, v in qs.as_dict(packed=True).items()})
    fields = {"kind": q.kind, "tensors": sorted(tensors),
              "param": {"blocksize": int(w.blocksize), "compress_statistics": bool(w.compress_statistics),
                        "quant_type": str(w.quant_type), "quant_storage": "uint8"},
              "cpu_packed": {"original_dtype": "float32", "original_nested": bool(qs.original_nested),
                             "original_qshape": [int(d) for d in qs.original_qshape],
                             "original_storage_type": None}}
    return tensors, fields


@pytest.mark.parametrize("double_quant", [True, False])
def test_cpu_layout_saved_by_older_versions_loads_in_standard_layout(double_quant):
    """A 4-bit state in bitsandbytes' CPU inference layout (results saved by older fxmem) loads in the standard
    layout with the weights it held: outputs and input gradients equal the saving layer's own, in both modes."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    saved = QuantLinear(lin.weight, lin.bias, "nf4", double_quant=double_quant)
    tensors, fields = _older_fxmem_state(saved)
    loaded = QuantLinear(torch.randn(96, 64), lin.bias, "nf4", double_quant=double_quant)  # the bias: state_dict
    loaded.load_quantized_state(tensors, fields)
    assert not loaded.inner.weight.quant_state.packing_format_for_cpu
    assert dict(loaded.named_buffers()).keys() == loaded.aux_tensors().keys()
    x = torch.randn(5, 64)
    for training in (True, False):
        grads = []
        for q in (saved, loaded):
            q.train(training)
            xi = x.clone().requires_grad_(True)
            y = q(xi)
            y.sum().backward()
            grads.append((y.detach(), xi.grad))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert not saved.inner.weight.quant_state.packing_format_for_cpu  # the layer put itself back on its call
    assert (grads[1][0] - lin(x)).norm() / lin(x).norm() < 0.2


@pytest.mark.parametrize("tolerance,base", [(0.5, QuantLinear), (0.05, FrozenLinear)],
                         ids=["nf4_base", "reverted_base"])
def test_qlora_round_trip_after_eval_keeps_gradients(tmp_path, tolerance, base):
    """A QLoRA result saved after an eval-mode call loads with the same outputs and the same input and adapter
    gradients (4-bit bases, and the original-weight bases of sites the guard reverted)."""
    pytest.importorskip("bitsandbytes")
    res, x = _transform(_flat(), compute="fp32", tolerance=tolerance, qlora={"rank": 4})
    gm = res.module
    assert {type(m.base) for m in gm.modules() if isinstance(m, LoRALinear)} == {base}
    with torch.no_grad():
        for name, p in gm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # as after training: lora_A gets a gradient
    gm.eval()
    with torch.no_grad():
        gm(x)
    lm, _ = _round_trip(res, tmp_path)
    _same_outputs(gm, lm, x)
    grads = []
    for m in (gm, lm):
        m.train()
        xi = x.clone().requires_grad_(True)
        (m(xi) ** 2).sum().backward()
        grads.append({"input": xi.grad, **{n: p.grad for n, p in m.named_parameters() if p.requires_grad}})
    assert list(grads[0]) == list(grads[1]) and any("lora_B" in n for n in grads[0])
    for name, g in grads[0].items():
        assert g.abs().sum() > 0 and torch.equal(grads[1][name], g), name


# ============================================================================================ weight offload

def _offload_result():
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    m.requires_grad_(False)
    pol = {"version": 1, "extends": "low", "mode": "inference",
           "passes": {"attention": {"enabled": False}, "checkpoint": {"enabled": False},
                      "offload": {"enabled": True, "activations": False, "weights": True, "tier": "disk",
                                  "max_memory": {"cpu": "1KiB"}}}}
    res = fxmem.transform(m, (torch.randn(4, 64),), policy=pol)
    from fxmem.nn.offload import WeightStreamer
    assert any(isinstance(mod, WeightStreamer) for mod in res.module.modules()), res.records
    return res


def test_weight_offload_save_is_refused_before_writing(tmp_path):
    res = _offload_result()
    out = tmp_path / "sub" / "out"
    with pytest.raises(FxmemError) as ei:
        res.save(out)
    msg = str(ei.value)
    assert "weight offload" in msg and "cannot be saved" in msg and "state_dict" in msg
    assert "nothing was written" in msg and "\n" not in msg
    assert os.listdir(tmp_path) == []


def test_cli_weight_offload_out_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from fxmem.cli import main
    model = tmp_path / "model.py"
    model.write_text("import torch\n"
                     "def build_model():\n"
                     "    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),\n"
                     "                            torch.nn.Linear(128, 64))\n"
                     "    return m.requires_grad_(False)\n"
                     "def example_inputs():\n"
                     "    return (torch.randn(4, 64),)\n")
    pol = tmp_path / "pol.yaml"
    pol.write_text("version: 1\nextends: low\nmode: inference\npasses:\n"
                   "  attention: {enabled: false}\n  checkpoint: {enabled: false}\n"
                   "  offload: {enabled: true, activations: false, weights: true, tier: disk, "
                   "max_memory: {cpu: 1KiB}}\n")
    monkeypatch.chdir(tmp_path)
    code = main(["optimize", str(model), "--policy", str(pol), "--out", str(tmp_path / "res"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fxmem: error:") and "weight offload" in lines[0], err
    assert sorted(os.listdir(tmp_path)) == ["model.py", "pol.yaml"]
