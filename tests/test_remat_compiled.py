"""A result of the checkpoint pass stacked with torch.compile keeps what the eager result keeps: remat sites that read
each other's values (a max pooling reading a batch norm -> ReLU chain, a concatenation of skip chains) recompute
through each other, as their eager recipes nest, instead of the partitioner saving every site's boundary."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

import fxmem
from fxmem.costmodel import estimate
from fxmem.measure import saved_bytes
from fxmem.nn.bitmask import packed_size
from fxmem.nn.compiled_recompute import REMAT_REGION_ID, remat_region_contexts
from fxmem.nn.dropout import bool_mask_dropout, bool_mask_dropout_remat
from fxmem.node_value import node_value
from fxmem.pipeline import PassContext, long_lived_frozen, pass_module
from tests.conftest import needs_shared_remat_region

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import examples.gpt as gpt  # noqa: E402
import examples.unet as unet  # noqa: E402


def _remat_only(example, model, x, frac: float):
    """`model` through the checkpoint pass at budget fraction `frac` (peak - (1 - frac) * activations), regions (if
    any) run as torch's checkpoint (`region_recipes: false`: remat's sites win where regions are priced so)."""
    program = fxmem.capture(model, x)
    program.refresh()
    base = estimate(program, mode="train", loss_fn=example.loss_fn)
    checkpoint = pass_module("checkpoint")
    ctx = PassContext(policy=None, options=checkpoint.CheckpointOptions(region_recipes=False), mode="train",
                      optimizer="adamw",
                      budget=int(base.peak - (1 - frac) * base.activations), baseline=base, enabled=("checkpoint",),
                      loss_fn=example.loss_fn, budget_strict=False)
    with long_lived_frozen():
        return checkpoint.CheckpointPass().run(program.snapshot(), ctx)


def _remat_only_unet():
    """The U-Net example through the checkpoint pass at a budget remat meets alone (no region)."""
    model, x = unet.build_model(), unet.example_inputs()
    return model, _remat_only(unet, model, x, 0.5), x


def _train_step(module, x):
    torch.manual_seed(3)
    out = module(*x)
    unet.loss_fn(out, x).backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in module.named_parameters()}
    return out.detach(), grads


@needs_shared_remat_region
def test_compiled_remat_sites_keep_what_the_eager_result_keeps():
    model, result, x = _remat_only_unet()
    code = result.program.module.code
    assert "plan" not in result.metrics and "_fxmem_nest" in code and "max_pool2d" in code  # nested sites
    eager = copy.deepcopy(result.program.module).train()
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(result.program.module), backend="aot_eager", fullgraph=True).train()
    out_eager, grads_eager = _train_step(eager, x)
    out_compiled, grads_compiled = _train_step(compiled, x)
    torch.testing.assert_close(out_compiled, out_eager, rtol=1e-5, atol=1e-6)
    for name, grad in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    kept_eager, kept_compiled = saved_bytes(eager, x), saved_bytes(compiled, x)
    # the same activations; compiled recomputes the batch norms' per-channel statistics (a few hundred bytes)
    # where eager keeps them. Before the shared region id the compiled module kept each nested site's input too
    assert kept_eager - 4096 <= kept_compiled <= kept_eager, (kept_compiled, kept_eager)


def test_the_remat_regions_graph_id_is_pinned():
    """torch's checkpoint operator numbers each region after the context is made; the remat context keeps its id."""
    forward_context, _ = remat_region_contexts()
    forward_context.ac_graph_id = 7
    assert forward_context.ac_graph_id == REMAT_REGION_ID



def test_compiled_remat_dropout_keeps_its_mask_not_its_output():
    """A decoder with attention dropout, its dropout outputs remat'd: eager recomputes the dropped-out attention
    probabilities (which `@ v` saves) from the probabilities and the packed mask. Under torch.compile the mask is
    drawn by the compiler and the product runs in a remat checkpoint, so the partitioner recomputes it too; before,
    it kept every dropout output (the compiled module kept more than the eager one). A linear under its GELU is a
    site of that plan too (held nested by the GELU's recipe): the compiled module recomputes it as well."""
    torch.manual_seed(0)
    model = gpt.build_model(n_layer=2, d_model=32, n_head=2, block_size=32, dropout=0.1)
    x = gpt.example_inputs(batch=2, seq_len=32)
    result = _remat_only(gpt, model, x, 0.55)  # (at this size, remat alone with matrix products as sites)
    code = result.program.module.code
    assert "plan" not in result.metrics and "bool_mask_dropout_remat" in code and "remat_call('aten.linear" in code
    eager = copy.deepcopy(result.program.module).train()
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(result.program.module), backend="aot_eager", fullgraph=True).train()
    gpt.loss_fn(compiled(*x), x).backward()  # (the compiler's random numbers: values differ from eager's)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in compiled.parameters())
    # the compiler keeps its masks as bools, a byte per element, where eager keeps them packed, a bit per element
    masks = [node_value(n).numel() for n in result.program.graph.nodes if n.op == "call_function"
             and n.target in (bool_mask_dropout, bool_mask_dropout_remat)]
    assert masks and saved_bytes(compiled, x) <= saved_bytes(eager, x) + sum(n - packed_size(n) for n in masks)
