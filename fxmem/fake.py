"""Fake-tensor helpers shared by the program (its metadata) and the cost model (its traces)."""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes


# Fakes carry real values; where an op's fake kernel disagrees with its real one (CUDA efficient attention's dropout
# seed and offset, seen on an H200 with torch 2.11), the real outputs' metadata is taken instead of an error.
_REAL_VALUE_CONFIG = {key: True for key in ("fake_tensor_propagate_real_tensors",
                                            "generate_fake_kernels_from_real_mismatches")
                      if hasattr(functorch_config, key)}


def with_data_dependent_fallback(run: Callable, on_retry: Callable | None = None):
    """Run `run` under FakeTensorMode; if a size depends on tensor values (PyG's masks, boolean indexing, an op
    whose output sizes do: `run_on_real_values`), run it again with fake tensors that carry the example inputs' real
    values, so those sizes are the example's.
    `on_retry(result)` is called with the second run's result."""
    grad_mode = torch.is_grad_enabled()
    try:
        return run()
    except (GuardOnDataDependentSymNode, DynamicOutputShapeException):
        # a failure inside a higher-order op (wrap_with_set_grad_enabled) can leave grad mode switched
        torch.set_grad_enabled(grad_mode)
        log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
        level = log.level
        log.setLevel(logging.ERROR)  # it logs every value it takes from the real tensors
        try:
            with functorch_config.patch(**_REAL_VALUE_CONFIG):
                out = run()
        finally:
            log.setLevel(level)
        if on_retry is not None:
            on_retry(out)
        return out


def run_on_real_values(func, args, kwargs):
    """`func`'s outputs as fakes, from a run on the real values the fakes carry (the data-dependent fallback): for an
    op whose output sizes depend on values and whose fake kernel says so (`DynamicOutputShapeException`: CTC loss,
    whose alpha table is as long as the longest target). Outside the fallback the exception stands, and
    `with_data_dependent_fallback` runs again with real values."""
    leaves = pytree.tree_leaves((args, kwargs))
    fakes = [leaf for leaf in leaves if isinstance(leaf, FakeTensor)]
    if not propagating_real_values() or not fakes or any(fake.real_tensor is None for fake in fakes):
        raise DynamicOutputShapeException(func)
    mode = fakes[0].fake_mode
    real_args, real_kwargs = pytree.tree_map_only(FakeTensor, lambda fake: fake.real_tensor, (args, kwargs))
    with _disable_current_modes(), torch.no_grad():
        out = func(*real_args, **real_kwargs)
    return pytree.tree_map_only(torch.Tensor, lambda real: mode.from_tensor(real, static_shapes=True), out)


def propagating_real_values() -> bool:
    """Whether fakes now carry real values (inside `with_data_dependent_fallback`'s second run)."""
    return bool(functorch_config.fake_tensor_propagate_real_tensors)


def module_tensors(module: nn.Module) -> list:
    """Parameters, buffers and plain tensor attributes (graph constants) of every module under `module`."""
    out = list(module.parameters()) + list(module.buffers())
    for sub in module.modules():
        out.extend(v for v in vars(sub).values() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter))
    return out


def sizing_device(tensors) -> torch.device:
    """The device a model built on the meta device is sized for: that of its first input not on meta, else the
    CPU."""
    return first_sized_device(tensor.device for tensor in tensors if isinstance(tensor, torch.Tensor))


def first_sized_device(devices) -> torch.device:
    """The first of `devices` (torch.device or its name) that is not meta, else the CPU: where the fresh tensors of
    a model built on the meta device (`fxmem.meta_models`) are made, beside inputs on the device it is sized for."""
    for device in devices:
        device = torch.device(device)
        if device.type != "meta":
            return device
    return torch.device("cpu")


def meta_as_device(fake_mode, tensors, device: torch.device) -> list:
    """Meta tensors among `tensors` (a model built on the meta device, to be sized) become `fake_mode`'s fakes on
    `device`: the step then runs that device's kernels (their layouts, SDPA's backend), as a real model there would,
    not the meta device's. Returns the fakes: the mode's memo holds them weakly, so the caller keeps them alive."""
    converter = fake_mode.fake_tensor_converter
    return [converter.from_meta_and_device(fake_mode, tensor, device) for tensor in tensors
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, FakeTensor) and tensor.device.type == "meta"]


def meta_module_as_device(fake_mode, module, device: torch.device) -> None:
    """Parameters, buffers and tensor attributes of `module` (a fake copy, `FakeCopyMode`) still on the meta device
    become fakes on `device`; one replacement per tensor, so tied weights stay tied."""
    made: dict[int, torch.Tensor] = {}

    def on_device(tensor):
        if id(tensor) not in made:
            with fake_mode:
                fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
            made[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
        return made[id(tensor)]
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers, vars(sub)):
            for name, tensor in list(store.items()):
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                    store[name] = on_device(tensor)


def static_sizes_if_needed(run: Callable[[bool], object]):
    """`run(False)`: the inputs' sizes symbolic (their example values as hints); where a kernel cannot take
    symbolic sizes (CPU's LSTM: "Cannot call numel() on tensor with symbolic sizes"), `run(True)`: the inputs at
    the example's sizes."""
    try:
        return run(False)
    except RuntimeError as error:
        if "symbolic sizes" not in str(error):
            raise
    return run(True)
