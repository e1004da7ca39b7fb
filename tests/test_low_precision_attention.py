"""Attention in bf16 / fp16 models: the softmax computed in float32 and cast back (Hugging Face's eager attention and
the forms hand-written code uses) becomes SDPA in the model's dtype; verification judges low-precision results
against the programs' float32 shadows (`fxmem.compare`, `fxmem.shadow`), so it still catches a wrong rewrite; every
declined site is named with its reason, in the pass's record too."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxmem
from fxmem.compare import ASSERT_CLOSE_TOLERANCES, Precision, compare_outputs, least_precise, tensor_difference
from fxmem.pipeline import compare_grads, compare_references, pass_module, run_reference
from fxmem.policy import VerifyOptions
from fxmem.shadow import float32_shadow

from .exactness import train_step
from .test_attention import rewrite, sdpa_nodes

aten = torch.ops.aten
LOW = [torch.bfloat16, torch.float16]
SOFTMAX_OPS = (aten.softmax.int, aten._softmax.default)


def hf_decoder(name: str, dtype: torch.dtype, layers: int = 2):
    """A Qwen2 or Llama decoder (eager attention, grouped-query heads) in `dtype`, from a small random config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[name]
    torch.manual_seed(0)
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    config._attn_implementation = "eager"
    return model_class(config).to(dtype)


def left_padded_batch():
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(1))
    keep = torch.ones_like(ids)
    keep[0, :3] = 0
    keep[1, :1] = 0
    return (ids,), {"attention_mask": keep, "labels": ids.masked_fill(keep == 0, -100)}


def hf_loss(output, inputs=None):
    return output["loss"]


def attention_record(result):
    (record,) = [r for r in result.records if r.name == "attention"]
    return record


def softmax_nodes(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target in SOFTMAX_OPS]


def assert_matches_eager(model, result, args, kwargs, dtype):
    """The result's training step (output, gradients) equals the eager model's at `dtype`'s precision: the float32
    runs (the eager model in float32, the result's float32 shadow) agree at float32 tolerances, and the result in
    `dtype` is no further from float32 than twice eager's plus one rounding."""
    eager = train_step(copy.deepcopy(model), args, kwargs, hf_loss)
    eager32 = train_step(copy.deepcopy(model).float(), args, kwargs, hf_loss)
    got = train_step(copy.deepcopy(result.module), args, kwargs, hf_loss)
    got32 = train_step(float32_shadow(result.program).module, args, kwargs, hf_loss)
    outputs = Precision(dtype, eager32[0], got32[0])
    assert compare_outputs(eager[0], got[0], atol=1e-5, rtol=1e-4, precision=outputs) is None
    grads = Precision(dtype, eager32[1], got32[1])
    assert eager[1].keys() == got[1].keys() and eager[1]
    assert compare_grads(eager[1], got[1], 1e-5, 1e-4, grads) is None


# ============================================================================================ Hugging Face models

@pytest.mark.parametrize("name,dtype", [("qwen2", torch.bfloat16), ("llama", torch.float16)])
def test_hf_decoder_in_low_precision_takes_sdpa_through_low(name, dtype):
    model = hf_decoder(name, dtype)
    args, kwargs = left_padded_batch()
    result = fxmem.transform(copy.deepcopy(model), args, kwargs, policy="low", loss_fn=hf_loss,
                             passes__checkpoint__enabled=False)
    record = attention_record(result)
    assert record.status == "applied", record.reason
    assert len(sdpa_nodes(result.program)) == 2 and not softmax_nodes(result.program)
    assert all("softmax in float32" in c.reason for c in record.changes)
    low = str(dtype).removeprefix("torch.")
    assert record.deviation["precision"].startswith(f"{low}: the float32 shadows agree")
    assert_matches_eager(model, result, args, kwargs, dtype)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_hf_decoder_sdpa_rewrite_is_verified_in_its_dtype(name, dtype):
    """The rewrite alone (no pipeline): SDPA in the model's dtype at each layer, and the pipeline's comparison of a
    seeded training step (outputs, gradients) accepts it."""
    model = hf_decoder(name, dtype)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    original, rewritten, res = rewrite(model, (ids,), {"labels": ids})
    assert len(res.changes) == 2 and not softmax_nodes(rewritten)
    for node in sdpa_nodes(rewritten):
        assert node.meta["fxmem_val"].dtype == dtype
    ref = run_reference(original, "train", hf_loss, training=True)
    got = run_reference(rewritten, "train", hf_loss, training=True)
    assert ref.shadow is not None and got.shadow is not None, (ref.shadow_error, got.shadow_error)
    assert compare_references(ref, got, VerifyOptions(), buffers=True) is None


