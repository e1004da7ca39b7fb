"""`fxmem.load` runs no code from a result and refuses what was changed or damaged.

Results of every preset round trip on the default (safe) path with identical outputs; a changed weight, structure,
mode or manifest is refused; a result carrying a payload (a pickle, or a structure naming `os.system`, `eval`,
`subprocess`, or code smuggled into names the code generator writes) never runs it and is refused with an
FxmemError naming the file; damaged files are FxmemErrors naming the file; results of the old pickle format load only
with `trust_code=True`."""
from __future__ import annotations

import copy
import importlib
import json
import os
import pickle
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fxmem
from fxmem.api import TransformResult
from fxmem.output_dir import save_result
from fxmem.cli import main
from fxmem.compare import compare_outputs
from fxmem.errors import FxmemError
from fxmem.modelfile import split_inputs
from fxmem.resultdir import file_sha256, manifest_sha256, transformed_code

from .conftest import grads

warnings.filterwarnings("ignore")

# small versions of two bundled examples (keyword inputs + a Hugging Face output class; dropout, masked attention)
SMALL = {"gpt": (dict(n_layer=1, n_head=2, d_model=32, block_size=32), dict(batch=2, seq_len=16)),
         "hf_llama": (dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64), dict(batch=2, seq_len=16))}
PRESETS = ("low", "medium", "high", "inference")


def _example(name):
    mod = importlib.import_module(f"examples.{name}")
    build, inputs = SMALL[name]
    args, kwargs = split_inputs(mod.example_inputs(**inputs))
    return mod.build_model(**build), args, kwargs, getattr(mod, "loss_fn", None)


# every preset on the GPT; the Hugging Face model (keyword inputs, an output class) where its structure differs
ROUND_TRIPS = [("gpt", preset) for preset in PRESETS] + [("hf_llama", "low"), ("hf_llama", "inference")]


class _PresetResults(dict):
    """(example, preset) -> (result, saved path, args, kwargs, loss_fn), each transformed on first use."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, key):
        name, preset = key
        model, args, kwargs, loss_fn = _example(name)
        res = fxmem.transform(model, args, kwargs, policy=preset, loss_fn=loss_fn)
        self[key] = (res, res.save(self.tmp_path_factory.mktemp(f"{name}_{preset}") / "r"), args, kwargs, loss_fn)
        return self[key]


@pytest.fixture(scope="module")
def preset_results(tmp_path_factory):
    return _PresetResults(tmp_path_factory)


@pytest.fixture(scope="module")
def small_result(tmp_path_factory):
    """A small saved result (a linear stack, no passes): what the tampering tests damage, a copy each."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    res = fxmem.transform(model, (x,), policy={"version": 1, "passes": {}})
    return res.save(tmp_path_factory.mktemp("small") / "r"), res, x


@pytest.fixture
def result(small_result, tmp_path):
    path, _, _ = small_result
    return Path(shutil.copytree(path, tmp_path / "r"))


def _rehash(d: Path) -> None:
    """What someone who edits a result and updates its hashes does: every sha256 and the manifest's own."""
    man = json.loads((d / "manifest.json").read_text())
    man["sha256"] = {f: file_sha256(d / f) for f in man["sha256"] if (d / f).exists()}
    man["manifest_sha256"] = manifest_sha256(man)
    (d / "manifest.json").write_text(json.dumps(man))


def _edit_structure(d: Path, edit) -> None:
    doc = json.loads((d / "module.json").read_text())
    edit(doc)
    (d / "module.json").write_text(json.dumps(doc))


def _nodes(doc, op):
    return [n for n in doc["root"]["graph"]["nodes"] if n["op"] == op]


def _refused(d: Path, file: str, *words, **load_kwargs) -> str:
    with pytest.raises(FxmemError) as ei:
        fxmem.load(d, **load_kwargs)
    msg = str(ei.value)
    assert type(ei.value) is FxmemError and "\n" not in msg
    assert str(d / file) in msg or (file == "" and str(d) in msg), msg
    for w in words:
        assert w in msg, msg
    return msg


# ============================================================================================ round trips

