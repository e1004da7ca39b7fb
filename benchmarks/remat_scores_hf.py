"""Attention softmaxes as remat sites on Hugging Face models: `fxmem.transform` with and without
`passes.checkpoint.remat_scores`, kept bytes measured and recompute timed.

Hugging Face's eager attention adds a mask built in the graph (causal and padding, once for all layers) to the
scores; a softmax site's recipe keeps that one tensor (`passes/checkpoint/remat.py`, REMAT_KEPT_SHARE), so these
models get the softmax sites the reference decoder gets. This script asks `fxmem.transform` for activation budgets
(fractions of the captured program's activations) on the bundled GPT-2, BERT and Llama examples at a size like
checkpoint_pareto's `--full` decoder (6 layers, hidden 128, 4 heads, batch 8 x 128 tokens, a padded last row), once
with the option and once without; it measures what each result keeps (`fxmem.measure`) and times their training
steps against the captured graph, interleaved: per round one step of each, a plan's recompute time the median over
rounds of its step less the captured graph's in that round.

    python benchmarks/remat_scores_hf.py                  # hf_gpt2, hf_bert, hf_llama at 30%, 45%, 60%; 30 rounds
    python benchmarks/remat_scores_hf.py --models hf_gpt2 --budgets 45 --rounds 10
"""
from __future__ import annotations

import argparse
import copy
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxmem  # noqa: E402
from fxmem.modelfile import split_inputs  # noqa: E402
from fxmem.step import compute_loss  # noqa: E402
from fxmem.step_timing import interleaved_times  # noqa: E402
from fxmem.units import format_bytes  # noqa: E402

from benchmarks.checkpoint_pareto import paired_difference  # noqa: E402
from benchmarks.remat_products import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# each example's config at the reference decoder's size (its field names)
SIZES = {"hf_gpt2": dict(n_layer=6, n_embd=128, n_head=4, n_positions=128),
         "hf_bert": dict(num_hidden_layers=6, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                         max_position_embeddings=128),
         "hf_llama": dict(num_hidden_layers=6, hidden_size=128, num_attention_heads=4,
                          intermediate_size=512, max_position_embeddings=128)}
BATCH, SEQ = 8, 128


def setup(name: str):
    """(model, args, kwargs, loss_fn): the bundled example at SIZES[name], on BATCH x SEQ tokens."""
    ex = importlib.import_module(f"examples.{name}")
    model = ex.build_model(**SIZES[name])
    args, kwargs = split_inputs(ex.example_inputs(batch=BATCH, seq_len=SEQ))
    return model, args, kwargs, getattr(ex, "loss_fn", None)


def transformed(model, args, kwargs, loss_fn, budget: int, scores: bool):
    """`fxmem.transform` at `budget` percent of the activations, `remat_scores` on or off: (module, measured
    activations, checkpoint pass record)."""
    policy = {"version": 1, "passes": {"checkpoint": {"activation_budget": f"{budget}%", "remat_scores": scores}}}
    res = fxmem.transform(copy.deepcopy(model), args, kwargs, loss_fn=loss_fn, measure=True, policy=policy)
    record = next(r for r in res.report.passes if r.name == "checkpoint")
    return res.module, res.report.measured_after.activations, record


def plan_note(record) -> str:
    """The pass's status, regions recomputed and remat sites (how many softmaxes)."""
    if record.status != "applied":
        return f"{record.status}: {record.reason}"
    plan = " ".join(f"{p}:{c[0]}" for p, c in record.metrics.get("plan", {}).items() if c != "keep")
    remat = record.metrics.get("remat", {})
    return f"{plan or 'no region'}; {remat.get('sites', 0)} remat sites, {remat.get('softmaxes', 0)} softmaxes"


def step_times(modules: dict, args, kwargs, loss_fn, rounds: int) -> dict[str, list[float]]:
    """Interleaved AdamW steps: after a warm-up step each, one step of each module per round, the order rotated
    every round."""
    def step_of(module):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        module.train()

        def step():
            opt.zero_grad(set_to_none=True)
            compute_loss(loss_fn, module(*args, **kwargs), args, kwargs).backward()
            opt.step()
        return step

    steps = {k: step_of(copy.deepcopy(m)) for k, m in modules.items()}
    for step in steps.values():
        step()
    return interleaved_times(steps, rounds)


def model_section(name: str, budgets, rounds: int) -> str:
    model, args, kwargs, loss_fn = setup(name)
    captured = fxmem.capture(copy.deepcopy(model), args, kwargs)
    base = fxmem.measure(copy.deepcopy(captured.module), args, kwargs, loss_fn=loss_fn).activations
    rows, modules = {}, {"captured": captured.module}
    for budget in budgets:
        for scores in (True, False):
            key = f"{'with' if scores else 'without'} softmax sites @{budget}%"
            module, kept, record = transformed(model, args, kwargs, loss_fn, budget, scores)
            rows[key], modules[key] = (budget, kept, plan_note(record)), module
    times = step_times(modules, args, kwargs, loss_fn, rounds)
    lines = [f"### {name} (captured: activations {format_bytes(base)}, best step "
             f"{min(times['captured']) * 1000:.1f} ms)", "",
             "| method | asked | kept (measured) | recompute ms: median (quartiles) | plan |", "|---|---|---|---|---|"]
    for key, (budget, kept, note) in rows.items():
        mid, low, high = paired_difference(times[key], times["captured"])
        lines.append(f"| {key} | {format_bytes(budget * base // 100)} | {format_bytes(kept)} | {mid * 1000:.1f} "
                     f"({low * 1000:.1f} - {high * 1000:.1f}) | {note} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="hf_gpt2,hf_bert,hf_llama")
    ap.add_argument("--budgets", default="30,45,60", help="activation budgets, percent of the captured program's")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=str(RESULTS / "remat_scores_hf.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    budgets = [int(b) for b in args.budgets.split(",")]
    sections = [model_section(name, budgets, args.rounds) for name in args.models.split(",")]
    text = ("# Attention softmaxes as remat sites on Hugging Face models (passes.checkpoint.remat_scores)\n\n"
            f"Reproduce: `python benchmarks/remat_scores_hf.py --models {args.models} --budgets {args.budgets} "
            f"--rounds {args.rounds}` (torch {torch.__version__}, CPU, 2 threads). The bundled examples at 6 layers, "
            f"hidden 128, 4 heads, {BATCH} x {SEQ} tokens; `fxmem.transform` asked for the activation budget, with "
            "and without the option; kept: `fxmem.measure`'s activations of the result. Recompute: a result's step "
            f"less the captured graph's in the same round, median (quartiles) over {args.rounds} rounds.\n\n"
            + "\n".join(sections))
    write_results(text, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
