"""Tiny Hugging Face Llama (``transformers.LlamaForCausalLM``) with random weights.

What it is
    ``LlamaForCausalLM(LlamaConfig(...))`` built from a config (no download): RMSNorm, rotary
    position embeddings, grouped-query attention (4 query heads, 2 key/value heads, so
    ``repeat_kv`` appears in the graph), SwiGLU MLP. ``attn_implementation="eager"`` (the
    explicit matmul -> scale -> mask add -> softmax -> dropout -> matmul attention) and
    ``use_cache=False`` (a DynamicCache in the output would not survive export).

Default size
    hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128, vocab 256 (bytes),
    max_position_embeddings 128, attention_dropout 0.0 (Llama's default; pass ``attention_dropout=0.1``
    to get dropout nodes). Inputs: a dict ``{"input_ids": int64 (4, 64), "attention_mask": int64 (4, 64)}``
    where the last row is right-padded with 8 zeros. Output: ``CausalLMOutputWithPast``
    with ``logits`` (4, 64, 256). About 0.1 M parameters.

Scaling
    ``build_model(hidden_size=..., num_hidden_layers=..., num_attention_heads=...,
    num_key_value_heads=..., intermediate_size=..., vocab_size=..., max_position_embeddings=...)``
    (any LlamaConfig field); ``example_inputs(batch=..., seq_len=...)``.

Data
    ``calibration_data``/``evaluate`` use UTF-8 bytes of Python standard-library source files as
    token ids (vocab 256), deterministic, no download.

Export notes
    Captures in train and eval mode with ``torch.export.export(model, (), inputs, strict=False)``;
    with ``Dim.AUTO`` on every dim of both inputs, batch and sequence stay dynamic.
"""

import torch
import torch.nn.functional as F

CONFIG_DEFAULTS = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    use_cache=False,
    tie_word_embeddings=False,
)
INPUT_DEFAULTS = dict(batch=4, seq_len=64)


def build_model(**kwargs):
    """Random-weight tiny LlamaForCausalLM; kwargs override LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**CONFIG_DEFAULTS, **kwargs})
    cfg.use_cache = False
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    return model


def example_inputs(batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"], vocab_size=256, n_pad=8, **_):
    """Dict of input_ids and attention_mask; the last row ends with ``n_pad`` padding positions."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=g, dtype=torch.long)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    if batch > 1 and 0 < n_pad < seq_len:
        attention_mask[-1, seq_len - n_pad:] = 0
        input_ids[-1, seq_len - n_pad:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def loss_fn(output, inputs):
    """Next-token cross-entropy on input_ids, ignoring padded target positions."""
    logits = output.logits if hasattr(output, "logits") else output["logits"]
    ids = inputs["input_ids"]
    targets = ids[:, 1:].masked_fill(inputs["attention_mask"][:, 1:] == 0, -100)
    logits = logits[:, :-1, :]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


# ---------------------------------------------------------------- real text data (stdlib sources)

_CALIB_MODULES = ("json", "textwrap", "string", "functools", "collections")
_HELDOUT_MODULES = ("argparse",)


def _text_bytes(module_names):
    import importlib
    import inspect

    chunks = []
    for name in module_names:
        path = inspect.getsourcefile(importlib.import_module(name))
        with open(path, "rb") as f:
            chunks.append(f.read())
    return torch.tensor(list(b"\n".join(chunks)), dtype=torch.long)


def _windows(data, n_batches, batch, seq_len):
    n = n_batches * batch
    stride = max(seq_len, (data.numel() - seq_len) // max(n, 1))
    out = []
    for b in range(n_batches):
        rows = [data[((b * batch + r) * stride) % (data.numel() - seq_len):][:seq_len] for r in range(batch)]
        ids = torch.stack(rows)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


def calibration_data(n_batches=8, batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"]):
    """Byte windows of Python stdlib source text, as dicts like ``example_inputs()``."""
    return _windows(_text_bytes(_CALIB_MODULES), n_batches, batch, seq_len)


evaluate_mode = "min"  # evaluate() is a loss: lower is better (fxmem's guard reads this, not the docstring)


@torch.no_grad()
def evaluate(module, n_batches=4, batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"]):
    """Mean next-token cross-entropy (nats/byte) on held-out stdlib text (argparse.py). Lower is better."""
    was_training = getattr(module, "training", False)
    try:
        module.eval()
    except NotImplementedError:  # bare torch.export module: evaluated in the mode it was captured in
        pass
    try:
        losses = [loss_fn(module(**inp), inp).item()
                  for inp in _windows(_text_bytes(_HELDOUT_MODULES), n_batches, batch, seq_len)]
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass
    return sum(losses) / len(losses)