@pytest.mark.parametrize("name, preset", ROUND_TRIPS)
def test_every_preset_round_trips_on_the_safe_path_with_equal_outputs(preset_results, name, preset):
    res, path, args, kwargs, loss_fn = preset_results[name, preset]
    man = json.loads((path / "manifest.json").read_text())
    assert man["format"] == 3 and "module.pt" not in man["files"] and "module.json" in man["files"]
    loaded = fxmem.load(path)
    gm = res.module
    assert loaded.training == (res.policy.mode == "train")
    assert list(loaded.state_dict()) == list(gm.state_dict())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in gm.state_dict().items())
    assert sorted(type(m).__name__ for m in loaded.modules()) == sorted(type(m).__name__ for m in gm.modules())
    assert transformed_code(path) == (path / "transformed.py").read_text()
    assert loaded.code.strip() in transformed_code(path)
    gm.eval(), loaded.eval()
    with torch.no_grad():
        assert compare_outputs(gm(*args, **kwargs), loaded(*args, **kwargs), atol=0, rtol=0) is None
    if res.policy.mode == "train":
        gm.train(), loaded.train()
        torch.manual_seed(0)
        out_a, grads_a = grads(gm, args, kwargs, loss_fn)
        torch.manual_seed(0)
        out_b, grads_b = grads(loaded, args, kwargs, loss_fn)
        assert compare_outputs(out_a, out_b, atol=0, rtol=0) is None
        assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def test_a_hugging_face_result_loads_in_a_fresh_process(preset_results):
    """Its output class (a transformers ModelOutput) is found though nothing imported transformers before."""
    import subprocess
    path = preset_results["hf_llama", "low"][1]
    code = ("import sys, fxmem; assert 'transformers' not in sys.modules; m = fxmem.load(sys.argv[1]); "
            "print(m._out_spec.type.__name__)")
    env = dict(os.environ, PYTHONPATH=str(Path(fxmem.__file__).parents[1]))
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "CausalLMOutputWithPast", r.stderr


def test_loading_unpickles_nothing(preset_results, monkeypatch):
    """The default path never reaches pickle (a quantized, checkpointed, recast result included)."""
    def no_pickle(*a, **k):
        raise AssertionError("fxmem.load unpickled something")
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "Unpickler", no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)
    for preset in ("medium", "inference"):
        fxmem.load(preset_results["gpt", preset][1])


# ============================================================================================ tampering

def test_a_weight_changed_at_the_same_size_is_refused(result):
    p = result / "weights.safetensors"
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's data: same size, still a valid file
    p.write_bytes(bytes(data))
    _refused(result, "weights.safetensors", "sha256")


@pytest.mark.parametrize("what", ["tie", "mode", "graph", "quantized", "requires_grad"])
def test_a_changed_structure_is_refused(result, what):
    def edit(doc):
        if what == "tie":
            doc["tensors"][1]["tie"] = doc["tensors"][0]["name"]
        elif what == "mode":
            doc["mode"] = "inference"
        elif what == "graph":
            node = _nodes(doc, "call_function")[0]
            node["target"] = "torch.ops.aten.sub.Tensor"
        elif what == "quantized":
            doc["quantized"]["0"] = {"kind": "int8", "tensors": []}
        else:
            doc["tensors"][0]["requires_grad"] = False
    _edit_structure(result, edit)
    _refused(result, "module.json", "sha256")


@pytest.mark.parametrize("field", ["mode", "format", "sha256"])
def test_a_changed_manifest_is_refused(result, field):
    man = json.loads((result / "manifest.json").read_text())
    if field == "mode":
        man["mode"] = "inference"
    elif field == "format":
        man["format"] = 1  # pretend to be the old pickle format
        (result / "module.pt").write_bytes(b"")
    else:
        man["sha256"]["weights.safetensors"] = "0" * 64
    (result / "manifest.json").write_text(json.dumps(man))
    if field == "format":  # an old format is not loaded without trust_code, whatever its hashes say
        _refused(result, "", "format 1", "trust_code=True")
    else:
        _refused(result, "manifest.json", "manifest_sha256")


def test_rehashed_edits_are_still_checked(result):
    """Someone who also updates the hashes gets no further than the structure's own checks."""
    for edit, words in [
        (lambda doc: doc["tensors"][1].update(tie=doc["tensors"][0]["name"]), ("tensor 0.bias", "says")),
        (lambda doc: doc["tensors"][0].update(shape=[4, 4]), ("tensor 0.weight",)),
        (lambda doc: doc["tensors"].pop(), ("does not use", "2.bias")),
        (lambda doc: doc.update(mode="inference"), ("mode",)),
    ]:
        d = result.parent / f"copy{len(os.listdir(result.parent))}"
        shutil.copytree(result, d)
        _edit_structure(d, edit)
        _rehash(d)
        file = "manifest.json" if words == ("mode",) else "module.json"
        _refused(d, file, *words)


