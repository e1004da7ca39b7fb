"""Whether a result computes what the model does, called with the user's own arguments: the starting state, the
eval output, and a seeded training step's output, gradients and buffers, compared within the `low` policy's verify
tolerances. Shared by the tests that hold exact results to it (call signatures, the fuzz harness, the model zoo)."""
from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from fxmem.compare import compare_outputs
from fxmem.pipeline import compare_buffers, compare_grads
from fxmem.step import compute_loss

ATOL, RTOL = 1e-5, 1e-4  # the `low` policy's verify tolerances
CACHE_FIELDS = {"past_key_values", "cache"}


def fields_of(reference, got):
    """The model's output restricted to the fields the result returns: the model, called with the user's own
    arguments, also returns the cache (`past_key_values`, `cache`) that capture turned off inside the graph."""
    if not isinstance(reference, Mapping) or not isinstance(got, Mapping):
        return reference
    dropped = set(reference) - set(got)
    assert dropped <= CACHE_FIELDS, f"the result drops output fields {sorted(dropped)}"
    return {key: reference[key] for key in got}


def train_step(module, args, kwargs, loss_fn, seed: int = 0, fields=None):
    """A seeded training forward + loss + backward: (output, gradients, buffers after)."""
    for p in module.parameters():
        p.grad = None
    module.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = module(*args, **kwargs)
        if fields is not None:
            out = fields_of(out, fields)
        compute_loss(loss_fn, out, args, kwargs).backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    return out, grads, buffers


def difference(model, module, args, kwargs=None, loss_fn=None, seed: int = 0) -> str | None:
    """How `module`, called with the user's own arguments, differs from `model` (both left untouched: copies run),
    or None: the starting state, the eval output, a seeded training step's output, gradients and buffers."""
    kwargs = kwargs or {}
    ref, got = copy.deepcopy(model), copy.deepcopy(module)
    start = compare_buffers(dict(ref.state_dict()), dict(got.state_dict()), 0.0, 0.0)
    if start is not None:
        return "starting state: " + start
    ref.eval(), got.eval()
    with torch.no_grad():
        got_out = got(*args, **kwargs)
        err = compare_outputs(fields_of(ref(*args, **kwargs), got_out), got_out, atol=ATOL, rtol=RTOL)
    if err is not None:
        return "eval output: " + err
    got_out, got_grads, got_buffers = train_step(got, args, kwargs, loss_fn, seed)
    ref_out, ref_grads, ref_buffers = train_step(ref, args, kwargs, loss_fn, seed, fields=got_out)
    err = compare_outputs(ref_out, got_out, atol=ATOL, rtol=RTOL) or \
        compare_grads(ref_grads, got_grads, ATOL, RTOL) or compare_buffers(ref_buffers, got_buffers, ATOL, RTOL)
    return None if err is None else "training step: " + err
