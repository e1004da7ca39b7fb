"""The pass contract: what a pass is, what the manager hands it, what it hands back.

    @register
    class CheckpointPass(Pass):
        name = "checkpoint"
        exact = True                 # outputs, gradients and buffers stay equal (the manager verifies it)
        Options = CheckpointOptions  # a dataclass; the policy validates `passes.checkpoint` against it
        def run(self, program, ctx: PassContext) -> PassResult: ...

`run` rewrites the Program it is given in place (the manager hands it a snapshot) and returns the Changes it made.
It reads the program, the cost model and the context (`ctx.options` is its validated Options instance); never the
policy or another pass's section. It must not mutate existing parameters in place: rollback shares them with the
snapshot. The PassManager (fxmem/pipeline.py) verifies the result and records it. See docs/writing-a-pass.md.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, ClassVar

import torch

from . import registry
from .compare import Deviation
from .costmodel import estimate as estimate_memory
from .lossguard import Evaluator, GuardOptions
from .policy import check_options_class, check_pass_name
from .program import Program

__all__ = ["Pass", "PassContext", "PassResult", "PassRecord", "Change", "DeviceInfo", "BudgetMetrics",
           "GuardMetrics", "register"]


@dataclass
class Change:
    """One rewrite a pass made, for the report: which nodes it replaced with which, where and why."""
    kind: str
    module: str
    nodes_before: list = field(default_factory=list)
    nodes_after: list = field(default_factory=list)
    reason: str = ""
    bytes_saved: int | None = None  # estimated by the cost model
    details: dict = field(default_factory=dict)

    def to_dict(self):
        return {"kind": self.kind, "module": self.module, "nodes_before": list(self.nodes_before),
                "nodes_after": list(self.nodes_after), "reason": self.reason, "bytes_saved": self.bytes_saved,
                "details": _jsonable(self.details)}


@dataclass
class PassResult:
    program: Program
    modified: bool
    changes: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    # lossy passes may report their own per-site errors here; the manager measures the whole-model deviation
    metrics: dict = field(default_factory=dict)
    # the rewritten program draws its random numbers differently from its input (same distribution: SDPA's dropout
    # instead of a manual one): a seeded training step cannot be compared value for value, only run
    draws_differ: bool = False
    # lossy passes: what each explicit setting asked and achieved (`fxmem.intent.Intent`), and the guard's verdicts
    # on what was kept (`fxmem.lossguard.Verdict`); a lossy pass without verdicts is judged by the manager
    intents: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)
    # one line: why the pass changed nothing (the record's reason when it is unchanged); its notes say more
    reason: str = ""


@dataclass(frozen=True)
class BudgetMetrics:
    """The budget facts a budget pass records in its metrics (under these field names), typed: what the report's
    budget lines and strict mode read."""
    activation_budget: int | None = None  # bytes of activations kept at the end of forward the pass planned for
    slack: float | None = None  # the pass's stated tolerance: measured peak <= budget * (1 + slack)
    # the torch.compile partitioner budget (activation_memory_budget) the result was planned for; None: the
    # compiler's own setting (`fxmem.compile` compiles at it)
    compiler_budget: float | None = None

    @classmethod
    def from_metrics(cls, metrics: dict | None) -> BudgetMetrics:
        metrics = metrics or {}
        activation_budget, slack = metrics.get("activation_budget"), metrics.get("slack")
        compiler_budget = metrics.get("compiler_budget")
        return cls(activation_budget=None if activation_budget is None else int(activation_budget),
                   slack=None if slack is None else float(slack),
                   compiler_budget=None if compiler_budget is None else float(compiler_budget))


@dataclass(frozen=True)
class GuardMetrics:
    """The guard's verdicts a lossy pass records in its metrics (`fxmem.lossguard.Verdict.to_dict()`, under these
    keys), typed: what the report's guard lines and the manager's check of the other mode's graph read."""
    kept: tuple = ()  # metrics["guard"]: on what the pass kept
    asked: tuple = ()  # metrics["guard_asked"]: on what the policy asked (the first candidate)
    KEYS: ClassVar[tuple[str, str]] = ("guard", "guard_asked")

    @classmethod
    def from_metrics(cls, metrics: dict | None) -> GuardMetrics:
        metrics = metrics if isinstance(metrics, dict) else {}
        kept, asked = ([v for v in metrics.get(key) or [] if isinstance(v, dict)] for key in cls.KEYS)
        return cls(kept=tuple(kept), asked=tuple(asked))


@dataclass
class PassRecord:
    """What happened to one pass, for the report."""
    name: str
    status: str  # applied | unchanged | rolled_back | failed
    exact: bool
    changes: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    reason: str = ""
    deviation: dict | None = None  # vs the original model (outputs), and per-pass
    grad_deviation: dict | None = None
    # the seeded training-mode step (dropout on, batch statistics, checkpoint/offload regions at work) against the
    # previous pass's: {"compared": bool, "ok": bool, "checked": grads compared, "why": when not compared}
    train_check: dict | None = None
    peak_before: int | None = None
    peak_after: int | None = None
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)
    intents: list = field(default_factory=list)  # `fxmem.intent.Intent.to_dict()` per explicit lossy setting

    def budget_metrics(self) -> BudgetMetrics:
        return BudgetMetrics.from_metrics(self.metrics)

    def guard_metrics(self) -> GuardMetrics:
        return GuardMetrics.from_metrics(self.metrics)

    def to_dict(self, with_timing: bool = True):
        record = {"name": self.name, "status": self.status, "exact": self.exact,
             "changes": [c.to_dict() for c in self.changes], "notes": list(self.notes), "reason": self.reason,
             "intents": _jsonable(self.intents),
             "deviation": self.deviation, "grad_deviation": self.grad_deviation, "train_check": self.train_check,
             "peak_before": self.peak_before,
             "peak_after": self.peak_after, "metrics": _jsonable(self.metrics)}
        if with_timing:
            record["seconds"] = round(self.seconds, 3)
        return record