# ============================================================================================ payloads

MARK = "fxmem-payload-ran"


def _payload(marker: Path) -> str:
    return f"touch {marker}"


class _Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def test_an_old_format_pickle_is_never_unpickled_without_trust_code(result, tmp_path):
    marker = tmp_path / MARK
    man = json.loads((result / "manifest.json").read_text())
    (result / "module.pt").write_bytes(pickle.dumps(_Evil(_payload(marker))))
    legacy = {"fxmem": man["fxmem"], "format": 1, "mode": "train", "ties": {}, "quantized": {},
              "module_sha256": file_sha256(result / "module.pt"),
              "weights_sha256": file_sha256(result / "weights.safetensors")}
    (result / "manifest.json").write_text(json.dumps(legacy))
    _refused(result, "", "format 1", "trust_code=True", "runs code")
    assert not marker.exists()


def _target(name):
    def edit(doc, marker):
        node = _nodes(doc, "call_function")[0]
        node["target"], node["args"], node["kwargs"] = name, [_payload(marker)], {}
    return edit


def _set(path_fn, value_fn):
    def edit(doc, marker):
        obj, key = path_fn(doc)
        obj[key] = value_fn(marker)
    return edit


PAYLOADS = {
    "os.system": (_target("os.system"), "os.system"),
    "builtins.eval": (_target("builtins.eval"), "builtins.eval"),
    "builtins.exec": (_target("builtins.exec"), "builtins.exec"),
    "subprocess.run": (_target("subprocess.run"), "subprocess.run"),
    "posix.system": (_target("posix.system"), "posix.system"),
    "a file op": (_target("torch.ops.aten.from_file.default"), "opens a file"),
    "a module class": (_set(lambda d: (d["root"]["modules"][0][1], "class"), lambda m: "subprocess.Popen"),
                       "subprocess.Popen"),
    "a placeholder": (_set(lambda d: (_nodes(d, "placeholder")[0], "target"),
                           lambda m: f"x=__import__('os').system('touch {m}')"), "placeholder target"),
    "an attribute path": (_set(lambda d: (_nodes(d, "call_module")[0], "target"),
                               lambda m: f'a"), __import__("os").system("touch {m}"), getattr(self, "b'),
                          "call_module target"),
    "a class name": (_set(lambda d: (d["root"]["config"], "class_name"),
                          lambda m: f"M:\n import os; os.system('touch {m}')"), "class_name"),
    "an argument name": (_set(lambda d: (d["root"]["graph"]["pytree"], "orig_args"),
                              lambda m: [f"x=__import__('os').system('touch {m}')"]), "orig_args"),
    "a keyword key": (_set(lambda d: (d["root"]["graph"]["pytree"]["in_spec"]["children"], 1),
                           lambda m: {"type": "builtins.dict",
                                      "context": [f"x':__import__('os').system('touch {m}'),'y"],
                                      "children": [{"type": None, "context": None, "children": []}]}),
                      "keyword input names"),
    "an output type": (_set(lambda d: (d["root"]["graph"]["pytree"], "out_spec"),
                            lambda m: {"type": "os.system", "context": [f"touch {m}"], "children": [
                                {"type": None, "context": None, "children": []}]}), "pytree type"),
    "a mode dispatch": (_set(lambda d: (d["root"]["graph"]["pytree"], "dispatch"),
                             lambda m: f"b.takes(self) or __import__('os').system('touch {m}') or self.b"),
                        "dispatch"),
    "a recompute op name": (_set(lambda d: (_nodes(d, "call_function")[0], "target"),
                                 lambda m: "fxmem.nn.recast.remat_call"), "not an aten operator name"),
    "a method": (_set(lambda d: (_nodes(d, "call_function")[0], "op"), lambda m: "call_method"), "call_method"),
}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_a_payload_in_the_structure_never_runs_and_is_refused(result, tmp_path, payload):
    """Even with every hash updated (what an attacker would do), the default path runs nothing it names."""
    edit, words = PAYLOADS[payload]
    marker = tmp_path / MARK
    if payload == "a recompute op name":  # remat_call('os.system', ...) would resolve the name at run time
        _edit_structure(result, lambda doc: _nodes(doc, "call_function")[0].update(args=["os.system"]))
    if payload == "a method":  # x.__class__ ... : only public torch.Tensor methods may be called
        _edit_structure(result, lambda doc: _nodes(doc, "call_function")[0].update(target="__class__"))
    _edit_structure(result, lambda doc: edit(doc, marker))
    _rehash(result)
    _refused(result, "module.json", words)
    code, _, err = _run(["diff", str(result)])  # fxmem diff checks the structure the same way
    assert code == 2 and "module.json" in err
    assert not marker.exists()


