"""The bundled model files in examples/ follow the model-file protocol and capture with torch.export.

For every example: build_model()/example_inputs() are deterministic, a train step (fwd + bwd) runs,
loss_fn gives a scalar (also on fake tensors, as fxmem's traced estimate calls it under FakeTensorMode),
calibration_data yields inputs shaped like example_inputs, torch.export captures in train mode, and an
eval-mode capture with Dim.AUTO on every input dim matches eager, on the example inputs and on inputs of
another size (batch / sequence / node count).
"""
from __future__ import annotations

import importlib
import pathlib

import pytest
import torch
from torch.export import Dim, export
from torch.utils import _pytree as pytree

EXAMPLES_DIR = pathlib.Path(__file__).resolve().parents[1] / "examples"

# example name -> example_inputs(**kwargs) of another size, run through the Dim.AUTO capture
VARIANTS = {
    "gpt": dict(batch=3, seq_len=37),
    "hf_llama": dict(batch=1, seq_len=100),
    "hf_gpt2": dict(batch=5, seq_len=37),
    "hf_bert": dict(batch=2, seq_len=50),
    "gcn": dict(copies=2),
    "gat": dict(num_nodes=20),
    "gnn_stan": dict(batch=3, num_nodes=10, seq_len=20),
    "unet": dict(batch=3, size=32),
    "vit": dict(batch=3),
    "mlp_digits": dict(batch=5),
}


def _names():
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.py") if p.stem != "__init__")


def _load(name):
    return importlib.import_module(f"examples.{name}")


def _split(inputs):
    if isinstance(inputs, dict):
        return (), inputs
    assert isinstance(inputs, tuple), f"example_inputs must return a tuple or a dict, got {type(inputs)}"
    return inputs, {}


def _structure(inputs):
    return pytree.tree_map(lambda t: (t.dim(), t.dtype) if isinstance(t, torch.Tensor) else t, inputs)


def _tensors(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _assert_close(a, b):
    ta, tb = _tensors(a), _tensors(b)
    assert len(ta) == len(tb) and ta
    for x, y in zip(ta, tb):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_every_example_is_covered():
    assert set(_names()) == set(VARIANTS), "add new examples to VARIANTS"
    assert (EXAMPLES_DIR / "README.md").is_file()
    readme = (EXAMPLES_DIR / "README.md").read_text()
    for name in _names():
        assert f"{name}.py" in readme, f"{name}.py missing from examples/README.md"


@pytest.mark.parametrize("name", _names())
def test_protocol_and_train_step(name):
    m = _load(name)
    assert m.__doc__ and len(m.__doc__) > 200, "module docstring says what it is, its size and how to scale it"
    model = m.build_model()
    assert isinstance(model, torch.nn.Module)
    inputs = m.example_inputs()
    args, kwargs = _split(inputs)
    # deterministic
    model2, inputs2 = m.build_model(), m.example_inputs()
    for (k1, p1), (k2, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k1 == k2 and torch.equal(p1, p2)
    for t1, t2 in zip(pytree.tree_leaves(inputs), pytree.tree_leaves(inputs2)):
        assert torch.equal(t1, t2)
    # a train step: forward, loss, backward
    model.train()
    out = model(*args, **kwargs)
    loss = m.loss_fn(out, inputs) if hasattr(m, "loss_fn") else sum(t.float().mean() for t in _tensors(out))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    # calibration data has the structure of example_inputs
    if hasattr(m, "calibration_data"):
        batches = list(m.calibration_data(n_batches=2))
        assert len(batches) == 2
        for b in batches:
            assert type(b) is type(inputs)
            assert _structure(b) == _structure(inputs)
            if hasattr(m, "loss_fn"):
                with torch.no_grad():
                    ba, bk = _split(b)
                    assert torch.isfinite(m.loss_fn(model(*ba, **bk), b))


@pytest.mark.parametrize("name", [n for n in _names()])
def test_loss_fn_on_fake_tensors(name):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    m = _load(name)
    if not hasattr(m, "loss_fn"):
        pytest.skip("no loss_fn")
    model, inputs = m.build_model(), m.example_inputs()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with fake_mode:
        fake = pytree.tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, inputs)
        args, kwargs = _split(fake)
        loss = m.loss_fn(model(*args, **kwargs), fake)
        assert loss.dim() == 0


@pytest.mark.parametrize("name", _names())
def test_export_train_and_dynamic_eval(name):
    m = _load(name)
    model, inputs = m.build_model(), m.example_inputs()
    args, kwargs = _split(inputs)
    model.train()
    ep_train = export(model, args, kwargs, strict=False)
    assert any(n.op == "call_function" for n in ep_train.graph.nodes)

    model.eval()
    auto = lambda t: {i: Dim.AUTO for i in range(t.dim())}  # noqa: E731
    dynamic_shapes = {k: auto(v) for k, v in kwargs.items()} if kwargs else tuple(auto(a) for a in args)
    ep = export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    with torch.no_grad():
        _assert_close(ep.module()(*args, **kwargs), model(*args, **kwargs))
        other = m.example_inputs(**VARIANTS[name])
        oa, ok = _split(other)
        assert _structure(other) == _structure(inputs)
        assert [t.shape for t in pytree.tree_leaves(other)] != [t.shape for t in pytree.tree_leaves(inputs)]
        _assert_close(ep.module()(*oa, **ok), model(*oa, **ok))


def test_karate_labels_match_dataset():
    from torch_geometric.datasets import KarateClub

    y = KarateClub()[0].y.tolist()
    assert _load("gcn").KARATE_LABELS == y
    assert _load("gat").KARATE_LABELS == y


def test_gat_teacher_is_frozen_and_runs_without_grad():
    m = _load("gat")
    model = m.build_model()
    assert not any(p.requires_grad for p in model.teacher.parameters())
    student, teacher = model(*m.example_inputs())
    assert student.requires_grad and not teacher.requires_grad


def test_gpt_attention_is_manual_masked_fill():
    m = _load("gpt")
    model = m.build_model()
    ep = export(model.eval(), m.example_inputs(), strict=False)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert {aten.masked_fill.Scalar, aten.softmax.int, aten.matmul.default, aten.dropout.default} <= targets
    assert aten.scaled_dot_product_attention.default not in targets
    assert model.h[0].attn.bias.shape == (1, 1, 128, 128)


def test_imports_have_no_side_effects():
    import subprocess
    import sys

    code = ("import sys, examples.gpt, examples.gcn, examples.gat, examples.unet, examples.vit, examples.mlp_digits, "
            "examples.gnn_stan, examples.hf_gpt2, examples.hf_llama, examples.hf_bert; "
            "bad = [m for m in ('transformers', 'sklearn', 'torch_geometric') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=EXAMPLES_DIR.parent, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", "heavy libraries are imported lazily, inside the functions"
