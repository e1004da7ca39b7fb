"""Models built on the meta device are sized without allocating them (`fxmem.meta_models`): `fxmem.estimate` and
`fxmem.plan_batch` take one as it is, `fxmem estimate model.py --meta` builds the model file's model there, and the
numbers are the materialized model's, byte for byte. What runs the model refuses it in one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxmem
from fxmem.errors import CaptureError

from .conftest import example, example_module

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("params", "buffers", "grads", "optimizer_state", "inputs", "activations", "peak", "peak_at", "unknown_ops")
LLAMA_7B_WIDTHS = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_model():  # Llama-2-7B's widths, two of its 32 layers: 2.7 GB of fp32 weights when materialized
    return LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                                        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000))


def example_inputs():
    ids = torch.randint(0, 32000, (1, 128))
    return {"input_ids": ids, "labels": ids}
"""


def _on_meta(name: str):
    with torch.device("meta"):
        return example_module(name).build_model()


def _fields(est) -> dict:
    return {field: getattr(est, field) for field in FIELDS}


@pytest.mark.parametrize("name", ["gpt", "unet", "gcn", "hf_llama"])
def test_a_meta_model_is_estimated_as_the_materialized_one(name):
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = example(name)
    meta = _on_meta(name)
    assert next(meta.parameters()).device.type == "meta"
    for method, mode in (("static", "train"), ("static", "inference"), ("traced", "train")):
        got = fxmem.estimate(meta, args, kwargs, method=method, mode=mode, loss_fn=loss_fn)
        want = fxmem.estimate(model, args, kwargs, method=method, mode=mode, loss_fn=loss_fn)
        assert _fields(got) == _fields(want), (method, mode)
    assert all(p.device.type == "meta" for p in meta.parameters())  # the user's model is left as it was


# (not the U-Net: its search costs about 40 s of estimates here; its estimates' equality is checked above)
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_plan_batch_of_a_meta_model_is_the_materialized_ones(name):
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = example(name)
    budget = 64 * 2 ** 20
    assert fxmem.plan_batch(_on_meta(name), args, kwargs, budget=budget, loss_fn=loss_fn) == \
        fxmem.plan_batch(model, args, kwargs, budget=budget, loss_fn=loss_fn)


def test_what_runs_the_model_refuses_a_meta_model_naming_the_estimate():
    meta = _on_meta("gpt")
    _, args, kwargs, _ = example("gpt")
    with pytest.raises(CaptureError, match=r"parameter '.+' is on the meta device .*fxmem\.estimate"):
        fxmem.transform(meta, args, kwargs, policy="low")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's peak from /proc (Linux)")
def test_cli_sizes_a_model_wider_than_its_memory_use_with_meta(tmp_path):
    """`fxmem estimate --meta` on Llama-7B widths: the weights' 2.7 GB are estimated, never allocated (the process's
    peak resident memory stays under half of them)."""
    path = tmp_path / "llama7b.py"
    path.write_text(LLAMA_7B_WIDTHS)
    # VmHWM is this process's own peak; ru_maxrss is not: Linux carries the parent's peak across fork and exec, so
    # a pytest worker that had grown to 1.3 GB made this child report 1.3 GB.
    probe = ("import runpy, sys\n"
             f"sys.argv = ['fxmem', 'estimate', {str(path)!r}, '--meta', '--json']\n"
             "try:\n    runpy.run_module('fxmem.cli', run_name='__main__')\n"
             "finally:\n    hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
             "    print('maxrss_kib', hwm, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    namespace: dict = {}
    exec(LLAMA_7B_WIDTHS, namespace)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in namespace["build_model"]().parameters())
    assert out["meta"] and out["estimate"]["params"] == 4 * n_params > 2.5e9
    assert out["estimate"]["unknown_ops"] == []
    maxrss = int(r.stderr.rsplit("maxrss_kib", 1)[1].split()[0]) * 1024
    assert maxrss < out["estimate"]["params"] / 2, maxrss


def test_cli_meta_with_measure_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "fxmem.cli", "estimate", "examples/gpt.py", "--meta", "--measure"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--measure" in lines[0] and "--meta" in lines[0], r.stderr