def _run(argv):
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


# ============================================================================================ damage

@pytest.mark.parametrize("file", ["manifest.json", "module.json", "weights.safetensors"])
@pytest.mark.parametrize("damage", ["missing", "empty", "truncated", "garbled"])
def test_a_damaged_file_is_an_fxmem_error_naming_it(result, file, damage):
    p = result / file
    data = p.read_bytes()
    if damage == "missing":
        p.unlink()
    else:
        p.write_bytes({"empty": b"", "truncated": data[: len(data) // 2],
                       "garbled": bytes(b ^ 0x5A for b in data[:64]) + data[64:]}[damage])
    if file == "manifest.json":
        expected = ("no manifest.json",) if damage == "missing" else ("manifest.json", "JSON")
        msg = _refused(result, "" if damage == "missing" else file)
        assert all(w in msg for w in expected), msg
    else:
        _refused(result, file, "missing" if damage == "missing" else "sha256")


@pytest.mark.parametrize("file", ["module.json", "weights.safetensors"])
def test_a_damaged_file_with_matching_hashes_is_still_an_fxmem_error(result, file):
    p = result / file
    p.write_bytes(p.read_bytes()[:100])
    _rehash(result)
    _refused(result, file, "JSON" if file == "module.json" else "cannot read the weights")


def test_a_missing_directory_is_an_fxmem_error(tmp_path):
    with pytest.raises(FxmemError, match="no such directory"):
        fxmem.load(tmp_path / "nowhere")


# ============================================================================================ fxmem diff

def test_diff_shows_what_load_loads_not_an_edited_transformed_py(result, preset_results):
    text = (result / "transformed.py").read_text()
    before = _run(["diff", str(result)])
    (result / "transformed.py").write_text("def forward(self, x):\n    return os.system('rm -rf /')\n")
    assert _run(["diff", str(result)]) == before and before[0] == 0
    assert transformed_code(result) == text
    # a result that differs from its original: the diff is of the code generated from module.json
    path = preset_results["gpt", "low"][1]
    code, out, _ = _run(["diff", str(path)])
    assert code == 0 and out.startswith(f"--- {path}/original.py\n+++ {path}/transformed.py\n")
    assert "+    sdpa_dropout = " in out


def test_diff_of_a_changed_or_damaged_result_exits_2_naming_the_file(result):
    _edit_structure(result, lambda doc: _nodes(doc, "call_function")[0].update(target="torch.ops.aten.sub.Tensor"))
    code, _, err = _run(["diff", str(result)])
    assert code == 2 and f"{result / 'module.json'}: does not match the manifest's sha256" in err
    assert len(err.strip().splitlines()) == 1
    (result / "module.json").unlink()
    code, _, err = _run(["diff", str(result), str(result)])
    assert code == 2 and f"{result / 'module.json'}: missing" in err


# ============================================================================================ saving

def test_saving_refuses_what_the_format_cannot_hold_and_writes_nothing(small_result, tmp_path):
    _, res, _ = small_result
    res = copy.copy(res)
    res.module = copy.deepcopy(res.module)
    handle = res.module.register_forward_hook(lambda m, a, o: o)
    with pytest.raises(FxmemError, match="forward_hooks .* remove them before saving; nothing was written"):
        res.save(tmp_path / "a")
    handle.remove()
    res.module.extra = nn.Linear(2, 2)  # not a class a result may hold
    with pytest.raises(FxmemError, match=r"torch\.nn\.modules\.linear\.Linear, which fxmem's result format"):
        res.save(tmp_path / "b")
    assert os.listdir(tmp_path) == []


def test_every_function_the_runtime_puts_into_graphs_is_allowed():
    """The functions fxmem.nn wraps for fx (what passes emit as call targets) are on the allow-list."""
    import re

    from fxmem.targets import PYTHON_TARGETS
    root = Path(fxmem.__file__).parent / "nn"
    wrapped = {f"fxmem.nn.{p.stem}.{name}" for p in root.glob("*.py")
               for name in re.findall(r'torch\.fx\.wrap\("(\w+)"\)', p.read_text())}
    assert wrapped and wrapped <= set(PYTHON_TARGETS)


# ============================================================================================ formats 1-2

def _legacy_copy(res, d: Path, new: Path) -> None:
    """`new`: the result at `d` as fxmem's format 1 wrote it (module.pt, a pickle; ties in the manifest)."""
    import contextlib

    from fxmem.nn.lowbit import QuantLinear
    from fxmem.serialize import dumps
    shutil.copytree(d, new)
    doc = json.loads((new / "module.json").read_text())
    (new / "module.json").unlink()
    with contextlib.ExitStack() as stack:  # as the old writer did: the bitsandbytes state went to the weights file
        for m in res.module.modules():
            if isinstance(m, QuantLinear):
                stack.enter_context(m.without_quantized_state())
        (new / "module.pt").write_bytes(dumps(res.module))
    man = json.loads((new / "manifest.json").read_text())
    legacy = {"fxmem": man["fxmem"], "format": 1, "mode": man["mode"], "quantized": doc["quantized"],
              "ties": {t["name"]: t["tie"] for t in doc["tensors"] if "tie" in t},
              "module_sha256": file_sha256(new / "module.pt"),
              "weights_sha256": file_sha256(new / "weights.safetensors")}
    (new / "manifest.json").write_text(json.dumps(legacy))


def test_old_format_results_load_only_with_trust_code_and_save_again_safely(small_result, tmp_path):
    path, res, x = small_result
    old = tmp_path / "old"
    _legacy_copy(res, path, old)
    _refused(old, "", "format 1", "trust_code=True")
    code, _, err = _run(["diff", str(old)])
    assert code == 2 and "format 1" in err
    loaded = fxmem.load(old, trust_code=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), res.module.eval()(x))
    # saved again: the safe format, which loads without trust_code
    again = copy.copy(res)
    again.module = loaded
    save_result(again, tmp_path / "new")
    with torch.no_grad():
        assert torch.equal(fxmem.load(tmp_path / "new").eval()(x), res.module(x))


