"""The result is called exactly as the model is, and its state dict is the model's.

Every bundled example (small builds) and Hugging Face models built from small configs whose config turns the cache
on (so capture binds `use_cache=False` inside the graph) go through `low`: the result, and the result saved and
loaded again, are called with the user's own args/kwargs and compute what the model computes (eval output; a
seeded training step's output, gradients and buffers); `state_dict()` has the model's keys (T5's tensor constant
lifted out of forward is no key), so `load_state_dict(strict=True)` works from the model to the result and back.
"""
from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

import fxmem
from fxmem.capture_defaults import capture_defaults
from fxmem.errors import InputShapeError
from fxmem.modelfile import split_inputs

from .conftest import EXAMPLE_NAMES
from .exactness import difference

warnings.filterwarnings("ignore")

# (build_model kwargs, example_inputs kwargs): every bundled example, small
SMALL_EXAMPLES = {
    "gat": ({}, {}),
    "gcn": ({}, {}),
    "gnn_stan": (dict(gnn_hidden=16, d_model=16, n_head=2, max_len=32), dict(batch=2, num_nodes=8, seq_len=8)),
    "gpt": (dict(n_layer=1, n_head=2, d_model=32, block_size=32), dict(batch=2, seq_len=16)),
    "hf_bert": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
                dict(batch=2, seq_len=16)),
    "hf_gpt2": (dict(n_embd=32, n_layer=1, n_head=2), dict(batch=2, seq_len=16)),
    "hf_llama": (dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64), dict(batch=2, seq_len=16)),
    "mlp_digits": (dict(hidden=32), dict(batch=8)),
    "unet": (dict(base=4), dict(batch=2)),
    "vit": (dict(d_model=32, n_layer=1, n_head=2), dict(batch=2)),
}


def _example(name):
    mod = importlib.import_module(f"examples.{name}")
    build, inputs = SMALL_EXAMPLES[name]
    args, kwargs = split_inputs(mod.example_inputs(**inputs))
    return mod.build_model(**build), args, kwargs, getattr(mod, "loss_fn", None)


def _tokens(batch=2, seq=8, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, -2:] = 0
    return ids, mask


def _bert_model():
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32)
    ids, mask = _tokens()
    return BertModel(cfg), (), {"input_ids": ids, "attention_mask": mask}, None


def _decoder(config_cls, model_cls):
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, max_position_embeddings=32)
    assert cfg.use_cache, "the case is about a config whose cache is on"
    ids, mask = _tokens()
    return model_cls(cfg), (ids,), {"attention_mask": mask}, None


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return _decoder(LlamaConfig, LlamaForCausalLM)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _decoder(Qwen2Config, Qwen2ForCausalLM)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0)
    ids, mask = _tokens()
    labels = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    return T5ForConditionalGeneration(cfg), (), {"input_ids": ids, "attention_mask": mask, "labels": labels}, None


HF_MODELS = {"bert_model": _bert_model, "llama": _llama, "qwen2": _qwen2, "t5": _t5}
CASES = [f"example:{n}" for n in EXAMPLE_NAMES] + [f"hf:{n}" for n in HF_MODELS]


def test_every_bundled_example_is_covered():
    assert sorted(SMALL_EXAMPLES) == EXAMPLE_NAMES


