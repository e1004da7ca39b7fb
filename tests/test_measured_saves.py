"""Ops the op table does not know: what their autograd keeps is measured (`fxmem.costmodel.measured_saves`),
including inputs a custom op keeps on its context object outside saved-tensor hooks, as transformers' grouped
matmul fallback keeps its offsets. Those live until the graph is dropped, past the op's backward."""
from __future__ import annotations

import copy

import torch
from torch import nn

import fxmem


@torch.library.custom_op("fxmem_test::rows_times_weight", mutates_args=())
def rows_times_weight(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x @ weight for the rows `rows` names (an integer index tensor the op keeps for its backward)."""
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=x.dtype)
    out[rows] = x[rows] @ weight
    return out


@rows_times_weight.register_fake
def _(x, weight, rows):
    return x.new_empty(x.shape[0], weight.shape[1])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.rows = inputs[2]  # kept on the context, not saved: no saved-tensor hook sees it


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = torch.zeros_like(x)
    grad_x[ctx.rows] = grad[ctx.rows] @ weight.T
    return grad_x, x[ctx.rows].T @ grad[ctx.rows], None


rows_times_weight.register_autograd(_backward, setup_context=_setup_context)


class RowsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.randn(16, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        rows = torch.arange(x.shape[0])  # every row, as int64: 1 KiB at 128 rows
        return self.head(torch.ops.fxmem_test.rows_times_weight(self.proj(x), self.weight, rows))


def test_an_input_kept_on_a_custom_ops_context_lives_until_the_step_ends():
    torch.manual_seed(0)
    model, x = RowsModel(), torch.randn(128, 16)
    measured = fxmem.measure(copy.deepcopy(model), (x,))
    static = fxmem.estimate(model, (x,))
    assert static.unknown_ops == []
    assert (static.peak, static.activations) == (measured.peak, measured.activations)


class _RowsBlock(nn.Module):
    """A block whose custom op keeps an index it made on its context (as the grouped matmul fallback of
    transformers' mixture-of-experts layers keeps its offsets)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        rows = torch.arange(x.shape[0])
        return torch.tanh(torch.ops.fxmem_test.rows_times_weight(torch.relu(self.proj(x)), self.weight, rows)) + x


def test_what_an_op_keeps_on_its_context_inside_a_checkpoint_region_stays():
    """A recompute region frees what its ops save through saved-tensor hooks, not what an op keeps on its autograd
    context: the region's forward keeps that as the op does anywhere. The static estimate and the region planner
    counted it as freed (Qwen2-MoE at a 40% activation budget: 32 B under, its regions' expert offsets; here 1 KiB
    per block)."""
    torch.manual_seed(0)
    model = nn.Sequential(_RowsBlock(), _RowsBlock(), _RowsBlock(), nn.Linear(16, 2))
    x = torch.randn(128, 16)
    result = fxmem.transform(copy.deepcopy(model), (x,),
                             policy={"version": 1, "passes": {"checkpoint": {"activation_budget": "30%"}}})
    record = next(r for r in result.report.passes if r.name == "checkpoint")
    assert "checkpoint_full" in {c.kind for c in record.changes}
    measured = fxmem.measure(copy.deepcopy(result.module), (x,))
    static = fxmem.estimate(result.program, mode="train", method="static")
    assert (static.activations, static.peak) == (measured.activations, measured.peak)
    assert record.metrics["planned_activations"] == measured.activations
