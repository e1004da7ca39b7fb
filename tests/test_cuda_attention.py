"""The attention pass on a CUDA device in bf16 and fp16: every rewritten site reports a fused SDPA kernel (flash,
memory-efficient or cuDNN: not math, which materialises the score matrix), the kernel the dispatcher really runs
is the one reported (the aten ops seen in a training step and in an eval forward), and outputs and gradients stay
within the dtype's rounding of the hand-written attention's. The CPU side is test_attention_examples.py."""
from __future__ import annotations

import pytest
import torch

from fxmem.compare import deviation

from .conftest import OpCounter, example_on, sdpa_kernels
from .test_attention import rewrite, sdpa_nodes

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda")
FUSED = ("flash", "efficient", "cudnn")
# (example, build kwargs): causal without a mask tensor, the same with attention dropout (train mode drops inside
# the kernel), and an additive padding mask (HF GPT-2). (HF Llama in half precision is not rewritten: its softmax
# runs in fp32 and the probabilities are cast back before P @ V, which the matcher does not prove equivalent.)
CASES = [("gpt", dict(n_layer=2, dropout=0.0)), ("gpt", dict(n_layer=2, dropout=0.1)), ("hf_gpt2", {})]
IDS = ["gpt", "gpt-dropout", "hf_gpt2"]
REL_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}  # relative error: a few units of the dtype's rounding


def _half_example(name, build, dtype):
    model, args, kwargs, loss_fn = example_on(name, DEVICE, **build)
    return model.to(dtype), args, kwargs, loss_fn


def _kernels_run(module, args, kwargs, train: bool) -> set[str]:
    """The SDPA kernels a training step (forward + backward, seeded) or an eval forward dispatches to: the fused
    ones seen, else {"math"}."""
    module.train(train)
    counter = OpCounter()
    torch.manual_seed(0)
    with torch.set_grad_enabled(train), counter:
        out = module(*args, **kwargs)
        if train:
            _loss(out).backward()
    return sdpa_kernels(counter) or {"math"}


def _loss(out):
    logits = out if isinstance(out, torch.Tensor) else out["logits"] if isinstance(out, dict) else out[0]
    return logits.float().square().mean()


def _eval_step(module, args, kwargs):
    """Eval-mode output and parameter gradients (no dropout: the manual and SDPA forms compute the same thing)."""
    module.eval()
    for p in module.parameters():
        p.grad = None
    out = module(*args, **kwargs)
    _loss(out).backward()
    logits = out if isinstance(out, torch.Tensor) else out["logits"] if isinstance(out, dict) else out[0]
    return logits.detach(), [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,build", CASES, ids=IDS)
def test_sdpa_sites_report_and_run_a_fused_kernel(name, build, dtype):
    model, args, kwargs, _ = _half_example(name, build, dtype)
    original, rewritten, res = rewrite(model, args, kwargs)
    assert res.changes and len(sdpa_nodes(rewritten)) == len(res.changes), res.notes
    reported = {(c.details["backend"]["train"], c.details["backend"]["eval"]) for c in res.changes}
    assert all(c.details["backend"]["device"].startswith(DEVICE.type) for c in res.changes)
    assert len(reported) == 1, reported  # every site of the model is the same call
    (train_kernel, eval_kernel), = reported
    assert train_kernel in FUSED and eval_kernel in FUSED, ([c.reason for c in res.changes], res.notes)
    assert _kernels_run(rewritten.module, args, kwargs, train=True) == {train_kernel}
    assert _kernels_run(rewritten.module, args, kwargs, train=False) == {eval_kernel}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,build", CASES[::2], ids=IDS[::2])
def test_sdpa_rewrite_matches_manual_attention_in_half_precision(name, build, dtype):
    model, args, kwargs, _ = _half_example(name, build, dtype)
    original, rewritten, _ = rewrite(model, args, kwargs)
    ref_out, ref_grads = _eval_step(original.module, args, kwargs)
    out, got = _eval_step(rewritten.module, args, kwargs)
    assert torch.isfinite(out).all()
    assert deviation(ref_out, out).rel <= REL_TOL[dtype]
    assert len(got) == len(ref_grads) > 0
    assert deviation(ref_grads, got).rel <= 2 * REL_TOL[dtype]