class _Results(dict):
    """case -> (model, args, kwargs, loss_fn, result, loaded result), each transformed (low) on first use."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, case):
        kind, name = case.split(":")
        model, args, kwargs, loss_fn = _example(name) if kind == "example" else HF_MODELS[name]()
        result = fxmem.transform(model, args, kwargs, policy="low", loss_fn=loss_fn)
        path = result.save(self.tmp_path_factory.mktemp(name) / "r")
        self[case] = (model, args, kwargs, loss_fn, result.module, fxmem.load(path))
        return self[case]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _Results(tmp_path_factory)


@pytest.mark.parametrize("case", CASES)
def test_result_takes_the_users_own_arguments_and_low_stays_exact(results, case):
    model, args, kwargs, loss_fn, module, _ = results[case]
    assert difference(model, module, args, kwargs, loss_fn) is None, case


@pytest.mark.parametrize("case", CASES)
def test_loaded_result_takes_the_users_own_arguments_and_stays_exact(results, case):
    model, args, kwargs, loss_fn, _, loaded = results[case]
    assert difference(model, loaded, args, kwargs, loss_fn) is None, case


@pytest.mark.parametrize("case", CASES)
def test_state_dict_keys_are_the_models_and_load_strictly_both_ways(results, case):
    model, _, _, _, module, loaded = results[case]
    for result in (module, loaded):
        _assert_state_dict_is_the_models(result, model)


def _assert_state_dict_is_the_models(result, model):
    """The same keys (in a copy of the result too), and strict loads from one into the other both ways."""
    keys = sorted(model.state_dict())
    assert sorted(result.state_dict()) == keys
    copied = copy.deepcopy(result)
    assert sorted(copied.state_dict()) == keys
    copied.load_state_dict(model.state_dict(), strict=True)
    copy.deepcopy(model).load_state_dict(result.state_dict(), strict=True)


def test_capture_binds_use_cache_inside_the_graph_and_says_so():
    model, args, kwargs, _ = _llama()
    program = fxmem.capture(model, args, kwargs)
    assert program.input_names == ["args[0]", "kwargs['attention_mask']"]
    assert program.example_kwargs == kwargs
    assert any("use_cache=False bound inside the graph" in note for note in program.notes)
    assert "forward" not in model.__dict__, "the model's own forward is put back"
    assert model(*args, **kwargs).past_key_values is not None


def test_a_use_cache_the_user_passes_is_the_users_own():
    model, args, kwargs, _ = _llama()
    assert capture_defaults(model, args, kwargs) == {"use_cache": False}
    assert capture_defaults(model, args, {**kwargs, "use_cache": False}) == {}
    model.config.use_cache = False
    assert capture_defaults(model, args, kwargs) == {}


class _MakesTensors(nn.Module):
    """A tensor made in forward and a plain tensor attribute (both lifted by export as constants), a non-persistent
    buffer, and a branch on `self.training` (so capture keeps a second graph for eval mode, with its own copy)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.offset = torch.tensor([0.5, -1.0, 2.0, 0.0])
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x):
        y = self.lin(x) * self.scale + self.offset + self.shift + torch.tensor(3.0)
        return y * 0.5 if self.training else y


def test_tensors_lifted_out_of_forward_are_no_state_dict_keys(tmp_path):
    torch.manual_seed(0)
    model, x = _MakesTensors(), torch.randn(3, 4)
    result = fxmem.transform(model, (x,), policy="low")
    loaded = fxmem.load(result.save(tmp_path / "r"))
    assert sorted(model.state_dict()) == ["lin.bias", "lin.weight", "shift"]
    for module in (result.module, loaded):
        _assert_state_dict_is_the_models(module, model)
        for training in (True, False):
            model.train(training), module.train(training)
            torch.testing.assert_close(module(x), model(x))


class _TakesACount(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, repeats: int):
        return self.lin(x).repeat(repeats, 1)


def test_a_python_value_other_than_the_captured_one_is_refused_not_ignored(tmp_path):
    """export holds a python input as a constant: a call with another value would silently compute with the captured
    one, so the guard refuses it, naming the input; the saved result keeps the check."""
    model, x = _TakesACount(), torch.randn(3, 4)
    result = fxmem.transform(model, (x, 2), policy="low")
    loaded = fxmem.load(result.save(tmp_path / "r"))
    for module in (result.module, loaded):
        torch.testing.assert_close(module(x, 2), model(x, 2))
        with pytest.raises(InputShapeError, match=r"input args\[1\]: .* value 2 .* got 3"):
            module(x, 3)
