"""Fake-tensor helpers shared by the program (its metadata) and the cost model (its traces)."""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch._functorch.config as functorch_config
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode


# Fakes carry real values; where an op's fake kernel disagrees with its real one (CUDA efficient attention's dropout
# seed and offset, seen on an H200 with torch 2.11), the real outputs' metadata is taken instead of an error.
_REAL_VALUE_CONFIG = {key: True for key in ("fake_tensor_propagate_real_tensors",
                                            "generate_fake_kernels_from_real_mismatches")
                      if hasattr(functorch_config, key)}


def with_data_dependent_fallback(fn: Callable, on_retry: Callable | None = None):
    """Run `fn` under FakeTensorMode; if a size depends on tensor values (PyG's masks, boolean indexing), run it
    again with fake tensors that carry the example inputs' real values, so those sizes are the example's.
    `on_retry(result)` is called with the second run's result."""
    grad_mode = torch.is_grad_enabled()
    try:
        return fn()
    except GuardOnDataDependentSymNode:
        # a failure inside a higher-order op (wrap_with_set_grad_enabled) can leave grad mode switched
        torch.set_grad_enabled(grad_mode)
        log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
        level = log.level
        log.setLevel(logging.ERROR)  # it logs every value it takes from the real tensors
        try:
            with functorch_config.patch(**_REAL_VALUE_CONFIG):
                out = fn()
        finally:
            log.setLevel(level)
        if on_retry is not None:
            on_retry(out)
        return out


def propagating_real_values() -> bool:
    """Whether fakes now carry real values (inside `with_data_dependent_fallback`'s second run)."""
    return bool(functorch_config.fake_tensor_propagate_real_tensors)