def test_wrong_scale_in_bf16_is_caught_by_verification(monkeypatch):
    """A rewrite whose scale is 2% off is within bf16's own rounding of the outputs, but the float32 shadows tell
    it: the pass is rolled back."""
    attention = pass_module("attention")
    right = attention.emit_scale
    monkeypatch.setattr(attention, "emit_scale", lambda graph, factors: right(graph, factors) * 1.02)
    model = hf_decoder("qwen2", torch.bfloat16)
    args, kwargs = left_padded_batch()
    result = fxmem.transform(model, args, kwargs, policy="low", loss_fn=hf_loss, passes__checkpoint__enabled=False)
    record = attention_record(result)
    assert record.status == "rolled_back"
    assert "float32 shadows" in record.reason, record.reason


# ============================================================================================ hand-written forms

class LowPrecisionAttention(nn.Module):
    """Single-head-group attention written as bf16/fp16 code does: `form` says how the softmax runs in float32 and
    how its probabilities come back to the model's dtype; `mask` adds a padding mask before or after the upcast."""

    def __init__(self, form: str, mask: str | None = None, dim: int = 16, heads: int = 2):
        super().__init__()
        self.form, self.mask, self.heads, self.head_dim = form, mask, heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, pad):
        batch, seq, dim = x.shape
        q, k, v = (t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).split(dim, dim=2))
        scores = q @ k.transpose(-2, -1) * self.head_dim ** -0.5
        if self.mask == "before":
            scores = scores + pad
        if self.form == "dtype_arg":
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            wide = scores.float() + pad if self.mask == "after" else scores.float()
            probs = F.softmax(wide, dim=-1)
            probs = {"type_as": lambda: probs.type_as(q), "to_other": lambda: probs.to(q),
                     "to_dtype": lambda: probs.to(q.dtype), "not_cast_back": lambda: probs}[self.form]()
            v = v.float() if self.form == "not_cast_back" else v
        return (probs @ v).sum(dim=1)


def hand_inputs(dtype, pad_dtype=None):
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    pad = torch.zeros(2, 1, 1, 5, dtype=pad_dtype or dtype)
    pad[0, ..., :2] = torch.finfo(pad.dtype).min
    return x, pad


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("form,mask", [("dtype_arg", "before"), ("type_as", None), ("to_other", "before"),
                                       ("to_dtype", "after")])
def test_softmax_in_float32_cast_back_becomes_sdpa(form, mask, dtype):
    model = LowPrecisionAttention(form, mask).to(dtype)
    original, rewritten, res = rewrite(model, hand_inputs(dtype))
    assert len(res.changes) == 1, res.notes
    assert not softmax_nodes(rewritten) and len(sdpa_nodes(rewritten)) == 1
    assert "softmax in float32" in res.changes[0].reason
    ref = run_reference(original, "train", lambda out, inputs=None: out.float().square().sum())
    got = run_reference(rewritten, "train", lambda out, inputs=None: out.float().square().sum())
    assert compare_references(ref, got, VerifyOptions()) is None


@pytest.mark.parametrize("form,mask,pad_dtype,reason", [
    ("not_cast_back", None, None, "is not cast back to torch.bfloat16 before P @ V"),
    ("type_as", "after", torch.float32, "additive mask pad is torch.float32 while the attention computes in"),
], ids=["not-cast-back", "float32-mask"])
def test_low_precision_forms_sdpa_cannot_take_are_declined_with_a_reason(form, mask, pad_dtype, reason):
    model = LowPrecisionAttention(form, mask).to(torch.bfloat16)
    original, rewritten, res = rewrite(model, hand_inputs(torch.bfloat16, pad_dtype))
    assert not res.modified and not sdpa_nodes(rewritten)
    assert any(note.startswith("<root>: not rewritten: ") and reason in note for note in res.notes), res.notes
    assert res.reason.startswith("1 attention site(s) not rewritten: <root>: ") and reason in res.reason


class GatingDecoy(nn.Module):
    """Not attention: a bf16 router whose float32 softmax, cast back, mixes a learned table (no Q @ K^T)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.table = nn.Parameter(torch.randn(4, 16))

    def forward(self, x, pad=None):
        weights = F.softmax(self.router(x), dim=-1, dtype=torch.float32).to(x.dtype)
        return weights @ self.table


def test_low_precision_decoy_is_left_untouched():
    original, rewritten, res = rewrite(GatingDecoy().to(torch.bfloat16), (hand_inputs(torch.bfloat16)[0],))
    assert not res.modified and not res.notes and not res.reason
    assert str(original.graph) == str(rewritten.graph)


class SoftCapped(nn.Module):
    """Attention whose scores are soft-capped with tanh (Gemma 2): no SDPA equivalent."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = (t.view(2, 5, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=2))
        scores = torch.tanh(q @ k.transpose(-2, -1) / 30.0) * 30.0
        return F.softmax(scores, dim=-1) @ v