# ============================================================================================ bitsandbytes missing

def test_a_quantized_result_without_bitsandbytes_names_the_package(preset_results, tmp_path, monkeypatch):
    res, path, _, _, _ = preset_results["gpt", "inference"]
    assert any(type(m).__name__ == "QuantLinear" for m in res.module.modules())
    old = tmp_path / "old"
    _legacy_copy(res, path, old)
    for name in [n for n in sys.modules if n == "bitsandbytes" or n.startswith("bitsandbytes.")]:
        monkeypatch.setitem(sys.modules, name, None)
    _refused(path, "module.json", "bitsandbytes", "not installed")
    _refused(old, "module.pt", "bitsandbytes", "not installed", trust_code=True)


# ============================================================================================ every runtime module

def _body(d):
    """A region body as passes outline them: an aten-level GraphModule of (x, weight, bias)."""
    g = torch.fx.Graph()
    x, w, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("b")
    y = g.call_function(torch.ops.aten.linear.default, (x, w, b))
    g.output(g.call_function(torch.ops.aten.gelu.default, (y,), {"approximate": "tanh"}))
    return torch.fx.GraphModule(nn.Module(), g, class_name=f"Region{d}")


def _zoo():
    """A GraphModule holding the runtime module classes a result may hold, with non-default settings (the mode
    graphs are saved and loaded in tests/test_capture_training_branches.py)."""
    from fxmem.guards import DimSpec, InputGuard, InputSpec
    from fxmem.nn.attention import HybridAttention, SemiseparableAttention
    from fxmem.nn.checkpoint import CheckpointRegion
    from fxmem.nn.gating import GatedResidual
    from fxmem.nn.lowbit import FrozenLinear, LoRALinear, QuantLinear
    from fxmem.nn.modes import ModeFlag
    from fxmem.nn.offload import OffloadRegion, OffloadRuntime
    torch.manual_seed(0)
    d, (B, T) = 64, (2, 8)
    root = nn.Module()
    root.w, root.b = nn.Parameter(torch.randn(d, d) / 8), nn.Parameter(torch.zeros(d))
    root.register_buffer("scale", torch.full((d,), 0.5))
    runtime = OffloadRuntime(tier="disk", prefetch=2, min_bytes=0)
    root.ck = CheckpointRegion(_body(d), keep_ops={"addmm", "gelu"}, label="ck")
    root.off = OffloadRegion(root.ck, runtime, index=0, last=False, param_args=(1, 2), inputs_too=True, label="off",
                             checkpoint_region=root.ck.fxmem_region)
    root.off2 = OffloadRegion(_body(d), runtime, index=1, last=True, param_args=(1, 2), label="off2")
    root.gate = GatedResidual(_body(d), 0, d, reduction=8, threshold=0.3, per_sample=False, label="gate")
    root.q8 = QuantLinear(torch.randn(d, d), torch.randn(d), "int8", threshold=5.0)
    root.frozen = FrozenLinear(torch.randn(d, d) / 8, torch.randn(d), transposed=True, compute_dtype=torch.bfloat16)
    root.lora = LoRALinear(QuantLinear(torch.randn(d, d), None, "nf4", double_quant=False), d, d, rank=4, alpha=8.0,
                           dropout=0.1)
    root.hab = HybridAttention(0.25, causal=True, top_k=4, chunk_size=4)
    root.hab.set_low_rank(torch.randn(d, d), torch.randn(d), torch.randn(d, d), None, heads=2, rank_ratio=0.5)
    root.semi = SemiseparableAttention(0.25, causal=True, rank=4, band=4, hierarchical=True, lowrank_dtype="bf16",
                                       head_dim=d // 2)
    root.mode = ModeFlag()
    root.input_guard = InputGuard([InputSpec("args[0]", (DimSpec(None, "s0", 2, 64), DimSpec(T), DimSpec(d)),
                                             "float32")])
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_module("input_guard", (x,))
    w, b = g.get_attr("w"), g.get_attr("b")
    h = g.call_module("off", (x, w, b))
    h = g.call_module("off2", (h, w, b))
    h = g.call_module("gate", (h, w, b))
    h = g.call_module("lora", (g.call_module("frozen", (g.call_module("q8", (h,)),)),))
    h = g.call_function(torch.ops.aten.mul.Tensor, (h, g.get_attr("scale")))
    q = g.call_function(torch.ops.aten.transpose.int, (g.call_function(torch.ops.aten.view.default,
                                                                       (h, [B, T, 2, d // 2])), 1, 2))
    att = g.call_function(torch.ops.aten.add.Tensor, (g.call_module("hab", (q, q, q, None, h)),
                                                      g.call_module("semi", (q, q, q))))
    g.output(g.call_function(torch.ops.aten.dropout.default, (att, 0.1, g.call_module("mode", ()))))
    gm = torch.fx.GraphModule(root, g, class_name="Zoo")
    gm.ck = root.ck  # also registered under its own name, as the offload pass leaves a region it wraps
    gm.register_buffer("scale", gm.scale, persistent=False)
    return gm, torch.randn(B, T, d)


def test_every_runtime_module_round_trips_with_its_settings(tmp_path):
    from types import SimpleNamespace

    from fxmem.module_configs import kind_of
    gm, x = _zoo()
    res = TransformResult(module=gm, report=None, before=None, after=None, program=SimpleNamespace(
        model_name="Zoo", input_names=["args[0]"]), original=SimpleNamespace(module=gm),
        policy=SimpleNamespace(mode="train"))
    loaded = fxmem.load(save_result(res, tmp_path / "zoo"))
    mods = dict(loaded.named_modules())
    for path, m in gm.named_modules():
        kind = kind_of(m)
        assert type(mods[path]).__name__ == type(m).__name__, path
        if kind is not None:
            a, b = kind.config(m), kind.config(mods[path])
            for cfg in (a, b):
                cfg.get("runtime", {}).pop("id", None)
            assert a == b, path
    assert loaded.off.body is loaded.ck and loaded.off.fxmem_region.body is loaded.ck.body  # shared, as saved
    assert loaded.off.runtime is loaded.off2.runtime and loaded.off.runtime is not gm.off.runtime
    assert "scale" in loaded._non_persistent_buffers_set and list(loaded.state_dict()) == list(gm.state_dict())
    for training in (False, True):
        gm.train(training), loaded.train(training)
        torch.manual_seed(0)
        out_a = gm(x)
        torch.manual_seed(0)
        out_b = loaded(x)
        assert torch.equal(out_a, out_b), training
    out_a.sum().backward(), out_b.sum().backward()
    grads_a = {n: p.grad for n, p in gm.named_parameters() if p.grad is not None}
    grads_b = {n: p.grad for n, p in loaded.named_parameters() if p.grad is not None}
    assert grads_a and grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
