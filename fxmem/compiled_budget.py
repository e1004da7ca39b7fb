"""The compiler setting a result was planned for, and compiling with it: `fxmem.compile`.

The checkpoint pass can plan a result for torch.compile at a partitioner budget of its choosing
(`passes.checkpoint.compiler_budgets`: it fits the plan at each and keeps the fastest, measured). What the compiled
step then saves, and how fast it runs, depends on compiling it at that budget, which torch reads from a
process-wide setting (`torch._functorch.config.activation_memory_budget`). Here it is carried by the module instead:
`module.meta["fxmem.compile"]` holds it (saved and loaded with the result), and `fxmem.compile(module)` is
`torch.compile` with inductor's partitioner run at that budget for this compile only (`compile_options`: the
`options=` that does it, for a caller that builds its own torch.compile call). A module without it compiles as
torch.compile alone would.
"""
from __future__ import annotations

import functools

import torch

META_KEY = "fxmem.compile"


def planned_budget(module) -> float | None:
    """The partitioner budget `module` (a GraphModule, or a transform result) was planned for; None: the compiler's
    own setting."""
    module = getattr(module, "module", module)
    setting = getattr(module, "meta", {}).get(META_KEY) or {}
    return setting.get("activation_memory_budget")


def set_planned_budget(module: torch.fx.GraphModule, budget: float | None) -> None:
    """Record (None: clear) the partitioner budget `module` was planned for."""
    if budget is None:
        module.meta.pop(META_KEY, None)
    else:
        module.meta[META_KEY] = {"activation_memory_budget": float(budget)}


def compile_options(module, options: dict | None = None) -> dict:
    """`options` (inductor's, for torch.compile) with the partitioner `module` was planned for added; unchanged
    when it has none."""
    return options_at(planned_budget(module), options)


def options_at(budget: float | None, options: dict | None = None) -> dict:
    """`options` (inductor's) with its partitioner run at `budget`; None: the compiler's own setting."""
    merged = dict(options or {})
    if budget is not None:
        merged["custom_partitioner_fn"] = partitioner_at(budget)
    return merged


def compile(module, **kwargs):
    """`torch.compile(module, **kwargs)` at the partitioner budget `module` was planned for (a transform result:
    its module); `options=` are inductor's, passed on."""
    module = getattr(module, "module", module)
    return torch.compile(module, **{**kwargs, "options": compile_options(module, kwargs.get("options"))})


def partitioner_at(budget: float):
    """Inductor's partitioner (min-cut rematerialisation) at `activation_memory_budget` `budget`, as a
    `custom_partitioner_fn`: the budget holds for the compiles that are given it, not the process."""
    return _partitioner_class()(budget)


@functools.cache
def _partitioner_class() -> type:
    """The partitioner's class, made on first use (inductor is imported only by callers that compile)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class BudgetPartitioner(CustomPartitionerFn):
        def __init__(self, budget: float):
            self.budget = budget

        def __call__(self, joint, joint_inputs, **kwargs):
            import torch._functorch.config as functorch_config
            with functorch_config.patch(activation_memory_budget=self.budget):
                return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def uuid(self):
            # (part of inductor's cache keys: one compiled graph per budget)
            return f"fxmem.BudgetPartitioner:{self.budget!r}"

        def __reduce__(self):
            # (inductor pickles its config into cache keys: rebuilt by name, the class being made on first use)
            return partitioner_at, (self.budget,)

        def __repr__(self):
            return f"BudgetPartitioner(activation_memory_budget={self.budget!r})"
    return BudgetPartitioner