def test_declined_site_is_named_with_its_reason_in_the_record_and_report():
    x = torch.randn(2, 5, 16)
    result = fxmem.transform(SoftCapped(), (x,), policy="low", loss_fn=lambda out, inputs=None: out.sum(),
                             passes__checkpoint__enabled=False)
    record = attention_record(result)
    assert record.status == "unchanged"
    assert record.reason == ("1 attention site(s) not rewritten: <root>: tanh.default (tanh) between Q @ K^T and "
                             "the softmax has no SDPA equivalent")
    assert f"**why unchanged:** {record.reason}" in result.report.to_markdown()


# ============================================================================================ what "equal" means

def test_float32_comparisons_keep_the_policy_tolerances():
    ref = torch.linspace(1, 2, 100)
    assert compare_outputs(ref, ref * (1 + 5e-5), atol=1e-5, rtol=1e-4) is None
    why = compare_outputs(ref, ref * (1 + 3e-4), atol=1e-5, rtol=1e-4)
    assert why.startswith("output leaf 0: max abs diff 0.0006") and why.endswith("(atol 1e-05, rtol 0.0001)")


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_without_shadows_low_precision_leaves_get_assert_close_tolerances(dtype):
    rtol, _ = ASSERT_CLOSE_TOLERANCES[dtype]
    ref = torch.linspace(1, 2, 100)
    within, beyond = (ref * (1 + factor * rtol) for factor in (0.25, 3.0))
    leaves = {"logits": ref.to(dtype), "loss": ref.sum()}  # the float32 loss of a low-precision model too
    assert least_precise(leaves) == dtype
    assert compare_outputs(leaves, {"logits": within.to(dtype), "loss": within.sum()}, atol=1e-5, rtol=1e-4) is None
    why = compare_outputs(leaves, {"logits": beyond.to(dtype), "loss": ref.sum()}, atol=1e-5, rtol=1e-4)
    assert why is not None and "no float32 shadow" in why
    # zero tolerances still mean identical values (a copied state)
    assert compare_outputs(ref.to(dtype), within.to(dtype), atol=0.0, rtol=0.0) is not None


def rounded(values: torch.Tensor, dtype, noise: float, seed: int) -> torch.Tensor:
    """`values` with relative noise of `noise` eps of `dtype`, rounded to `dtype`."""
    scale = noise * torch.finfo(dtype).eps
    return (values * (1 + scale * torch.randn(values.shape, generator=torch.Generator().manual_seed(seed)))).to(dtype)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_shadow_rule_accepts_rounding_and_catches_math_and_accuracy_changes(dtype):
    truth = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    ref = rounded(truth, dtype, 8.0, seed=1)  # a deep model's rounding: far beyond assert_close's tolerance
    other = rounded(truth, dtype, 8.0, seed=2)
    assert tensor_difference(ref, other, 1e-5, 1e-4, Precision(dtype)) is not None
    assert tensor_difference(ref, other, 1e-5, 1e-4, Precision(dtype, truth, truth)) is None
    wrong_math = truth * 1.001  # the rewrite computes another function: its float32 shadow says so
    why = tensor_difference(ref, wrong_math.to(dtype), 1e-5, 1e-4, Precision(dtype, truth, wrong_math))
    assert why is not None and "float32 shadows" in why
    worse = rounded(truth, dtype, 40.0, seed=3)  # the same function, rounded five times worse
    why = tensor_difference(ref, worse, 1e-5, 1e-4, Precision(dtype, truth, truth))
    assert why is not None and "from float32" in why
    nan = other.clone()
    nan[0] = math.nan
    assert "non-finite" in tensor_difference(ref, nan, 1e-5, 1e-4, Precision(dtype, truth, truth))


def test_float32_shadow_upcasts_weights_inputs_graph_dtypes_and_extremes_and_keeps_ties():
    model = hf_decoder("llama", torch.bfloat16, layers=1)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    program = fxmem.capture(model, (ids,), {"labels": ids}, check=False, dynamic=False)
    shadow = float32_shadow(program)
    tensors = list(shadow.module.parameters()) + list(shadow.module.buffers())
    assert tensors and all(t.dtype != torch.bfloat16 for t in tensors)
    dtypes = [a for n in shadow.graph.nodes for a in list(n.args) + list(n.kwargs.values())
              if isinstance(a, torch.dtype)]
    assert torch.float32 in dtypes and torch.bfloat16 not in dtypes
    literals = [a for n in shadow.graph.nodes for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
                if isinstance(a, float)]
    assert torch.finfo(torch.float32).min in literals and torch.finfo(torch.bfloat16).min not in literals
    assert shadow.module.get_parameter("lm_head.weight") is shadow.module.get_parameter("model.embed_tokens.weight")
    assert all(p.dtype == torch.bfloat16 for p in program.module.parameters())  # the program is left as it was
    out = shadow.module(ids, labels=ids)
    assert out["logits"].dtype == torch.float32
