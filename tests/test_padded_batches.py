"""Padded batches keep SDPA and bf16: query rows masked in every column (left padding's padding rows) get eager
attention's value and gradient after the SDPA rewrite (`fxmem.attention_rows`), and masks built from
`finfo(float32).min` keep their meaning in bf16 (`fxmem.extreme_values`). Hand-written attention with left, right
and all-padding rows, and Hugging Face decoders built from small configs through the `low` and `medium` presets."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem
from fxmem.extreme_values import beyond_range

from .conftest import estimates_and_measured
from .test_attention import assert_same, check_exact, rewrite, run_with_grads

aten = torch.ops.aten
BATCH, SEQ = 3, 6


def keep_mask(pattern: str) -> torch.Tensor:
    """(BATCH, SEQ) 0/1 token masks: 'left' and 'right' padding of different lengths, 'all' (one sequence is
    padding only), 'none'."""
    keep = torch.ones(BATCH, SEQ, dtype=torch.long)
    if pattern == "left":
        keep[0, :3] = 0
        keep[1, :1] = 0
    elif pattern == "right":
        keep[0, -2:] = 0
    elif pattern == "all":
        keep[1] = 0
        keep[2, :4] = 0
    return keep


class PaddedCausalAttention(nn.Module):
    """Decoder self-attention as Hugging Face writes it: repeat_kv for grouped-query heads, an additive mask of
    finfo(dtype).min over future and padding keys, softmax, probabilities @ v."""

    def __init__(self, dim=16, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, kv_heads * self.head_dim)
        self.v = nn.Linear(dim, kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)

    def _heads(self, x, n):
        return x.view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def forward(self, x, keep):
        batch, seq, _ = x.shape
        q = self._heads(self.q(x), self.heads)
        k, v = (self._heads(proj(x), self.kv_heads) for proj in (self.k, self.v))
        groups = self.heads // self.kv_heads
        k, v = (t[:, :, None].expand(batch, self.kv_heads, groups, seq, self.head_dim)
                .reshape(batch, self.heads, seq, self.head_dim) for t in (k, v))
        lowest = torch.finfo(x.dtype).min
        mask = torch.full((seq, seq), lowest, dtype=x.dtype, device=x.device).triu(1)[None, None]
        mask = mask.masked_fill(keep[:, None, None, :] == 0, lowest)
        scores = q @ k.transpose(-2, -1) * self.head_dim ** -0.5 + mask
        out = scores.softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


def attention_inputs(pattern: str):
    torch.manual_seed(0)
    return PaddedCausalAttention(), (torch.randn(BATCH, SEQ, 16), keep_mask(pattern))


@pytest.mark.parametrize("pattern", ["left", "right", "all", "none"])
def test_fully_masked_rows_keep_eager_outputs_and_gradients(pattern):
    model, args = attention_inputs(pattern)
    # (the key bias's gradient is zero in exact arithmetic: both sides give rounding noise of about 1e-7)
    _, rewritten, _ = check_exact(model, args, sites=1, floor=1e-6)
    assert any(n.target is aten.amax.default for n in rewritten.graph.nodes), "the rows are selected at run time"


def test_rows_are_selected_at_run_time_for_each_batch():
    """Rewritten on a batch without padding, the module is still exact on batches with other padding."""
    model, args = attention_inputs("none")
    original, rewritten, _ = rewrite(model, args)
    for pattern in ("left", "all", "right"):
        other = (args[0], keep_mask(pattern))
        assert_same(run_with_grads(original.module, other), run_with_grads(rewritten.module, other), floor=1e-6)


def test_plain_sdpa_would_change_the_gradients_of_fully_masked_rows():
    """The case the correction exists for: SDPA alone agrees on the values but not on the gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., 0, :] = torch.finfo(torch.float32).min
    eager = ((q @ k.transpose(-2, -1) + mask).softmax(-1) @ v)
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    torch.testing.assert_close(fused, eager)
    eager_grad = torch.autograd.grad(eager.sum() + (eager ** 2).sum(), k)[0]
    fused_grad = torch.autograd.grad(fused.sum() + (fused ** 2).sum(), k)[0]
    assert not torch.allclose(fused_grad, eager_grad, atol=1e-3)


