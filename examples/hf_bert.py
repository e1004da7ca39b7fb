"""Tiny Hugging Face BERT classifier (``transformers.BertForSequenceClassification``), random weights.

What it is
    ``BertForSequenceClassification(BertConfig(...))`` built from a config (no download): word +
    position + token-type embeddings, post-LN encoder layers with eager bidirectional attention
    (matmul -> scale -> additive padding mask -> softmax -> dropout -> matmul), GELU MLP, pooler
    (tanh) and a linear classification head. Dropout 0.1 (BERT's defaults).

Default size
    hidden 64, 2 layers, 4 heads, intermediate 128, vocab 256 (bytes), max_position_embeddings 128,
    2 labels. Inputs: a dict ``{"input_ids", "attention_mask", "token_type_ids"}``, each int64 (4, 64);
    sentence B (token type 1) is the second half of every row and the last row is right-padded with
    8 zeros. Output: ``SequenceClassifierOutput`` with ``logits`` (4, 2). About 0.1 M parameters.

Scaling
    ``build_model(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    vocab_size=30522, max_position_embeddings=512)`` is BERT-base (any BertConfig field, plus
    ``num_labels``); ``example_inputs(batch=..., seq_len=...)``.

Task and data
    Byte-level classification of real text: is a window of UTF-8 bytes from a Python standard-library
    *source* file (label 0) or from a *documentation string* of that module (label 1)? The labels
    are positional, so inputs keep exactly the three keys of ``example_inputs``: row ``r`` of every
    batch has label ``r % 2`` (``loss_fn`` uses that). ``calibration_data`` yields real windows laid
    out that way (code rows even, docstring rows odd, from json, textwrap, string, functools,
    collections); ``evaluate`` returns accuracy on a held-out module (argparse). For
    ``example_inputs`` (random bytes) the same ``r % 2`` labels are used, so its loss is only a
    training signal for memory work, not a meaningful task.

Export notes
    Captures in train and eval mode with ``torch.export.export(model, (), inputs, strict=False)``;
    with ``Dim.AUTO`` on every dim of all three inputs, batch and sequence stay dynamic.
"""

import torch
import torch.nn.functional as F

CONFIG_DEFAULTS = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=128,
    type_vocab_size=2,
    num_labels=2,
)
INPUT_DEFAULTS = dict(batch=4, seq_len=64)


def build_model(**kwargs):
    """Random-weight tiny BertForSequenceClassification; kwargs override BertConfig fields."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(**{**CONFIG_DEFAULTS, **kwargs})
    torch.manual_seed(0)
    return BertForSequenceClassification._from_config(cfg, attn_implementation="eager")


def _pack(ids, n_pad=0):
    batch, seq_len = ids.shape
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    token_type_ids = torch.zeros(batch, seq_len, dtype=torch.long)
    token_type_ids[:, seq_len // 2:] = 1
    if batch > 1 and 0 < n_pad < seq_len:
        attention_mask[-1, seq_len - n_pad:] = 0
        ids[-1, seq_len - n_pad:] = 0
        token_type_ids[-1, seq_len - n_pad:] = 0
    return {"input_ids": ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}


def example_inputs(batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"], vocab_size=256, n_pad=8, **_):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=g, dtype=torch.long)
    return _pack(ids, n_pad)


def _labels(inputs):
    """Row r of a batch is labelled r % 2 (0 = code, 1 = docstring); see the module docstring."""
    return torch.arange(inputs["input_ids"].shape[0], device=inputs["input_ids"].device) % 2


def loss_fn(output, inputs):
    """Cross-entropy of the sequence logits against the positional labels ``row % 2``."""
    logits = output.logits if hasattr(output, "logits") else output["logits"]
    return F.cross_entropy(logits, _labels(inputs))


# ---------------------------------------------------------------- real text data (stdlib sources)

_CALIB_MODULES = ("json", "textwrap", "string", "functools", "collections")
_HELDOUT_MODULES = ("argparse",)


def _code_and_docs(module_names):
    """(code bytes, docstring bytes) of the given stdlib modules, via ``ast`` (deterministic)."""
    import ast
    import importlib
    import inspect

    code, docs = [], []
    for name in module_names:
        path = inspect.getsourcefile(importlib.import_module(name))
        with open(path, "rb") as f:
            src = f.read()
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node, clean=False)
                if d:
                    docs.append(d.encode("utf-8"))
        code.append(src)
    return (torch.tensor(list(b"\n".join(code)), dtype=torch.long),
            torch.tensor(list(b"\n".join(docs)), dtype=torch.long))


def _windows(module_names, n_batches, batch, seq_len):
    code, docs = _code_and_docs(module_names)
    out = []
    for b in range(n_batches):
        rows = []
        for r in range(batch):
            src = docs if r % 2 else code
            i = b * ((batch + 1) // 2) + r // 2  # running index within this source
            stride = max(seq_len, (src.numel() - seq_len) // max(n_batches * ((batch + 1) // 2), 1))
            start = (i * stride) % (src.numel() - seq_len)
            rows.append(src[start:start + seq_len])
        out.append(_pack(torch.stack(rows)))
    return out


def calibration_data(n_batches=8, batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"]):
    """Real byte windows (even rows code, odd rows docstrings of stdlib modules), dicts like ``example_inputs()``."""
    return _windows(_CALIB_MODULES, n_batches, batch, seq_len)


@torch.no_grad()
def evaluate(module, n_batches=4, batch=INPUT_DEFAULTS["batch"], seq_len=INPUT_DEFAULTS["seq_len"]):
    """Accuracy (0..1) of code-vs-docstring classification on held-out windows from argparse.py."""
    was_training = getattr(module, "training", False)
    try:
        module.eval()
    except NotImplementedError:  # bare torch.export module: evaluated in the mode it was captured in
        pass
    correct = total = 0
    try:
        for inp in _windows(_HELDOUT_MODULES, n_batches, batch, seq_len):
            labels = _labels(inp)
            out = module(**inp)
            logits = out.logits if hasattr(out, "logits") else out["logits"]
            correct += (logits.argmax(-1) == labels).sum().item()
            total += labels.numel()
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass
    return correct / total
