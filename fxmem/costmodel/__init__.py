"""The memory cost model: how much memory each part of the graph costs, and when.

Two methods, same result type (`MemoryEstimate`), both on fake tensors (no real memory):
- `static` (static.py): the forward trace (trace.py: every dispatch-level op's storages and what autograd saves;
  grad_leaves.py: the parameters the loss's backward reaches, which alone get gradients and optimizer state) and a
  liveness walk of forward, backward and the optimizer step (liveness.py, static.py); what a backward formula
  holds above the gradients it makes is measured once per call signature (formula.py).
- `traced` (traced.py): the real training step under the storage tracker `fxmem.measure` uses.

Regions that passes insert (checkpoint, offload) declare themselves through `fxmem.nn.regions.RegionInfo`; the
static walk models them. Before any region exists the checkpoint pass plans with regions.py (what recomputing each
candidate frees and costs, a plan's peak) and recompute.py; costs.py prices recomputation and nodes; batch.py
searches for what fits a budget; compiled.py reads what a torch.compile'd step saves off the compiler's own
partition. `estimate` takes a Program: `fxmem.estimate(model, args)` captures first.
"""
from .batch import plan_batch, smallest_fitting_prefix
from .compiled import CompiledSaves, compiled_saves
from .costs import (CPU_BALANCE, DRAW_COST_PER_ELEMENT_CPU, SLOW_KERNELS_CPU, NodeCost, default_balance, node_costs,
                    op_cost, step_cost)
from .estimator import check_estimate_options, estimate, estimate_from_trace, program_key
from .formula import UNMEASURED_FORMULA, TensorMeta, call_signature, formula_temps
from .liveness import off_loss_path
from .memory import MemoryEstimate, optimizer_state_bytes, optimizer_step_workspace
from .recompute import RecomputeWalk
from .regions import CandidateRegion, RegionModel, build_region_model, measure_regions, value_key
from .recipe_layout import RecipeLayout, as_recipes
from .trace import ForwardTrace, OpRecord, trace_forward
from .trace_index import TraceIndex

__all__ = ["CPU_BALANCE", "DRAW_COST_PER_ELEMENT_CPU", "SLOW_KERNELS_CPU", "CandidateRegion", "CompiledSaves", "ForwardTrace",
           "MemoryEstimate", "NodeCost", "OpRecord", "RecipeLayout", "RecomputeWalk", "RegionModel", "TensorMeta", "TraceIndex",
           "UNMEASURED_FORMULA",
           "as_recipes", "build_region_model", "call_signature", "compiled_saves", "check_estimate_options", "default_balance",
           "estimate", "estimate_from_trace", "formula_temps", "measure_regions", "node_costs", "off_loss_path",
           "op_cost", "optimizer_state_bytes", "optimizer_step_workspace", "plan_batch", "program_key",
           "smallest_fitting_prefix", "step_cost", "trace_forward", "value_key"]
