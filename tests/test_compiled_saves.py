"""`fxmem.costmodel.compiled_saves`: what a torch.compile'd (inductor) training step saves, read off the compiler's
own partition before code generation, equals what the real compiled step saves (`saved_bytes`, hooks), on a
convolution network (inductor's channels-last weight copies), at a memory budget, and on a result of the checkpoint
pass (its recompute tags honoured); nothing runs, and what dynamo cannot capture in one graph is a CaptureError."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import nn

from fxmem.costmodel.compiled import CompiledSaves, compiled_saves
from fxmem.errors import CaptureError
from fxmem.measure import saved_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import examples.gpt as gpt  # noqa: E402
from benchmarks.checkpoint_pareto import own_code  # noqa: E402
from tests.test_remat_compiled import _remat_only  # noqa: E402


def _compiled_saved_bytes(module, args, budget=None) -> int:
    """saved_bytes of `module` really compiled by inductor (a code object of its own, cold, at `budget`)."""
    options = {} if budget is None else {"activation_memory_budget": budget}
    with functorch_config.patch(enable_autograd_cache=False, **options), \
            inductor_config.patch(fx_graph_cache=False):
        compiled = torch.compile(own_code(copy.deepcopy(module)))
        compiled(*args).sum().backward()
        return saved_bytes(compiled, args)


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.GELU())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def test_a_convolution_network_at_a_budget_saves_what_its_compiled_step_saves():
    torch.manual_seed(0)
    model, x = _ConvNet().train(), (torch.randn(4, 3, 16, 16),)
    predicted = compiled_saves(model, x, activation_memory_budget=0.3)
    assert isinstance(predicted, CompiledSaves)
    assert predicted.layout_copies == (16 * 3 + 16 * 16) * 9 * 4  # the convolution weights, channels-last copies
    assert predicted.total == _compiled_saved_bytes(model, x, budget=0.3)
    assert compiled_saves(model, x, activation_memory_budget=1.0).activations > predicted.activations


def test_a_checkpoint_pass_result_saves_what_its_compiled_step_saves():
    torch.manual_seed(0)
    model = gpt.build_model(n_layer=2, d_model=32, n_head=2, block_size=32)
    x = gpt.example_inputs(batch=2, seq_len=32)
    result = _remat_only(gpt, model, x, 0.3)
    module = result.program.module.train()
    predicted = compiled_saves(module, x)
    assert predicted.layout_copies == 0
    assert predicted.total == _compiled_saved_bytes(module, x)
    assert predicted.total < compiled_saves(model, x).total  # the pass's recompute tags honoured


def test_nothing_runs():
    torch.manual_seed(0)
    model, x = _ConvNet().train(), (torch.randn(4, 3, 16, 16),)
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    compiled_saves(model, x)
    assert all(torch.equal(state[name], value) for name, value in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


class _OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)


class _Breaks(_OneLinear):
    def forward(self, x):
        y = self.linear(x)
        if y.sum().item() > 0:  # data-dependent control flow: dynamo breaks the graph here
            return y.relu()
        return y


def test_a_graph_break_is_a_capture_error_naming_the_module():
    with pytest.raises(CaptureError, match="compiled_saves: torch.compile cannot capture _Breaks in one graph"):
        compiled_saves(_Breaks(), (torch.randn(2, 4),))


def test_a_forward_without_a_training_graph_is_a_capture_error():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(CaptureError, match="no training graph"):
        compiled_saves(model, (torch.randn(2, 4),))


class _Selects(_OneLinear):
    def forward(self, x):
        y = self.linear(x)
        return y[y > 0].exp().sum()  # the selection's size depends on the data


def test_a_saved_value_of_data_dependent_size_is_a_capture_error():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), \
            pytest.raises(CaptureError, match="whose size depends on the data"):
        compiled_saves(_Selects(), (torch.randn(8, 4),))
