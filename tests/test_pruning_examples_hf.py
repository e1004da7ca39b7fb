"""Structural pruning on the Hugging Face example files (see test_pruning_examples.py)."""
from __future__ import annotations

import pytest

from tests.test_pruning_examples import check_example

CASES = {
    "hf_llama": (dict(), 2),  # SwiGLU MLPs (gate + up -> down)
    "hf_gpt2": (dict(), 2),  # HF Conv1D (addmm) MLPs
    "hf_bert": (dict(), 3),  # intermediate MLPs + pooler -> classifier
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pruning_example_hf(name):
    build, n = CASES[name]
    check_example(name, build, n)
