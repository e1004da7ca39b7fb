"""The README's quick start is what CI runs: exactly two command lines, and .ci/run uses the test one."""
from __future__ import annotations

import re

from .conftest import ROOT


def _commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", quick, re.S)]


def test_two_command_lines():
    cmds = _commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert "fxmem optimize examples/" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    test_cmd = _commands()[1]
    install_and_test = test_cmd[test_cmd.index("pip install torch"):]
    assert install_and_test in (ROOT / ".ci" / "run").read_text()


def test_readme_and_docs_links_exist():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for link in re.findall(r"\]\(((?!http)[^)#]+)\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.relative_to(ROOT)}: {link}"
