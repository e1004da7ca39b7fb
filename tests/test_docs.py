"""Code the docs show as a file of the repository is that file, to the character."""
from __future__ import annotations

import re

from .conftest import ROOT

FILE_BLOCK = re.compile(r"<!-- file: (\S+) -->\n```python\n(.*?)```", re.S)


def test_code_blocks_marked_with_a_file_are_that_file():
    shown = [(page.name, path, code) for page in sorted((ROOT / "docs").glob("*.md"))
             for path, code in FILE_BLOCK.findall(page.read_text())]
    assert {path for _, path, _ in shown} >= {"examples/passes/fold_identities.py", "tests/test_fold_identities.py"}
    for page, path, code in shown:
        assert code == (ROOT / path).read_text(), f"docs/{page}: the block of {path} is not the file"