# ============================================================================================ bf16 masks

def test_min_mask_casts_saturate_in_bf16():
    model, args = attention_inputs("left")
    program = fxmem.capture(model, args, check=False)
    beyond = beyond_range(program.module, torch.bfloat16)
    assert any(n.target is aten.masked_fill.Scalar for n in beyond)
    assert not any(n.target is aten.softmax.int for n in beyond), "softmax bounds its output"
    assert not beyond_range(program.module, torch.float32)


# ============================================================================================ Hugging Face decoders

def hf_decoder(name: str):
    import transformers
    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[name]
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=64, max_position_embeddings=32, use_cache=False)
    cfg._attn_implementation = "eager"
    return model_cls(cfg).eval()


def lm_batch(pattern: str):
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    keep = keep_mask(pattern)
    labels = ids.masked_fill(keep == 0, -100)  # HF's shifted labels still train the last padding position
    return (ids,), {"attention_mask": keep, "labels": labels}


def outcome(result, name):
    (record,) = [r for r in result.report.passes if r.name == name]
    return record


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_left_padded_decoder_keeps_sdpa_in_low(name):
    model = hf_decoder(name)
    args, kwargs = lm_batch("left")
    result = fxmem.transform(copy.deepcopy(model), args, kwargs, policy="low")
    attention = outcome(result, "attention")
    assert attention.status == "applied", attention.reason
    assert attention.metrics["rewritten"] == 2
    for pattern in ("left", "all"):
        other_args, other_kwargs = lm_batch(pattern)
        ref = model(*other_args, **other_kwargs)
        got = result.module(*other_args, **other_kwargs)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-5)
        names = [name for name, _ in model.named_parameters()]
        ref_grads = torch.autograd.grad(ref.loss, [model.get_parameter(n) for n in names])
        got_grads = torch.autograd.grad(got.loss, [result.module.get_parameter(n) for n in names])
        for name, ref_grad, got_grad in zip(names, ref_grads, got_grads):
            torch.testing.assert_close(got_grad, ref_grad, rtol=1e-4, atol=1e-5, msg=name)


def test_left_padded_decoder_keeps_bf16_in_medium():
    model = hf_decoder("qwen2")
    args, kwargs = lm_batch("left")
    for attention in (True, False):
        result = fxmem.transform(copy.deepcopy(model), args, kwargs, policy="medium",
                                 overrides=[f"passes.attention.enabled={str(attention).lower()}",
                                           "passes.checkpoint.enabled=false"])
        precision = outcome(result, "precision")
        (intent,) = precision.intents
        assert intent["complete"], intent
        got = result.module(*args, **kwargs)
        assert torch.isfinite(got.logits).all()
        assert abs(got.loss.item() - model(*args, **kwargs).loss.item()) < 0.02


class LearnedBiasAttention(nn.Module):
    """Attention with a learned additive bias per head (T5's and ALiBi-like position biases), the scale applied
    by division: the rewrite passes the bias to SDPA as its mask, and the rows check reads the bias."""

    def __init__(self, dim=32, heads=4, seq=16):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(heads, seq, seq) * 0.1)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / (dim // self.heads) ** 0.5 + self.bias
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, dim))


@pytest.mark.parametrize("name", ["padded_mask", "learned_bias"])
def test_static_estimate_of_the_rewritten_attention_equals_traced_and_measured(name):
    """After the rewrite, the fully masked rows' correction is estimated exactly: k read through a transpose and
    directly (its gradient is unbind's view's, not the whole projection's), and a learned bias's extremes read
    without keeping the bias to backward."""
    if name == "padded_mask":
        model, args = attention_inputs("left")
    else:
        torch.manual_seed(0)
        model, args = LearnedBiasAttention(), (torch.randn(8, 16, 32),)
    result = fxmem.transform(model, args, policy="low")
    assert any(n.target is aten.scaled_dot_product_attention.default for n in result.module.graph.nodes)
    static, traced, measured = estimates_and_measured(result.program, args)
    assert static == traced == measured
