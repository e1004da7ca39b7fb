"""A wheel built from the repo ships the passes and presets inside `fxmem` and works outside the source tree."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from .conftest import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for d in ("fxmem", "passes", "policies"):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("fxmem-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for preset in ("low", "medium", "high", "inference"):
        assert f"fxmem/policies/{preset}.yaml" in names
    assert "fxmem/passes/checkpoint/__init__.py" in names and "fxmem/passes/__init__.py" in names
    assert not [n for n in names if n.startswith("passes/") or n.startswith("policies/")], \
        "no top-level passes/policies package may be installed"


def test_wheel_works_outside_source_tree(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                        str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (target / "passes").exists()
    script = textwrap.dedent("""
        import torch, fxmem
        from fxmem.policy_presets import list_presets
        from fxmem.pipeline import load_passes
        assert fxmem.__file__.startswith(TARGET), fxmem.__file__
        assert {"low", "medium", "high", "inference"} <= set(list_presets())
        reg = load_passes()
        assert "checkpoint" in reg, reg
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        x = torch.randn(8, 16)
        res = fxmem.transform(m, (x,), policy="low")
        torch.testing.assert_close(res.module(x), m(x))
        print("ok", sorted(reg))
    """).replace("TARGET", repr(str(target)))
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok")


def test_every_package_of_the_source_tree_is_listed_for_the_wheel():
    """setuptools ships only the packages pyproject lists: each directory of fxmem/ and passes/ with an __init__.py
    (fxmem.costmodel, the checkpoint pass's package) must be among them, or the installed fxmem lacks it."""
    # (tomllib is Python 3.11+; fxmem supports 3.10: the one line is a Python literal)
    line = re.search(r"^packages = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    listed = set(ast.literal_eval(line.group(1)))
    found = set()
    for top, dotted in (("fxmem", "fxmem"), ("passes", "fxmem.passes")):
        for init in (ROOT / top).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((dotted, *parts)))
    assert found <= listed, sorted(found - listed)
