"""Random models (`tests/fuzz_models.py`) through the `low` policy at several budgets: each result computes what
its model does, and a result that says it fits its budget fits when measured, within the checkpoint pass's slack.

A fixed, CI-sized set of seeds; `python benchmarks/fuzz_budget.py --long N` runs thousands (counts in
benchmarks/results/fuzz_budget.md). The seeds are ones whose plans the cost model once put under their budget
while the measured step went over (in-place ops, RMS and batch norm in selective regions, masked attention; 208: a
checkpointed attention block whose recomputation holds its output and residual until it stops; 246: a batch norm
through a transpose, whose CPU kernel writes a contiguous output, so a residual's gradient arrives transposed and a
linear's backward copies it)."""
from __future__ import annotations

import pytest

from .fuzz_harness import run_model
from .fuzz_models import fuzz_case

SEEDS = (3, 26, 48, 79, 208, 246)
FRACTIONS = (0.0, 0.5)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_results_are_exact_and_fit_when_they_say_so(seed):
    result = run_model(fuzz_case(seed), fractions=FRACTIONS)
    assert result.crash is None, f"{result.description}: {result.crash}"
    assert result.runs, result.description
    claims = 0
    for run in result.runs:
        where = f"{result.description}, budget {run.label} ({run.budget} B)"
        assert run.crash is None, f"{where}: {run.crash}"
        assert run.refused is None, f"{where}: refused a budget the target run reached: {run.refused}"
        assert run.exact_error is None, f"{where}: {run.exact_error}"
        if run.fits:
            claims += 1
            assert run.measured <= run.budget * (1 + run.slack), \
                f"{where}: estimated {run.estimated} B fits, measured {run.measured} B ({run.ratio:.3f}x)"
    assert claims, f"{result.description}: no run claimed to fit (the check would be empty)"
