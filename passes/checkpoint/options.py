"""The checkpoint pass's options (`passes.checkpoint` in a policy) and the limits a plan must meet."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fxmem.errors import PolicyError
from fxmem.nn.checkpoint import MATMUL_OPS
from fxmem.units import Budget, format_bytes, parse_budget

NO_PEAK = 1 << 62  # the planning budget of a peak nobody bounds (only activations are)


@dataclass
class CheckpointOptions:
    """Options of `passes.checkpoint` in a policy."""
    budget: Budget | None = None  # '4GiB', '40%' (of the baseline peak); None: the policy's budget
    # activation bytes left saved at the end of forward: '6MiB', or '30%' of the baseline's (what torch.compile's
    # activation_memory_budget bounds); None: no such bound. With a peak budget too, the plan meets both
    activation_budget: Budget | None = None
    # for a result that will run under torch.compile (inductor): the bytes its compiled step may save for backward,
    # '24MiB', or a fraction b (0.3, '30%'): what torch.compile alone saves at activation_memory_budget b for the
    # program the pass is given (after the passes before it). The pass is planned at the largest activation budget
    # whose compiled saves fit (compiled_fit); instead of activation_budget, with the peak budget if one is set
    compiled_activation_budget: Budget | None = None
    # with compiled_activation_budget: the torch.compile partitioner budgets (activation_memory_budget) to fit the
    # plan at, the fastest compiled step of those that fit kept (timed on the example inputs, compiled, on this
    # machine; `fxmem.compile` then compiles the result at the one chosen): a list of fractions in (0, 1], or
    # "auto" (for a fraction b: b, halfway to 1, and 1; for bytes 1, 0.75, 0.5). None: the compiler's own setting,
    # one fit, nothing timed
    compiler_budgets: list[float] | Literal["auto"] | None = None
    solver: Literal["auto", "dp", "milp", "greedy"] = "auto"  # auto: dp for chains, milp otherwise
    selective: bool = True  # allow selective regions (keep matmul outputs, recompute the rest)
    # recompute cost: roofline (max of FLOPs and `balance` x bytes moved: pointwise and normalization ops are
    # memory-bound), op-table FLOPs alone, or ops timed on the example inputs
    cost: Literal["roofline", "flops", "profile"] = "roofline"
    balance: float | None = None  # roofline: FLOPs per byte of memory traffic; None: 10 on CPU, 100 on CUDA
    time_limit: float = 10.0  # seconds for the MILP before the greedy fallback
    slack: float = 0.05  # stated tolerance: measured peak <= budget * (1 + slack)
    keep_ops: list[str] = field(default_factory=lambda: sorted(MATMUL_OPS))  # what selective regions save
    regions: list[str] = field(default_factory=list)  # module paths to use as candidates (default: automatic)
    granularity: Literal["auto", "block", "sub-block"] = "auto"  # auto: plan at both levels, keep the cheaper
    min_region_fraction: float = 0.01  # ignore candidates saving less than this share of the saved bytes
    verify: bool = True  # estimate the planned program with the cost model (one more trace) and re-plan if high
    refine: int = 2  # at most this many re-plans when the cost model's estimate is above the budget
    # CPU dropout saves a float mask; draw the same numbers as bool, kept packed (bit-identical, 1/32 the bytes),
    # which recompute regions then keep rather than draw again (see compact_dropout)
    compact_dropout: bool = True
    # full and redraw regions recompute only what their backward reads, under no_grad, inside the module's recipe
    # scope (fxmem.nn.region_recipe), where their ops allow; false: torch's checkpoint replays each region up to its
    # last save
    region_recipes: bool = True
    # activations that are cheap functions of tensors autograd keeps anyway (GELU, dropout, layer norm outputs
    # feeding a matmul) are recomputed where backward needs them instead of saved (see remat), before regions
    remat: bool = True
    # where those sites alone miss the limits: linears, matrix products and convolutions whose inputs autograd keeps
    # anyway (an MLP's first linear under its activation, a convolution under its batch norm) as sites too: remat
    # alone where that reaches the limits, else with regions planned over it, taken when that plan costs less than
    # the others (not with cost: profile)
    remat_products: bool = True
    # attention softmaxes with their scores as sites too, with those products and (or, remat_products: false)
    # without them: the copies matmul makes of strided q and k written as nodes (the same bytes), so the softmax
    # chain (q @ k^T, scale, mask, softmax) is recomputed from them, the mask the graph builds kept by the recipe,
    # and neither the probabilities nor their dropout's output is kept (see matmul_operands)
    remat_scores: bool = True
    # regions never join nodes of two repeated blocks (fxmem.blocks.block_paths: h.0, h.1, ...) or a block's
    # with the root's: what FSDP2 needs to shard each block apart (fxmem.distribute). None: when the policy declares
    # `passes.offload.distributed: fsdp`
    within_blocks: bool | None = None


def resolve_budget(options: CheckpointOptions, ctx, baseline_peak: int) -> int | None:
    """The peak budget in bytes: the pass's own, else the policy's (`ctx.budget`); None when neither is set."""
    if options.budget is None:
        return ctx.budget
    return resolve_limit(options.budget, "budget", baseline_peak)


def resolve_activation_budget(options: CheckpointOptions, baseline_activations: int) -> int | None:
    """The activation budget in bytes, None when the pass has none."""
    if options.activation_budget is None:
        return None
    return resolve_limit(options.activation_budget, "activation_budget", baseline_activations)


def compiled_budget(options: CheckpointOptions) -> Budget | None:
    """`compiled_activation_budget` as a Budget (a bad value names its key), None when the pass has none; with
    activation_budget too, a PolicyError (two limits on one number)."""
    if options.compiled_activation_budget is None:
        return None
    if options.activation_budget is not None:
        raise PolicyError("passes.checkpoint.compiled_activation_budget and passes.checkpoint.activation_budget: "
                          "set one (the first bounds the compiled step's saves, the second the eager step's)")
    try:
        return parse_budget(options.compiled_activation_budget)
    except ValueError as error:
        raise PolicyError(f"passes.checkpoint.compiled_activation_budget: {error}") from None


def compiler_budgets(options: CheckpointOptions) -> tuple | str | None:
    """`compiler_budgets` checked: None, "auto", or fractions in (0, 1] (a bad value names its key); without
    compiled_activation_budget, a PolicyError (it chooses among fits to that budget)."""
    value, key = options.compiler_budgets, "passes.checkpoint.compiler_budgets"
    if value is None:
        return None
    if options.compiled_activation_budget is None:
        raise PolicyError(f"{key}: needs passes.checkpoint.compiled_activation_budget (it chooses among plans "
                          "that fit it)")
    if value == "auto":
        return value
    if not isinstance(value, (list, tuple)) or not value:
        raise PolicyError(f"{key}: expected \"auto\" or a list of fractions in (0, 1], got {value!r}")
    for fraction in value:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise PolicyError(f"{key}: {fraction!r} is not a fraction in (0, 1] (torch.compile's "
                              "activation_memory_budget)")
    return tuple(float(fraction) for fraction in value)


def resolve_limit(budget, key: str, baseline: int) -> int:
    """`budget` ('6MiB', '30%', a Budget) in bytes, a fraction taken of `baseline`; a bad value names its key."""
    if not isinstance(budget, Budget):
        try:
            budget = parse_budget(budget)
        except ValueError as error:
            raise PolicyError(f"passes.checkpoint.{key}: {error}") from None
    return int(budget.resolve(baseline))


@dataclass(frozen=True)
class Limits:
    """What the plan must meet: the estimated peak <= `peak` and the activations saved at the end of forward <=
    `activations` (either may be None: unbounded)."""
    peak: int | None
    activations: int | None

    def over(self, peak: int, activations: int) -> int:
        """By how many bytes an estimate misses (0 when it meets both)."""
        return max(0, peak - self.peak if self.peak is not None else 0,
                   activations - self.activations if self.activations is not None else 0)

    def fits(self, est) -> bool:
        return self.over(est.peak, est.activations) == 0

    def miss_metrics(self, metrics: dict) -> int:
        """By how many bytes a pass result's estimate misses (an unchecked one, verify=False, counts as fitting)."""
        return self.over(metrics.get("estimated_peak") or 0, metrics.get("estimated_activations") or 0)

    def fits_note(self, est) -> str:
        return (f"checkpoint: the estimate (peak {format_bytes(est.peak)}, activations "
                f"{format_bytes(est.activations)}) already fits {self.describe()}; nothing recomputed")

    def describe(self) -> str:
        parts = ([f"the budget {format_bytes(self.peak)}"] if self.peak is not None else []) + \
            ([f"the activation budget {format_bytes(self.activations)}"] if self.activations is not None else [])
        return " and ".join(parts)
