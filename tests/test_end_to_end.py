"""Issue-level acceptance: `fxmem optimize examples/X.py --policy low --out DIR` works end to end for every
example, and the saved result loads and runs with outputs equal to the original model."""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem.cli import main
from fxmem.compare import compare_outputs
from fxmem.modelfile import load_model_file

from .conftest import EXAMPLE_NAMES, ROOT


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_optimize_low_then_load_equals_original(name, tmp_path, capsys):
    out = tmp_path / name
    code = main(["optimize", str(ROOT / "examples" / f"{name}.py"), "--policy", "low", "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    import json
    report = json.loads((out / "report.json").read_text())
    statuses = {p["name"]: p["status"] for p in report["passes"]}
    assert set(statuses) == {"attention", "checkpoint"}
    assert all(s in ("applied", "unchanged") for s in statuses.values()), statuses
    loaded = fxmem.load(out)
    mf = load_model_file(ROOT / "examples" / f"{name}.py")  # the same deterministic model and inputs
    mf.model.eval()
    loaded.eval()
    with torch.no_grad():
        ref = mf.model(*mf.args, **mf.kwargs)
        got = loaded(*mf.args, **mf.kwargs)
    assert compare_outputs(ref, got, atol=1e-5, rtol=1e-4) is None
    # and it still trains: gradients flow to every trainable parameter that had one in the original
    loaded.train()
    from fxmem.step import compute_loss
    compute_loss(mf.loss_fn, loaded(*mf.args, **mf.kwargs), mf.args, mf.kwargs).backward()
    assert any(p.grad is not None for p in loaded.parameters())