@dataclass(frozen=True)
class DeviceInfo:
    """The device the program's parameters live on, and what it offers passes."""
    type: str = "cpu"  # torch device type: "cpu", "cuda", ...

    @property
    def pinned_host(self) -> bool:
        """Pinned host memory the device copies to and from asynchronously (a CUDA device's)."""
        return self.type == "cuda"

    @classmethod
    def of(cls, program: Program) -> DeviceInfo:
        param = next(program.module.parameters(), None)
        return cls(param.device.type if param is not None else "cpu")


@dataclass
class PassContext:
    """What the manager hands a pass: its options, validated and ready to use, and what passes share, derived once
    from the policy. A pass reads these, never the policy."""
    options: Any = None
    mode: str = "train"
    optimizer: str = "adamw"
    budget: int | None = None  # resolved bytes (the pass's own budget option or the policy's), None = no budget
    baseline: Any = None  # MemoryEstimate of the captured program before any pass
    budget_strict: bool = True  # False: the budget is a target (presets); unreachable -> as low as possible
    guard: GuardOptions = field(default_factory=GuardOptions)  # the guard of lossy changes' limits (verify.*)
    distribution: str = "none"  # how the result will run: "none", "ddp" or "fsdp" (Policy.distribution)
    rest_taken: bool = False  # a later pass plans against the same peak budget: a budget pass may stop short
    device: DeviceInfo | None = None  # None: the program's (`device_for`)
    calibration: list | None = None
    loss_fn: Callable | None = None
    log: Callable[[str], None] = lambda msg: None
    seed: int = 0
    model_file: Any = None  # the model file module when run from the CLI
    evaluate: Evaluator | None = None  # the user's task metric, for the guard of lossy changes
    # a context built by hand (tests, benchmarks) may give the policy and the names of the passes that run instead:
    # the shared fields above are then derived from them as the manager derives them
    policy: InitVar[Any] = None
    enabled: InitVar[tuple] = ()

    def __post_init__(self, policy, enabled) -> None:
        if policy is not None:
            self.guard, self.distribution = GuardOptions.from_verify(policy.verify), policy.distribution
        self.rest_taken = self.rest_taken or registry.budget_rest_taken(enabled)

    def device_for(self, program: Program) -> DeviceInfo:
        return self.device if self.device is not None else DeviceInfo.of(program)

    def estimate(self, program: Program, method: str = "static"):
        return estimate_memory(program, mode=self.mode, optimizer=self.optimizer, method=method,
                               loss_fn=self.loss_fn)


class Pass:
    """Base of a pass: set `name`, `exact` and `Options`, write `run`, decorate the class with `register`."""
    name: ClassVar[str] = ""
    exact: ClassVar[bool] = True  # outputs, gradients and buffers stay equal (verified); False: lossy (the guard)
    Options: ClassVar[type | None] = None  # a dataclass with a default for every field; None: no options
    extra: ClassVar[bool] = False  # not one of fxmem's canonical passes: runs after them, in name order

    @classmethod
    def is_exact(cls, options: Any) -> bool:
        """Whether the pass is exact with these options (the attention pass is lossy for its approximations)."""
        return cls.exact

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        raise NotImplementedError(f"{type(self).__qualname__}.run")


def register(cls: type) -> type:
    """Class decorator, the one registration of a pass: the manager runs it in `registry.CANONICAL_ORDER` (an extra
    pass after those), the policy validates `passes.<name>` against its `Options`. Reads a `Pass` subclass or any
    class with the same attributes (`test_only = True` is the older spelling of `extra`)."""
    name = getattr(cls, "name", None)
    check_pass_name(name)
    extra = bool(getattr(cls, "extra", False) or getattr(cls, "test_only", False))
    if name not in registry.CANONICAL_ORDER and not extra:
        raise ValueError(f"pass name {name!r} is not one of {registry.CANONICAL_ORDER}; a pass of your own sets "
                         f"extra = True")
    exact = getattr(cls, "exact", True)
    if not isinstance(exact, bool):
        raise TypeError(f"{cls.__qualname__}.exact must be True or False, got {exact!r}")
    if not callable(getattr(cls, "run", None)):
        raise TypeError(f"{cls.__qualname__} has no run(program, ctx) method")
    options = getattr(cls, "Options", None)
    if options is not None:
        check_options_class(name, options)
    hook = getattr(cls, "is_exact", None)
    registry.add(registry.Registration(name, cls, options, extra=extra, exact=exact,
                                       exact_for=hook if callable(hook) else None))
    return cls


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, Deviation):
        return value.to_dict()
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 64 else f"tensor{tuple(value.shape)}"
    return str(value)
