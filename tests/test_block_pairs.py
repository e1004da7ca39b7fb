"""Joined block pairs: the checkpoint pass's levels where consecutive blocks recompute as one region, so the value
between them (a decoder's residual stream) is recomputed instead of kept."""
from __future__ import annotations

from fxmem.costmodel import CandidateRegion
from fxmem.pipeline import pass_module

from .conftest import gpt_at_activation_budget, step_difference

candidates = pass_module("checkpoint.candidates")


def _regions(*paths: str) -> list[CandidateRegion]:
    return [CandidateRegion(path, []) for path in paths]


def test_pairs_are_consecutive_items_of_one_module_list():
    regions = _regions("wte", "drop", "h.0", "h.1", "h.2", "h.3", "h.4", "ln_f", "layers.7", "layers.9")
    assert candidates.block_pairs(regions) == [(2, 3), (4, 5)]
    assert candidates.block_pairs(_regions("enc.0", "dec.1", "h.1", "h.2")) == [(2, 3)]


def test_the_pair_counts_double_up_to_all():
    assert candidates.pair_counts(0) == []
    assert candidates.pair_counts(1) == [1]
    assert candidates.pair_counts(3) == [1, 2, 3]
    assert candidates.pair_counts(6) == [1, 2, 4, 6]


def test_a_tight_budget_joins_pairs_rather_than_drawing_masks_again(monkeypatch):
    """The 4-block example decoder (with dropout) at 12% of its activations: with one region per block the pass
    must draw some blocks' dropout masks again to fit (a Bernoulli draw per element, the dearest op per byte on a
    CPU); joining blocks in pairs frees the residual stream between them instead, at the cost of one MLP output
    projection per pair. The cost model prefers that, the result is exact, and its activations are as
    estimated."""
    ref, res, args, kwargs, loss_fn, rec = gpt_at_activation_budget("12%")
    metrics = rec.metrics
    assert metrics["granularity"] == "block-pairs-2"
    assert {path: choice for path, choice in metrics["plan"].items() if choice != "keep"} == \
        {"h.0+1": "full", "h.2+3": "full"}
    assert step_difference(ref, res.module, args, kwargs, loss_fn) is None
    assert res.report.measured_after.activations == metrics["estimated_activations"]
    # one region per block: the same budget is met by drawing masks again, at a higher planned cost
    monkeypatch.setattr(candidates, "pair_counts", lambda available: [])
    _, blocks, _, _, _, rec_blocks = gpt_at_activation_budget("12%")
    plan = rec_blocks.metrics["plan"]
    assert not rec_blocks.metrics["granularity"].startswith("block-pairs") and "redraw" in plan.values(), plan
    assert metrics["recompute_roofline_flops"] < rec_blocks.metrics["recompute_roofline_flops"]
