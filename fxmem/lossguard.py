"""The guard of lossy changes: each kind of change is judged end to end, on the model's outputs, in users' terms.

    guard = guard_for(ctx, program, "4bit", section="passes.precision", tolerance=opts.tolerance)
    verdict = guard.judge(candidate)          # candidate: the transformed Program
    outcome = first_accepted(guard, build, exclusion_steps(sites_by_error))

What decides: the drop of the user's `evaluate` metric when given; otherwise the relative output error, plus the
top-1 agreement for class-score outputs or, with a `loss_fn`, the loss's increase. Limits left unset take the
kind's defaults (`KIND_LIMITS`). Per-site measurements only order the back-off (`exclusion_steps`, largest first).
Gating is exact when inserted and is verified as an exact pass: no guard here.
Design: docs/design/lossguard.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .calibrate import normalize_item
from .compare import deviation
from .errors import FxmemError
from .program import Program, buffers_kept
from .step import compute_loss


@dataclass(frozen=True)
class Limits:
    """What one kind of change may cost: relative output error at most `rel_error`, top-1 agreement at least
    `top1_agreement` (class scores), relative loss increase at most `loss_increase` (other outputs, with a loss_fn),
    task-metric drop at most `metric_drop` (with evaluate)."""
    rel_error: float
    top1_agreement: float
    loss_increase: float
    metric_drop: float = 0.01


# defaults per kind of change (README "Policies"; each preset's header)
# (compute and int8 move outputs little: their predictions flip only at near-ties, which untrained models and
# uncertain predictions are full of, so their top-1 limit is no stricter than 4-bit weights')
KIND_LIMITS: dict[str, Limits] = {
    "compute": Limits(rel_error=0.05, top1_agreement=0.95, loss_increase=0.01),  # bf16 / fp16 compute
    "int8": Limits(rel_error=0.1, top1_agreement=0.95, loss_increase=0.02),  # int8 weights
    "4bit": Limits(rel_error=0.3, top1_agreement=0.95, loss_increase=0.05),  # nf4 / fp4 weights
    "pruning": Limits(rel_error=0.3, top1_agreement=0.97, loss_increase=0.05),  # removed hidden units
    "attention": Limits(rel_error=0.2, top1_agreement=0.95, loss_increase=0.05),  # hab / semiseparable
    "lossy": Limits(rel_error=0.05, top1_agreement=0.98, loss_increase=0.02),  # any other lossy pass
}
KIND_WORDS = {"compute": "low-precision compute", "int8": "int8 weights", "4bit": "4-bit weights",
              "pruning": "pruning", "attention": "approximate attention", "lossy": "a lossy pass"}
EVALUATE_MODES = ("max", "min")


@dataclass(frozen=True)
class Evaluator:
    """The user's task metric: `fn(module) -> number`; `mode` "max" when higher is better, "min" when lower is."""
    fn: Callable[[nn.Module], Any]
    mode: Literal["max", "min"] = "max"

    def __post_init__(self):
        if self.mode not in EVALUATE_MODES:
            raise FxmemError(f"evaluate_mode: expected 'max' (higher is better) or 'min' (lower is better), got "
                             f"{self.mode!r}")

    def drop(self, before: float, after: float) -> float:
        """How much worse `after` is than `before` (negative: better)."""
        return before - after if self.mode == "max" else after - before


def make_evaluator(evaluate, evaluate_mode=None, model_file=None) -> Evaluator | None:
    """The task metric from `fxmem.transform(evaluate=, evaluate_mode=)`, else from a model file (`evaluate(module)`
    and its optional `evaluate_mode`); higher is better unless a mode says "min". An Evaluator is taken as it is."""
    if isinstance(evaluate, Evaluator) and evaluate_mode is None:
        return evaluate
    metric = evaluate if evaluate is not None else getattr(model_file, "evaluate", None)
    if metric is None:
        if evaluate_mode is not None:
            raise FxmemError("evaluate_mode: given without evaluate (pass evaluate=fn, a function module -> number)")
        return None
    if not callable(metric):
        raise FxmemError(f"evaluate: expected a function module -> number, got {type(metric).__name__}")
    mode = evaluate_mode if evaluate_mode is not None else getattr(model_file, "evaluate_mode", None)
    return Evaluator(metric, mode if mode is not None else "max")


# ============================================================================================ verdicts

@dataclass
class Verdict:
    """One candidate judged: what was measured, which limits applied, and whether it is accepted."""
    kind: str
    accepted: bool
    judged: bool = True
    measures: dict = field(default_factory=dict)
    limits: dict = field(default_factory=dict)  # the limits that decided, by measure
    failed: list = field(default_factory=list)  # one phrase per limit that was missed
    hints: list = field(default_factory=list)  # which setting to change, one phrase per missed limit
    data: str = ""

    def reason(self) -> str:
        return "; ".join(self.failed)

    def hint(self) -> str:
        return " or ".join(dict.fromkeys(self.hints))

    def summary(self) -> str:
        """One line: the deciding figures against their limits, and on which data."""
        if not self.judged:
            return "not judged (the pass's guard is off)"
        parts = [_phrase(name, self.measures[name], self.limits[name]) for name in self.limits
                 if name in self.measures]
        return ", ".join(parts) + (f" on {self.data}" if self.data else "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "accepted": self.accepted, "judged": self.judged, "measures": dict(self.measures),
                "limits": dict(self.limits), "failed": list(self.failed), "hints": list(self.hints),
                "data": self.data, "summary": self.summary()}


def unjudged(kind: str) -> Verdict:
    """The verdict of a pass whose guard the policy turned off (`guard: false`): applied as asked."""
    return Verdict(kind, accepted=True, judged=False)


def _phrase(name: str, value: float, limit: float) -> str:
    if name == "top1_agreement":
        return f"top-1 agreement {value:.1%} {'>=' if value >= limit else '<'} {limit:.1%}"
    if name == "metric_drop":
        return f"evaluate() drop {value:.4g} {'<=' if value <= limit else '>'} {limit:g}"
    label = {"rel_error": "relative output error", "loss_increase": "loss increase"}[name]
    return f"{label} {value:.3g} {'<=' if value <= limit else '>'} {limit:g}"


# ============================================================================================ the guard

@dataclass
class LossGuard:
    """Judges candidates of one kind of change against `reference` (the program before the change)."""
    reference: Program
    kind: str
    limits: Limits
    items: list  # (args, kwargs) pairs
    data: str
    settings: dict  # measure -> the policy setting that sets its limit
    loss_fn: Any = None
    evaluator: Evaluator | None = None
    outputs: Literal["auto", "scores", "values"] = "auto"
    seed: int = 0
    _ref: dict | None = None

    def judge(self, candidate: Program) -> Verdict:
        """Run `candidate` on the guard data and judge it against the reference."""
        ref = self._reference()
        got = self._observe(candidate, with_metric=self.evaluator is not None)
        measures = _measures(ref, got, self.evaluator)
        return self._decide(measures, ref["scores"])

    def judge_outputs(self, ref_outputs: list, got_outputs: list) -> Verdict:
        """Judge outputs computed elsewhere (another graph of the program) by the output measures only."""
        ref = {"outputs": ref_outputs, "scores": self._is_scores(ref_outputs[0]) if ref_outputs else False}
        measures = _measures(ref, {"outputs": got_outputs}, None)
        return self._decide(measures, ref["scores"], outputs_only=True)

    def _reference(self) -> dict:
        if self._ref is None:
            self._ref = self._observe(self.reference, with_metric=self.evaluator is not None)
            self._ref["scores"] = self._is_scores(self._ref["outputs"][0]) if self._ref["outputs"] else False
        return self._ref

    def _is_scores(self, output) -> bool:
        if self.outputs != "auto":
            return self.outputs == "scores"
        return class_scores(output) is not None

    def _observe(self, program: Program, with_metric: bool) -> dict:
        outs, losses = run_items(program.module, self.items, self.loss_fn, self.seed)
        obs = {"outputs": outs, "losses": losses}
        if with_metric:
            obs["metric"] = run_metric(program.module, self.evaluator)
        return obs

    def _decide(self, measures: dict, scores: bool, outputs_only: bool = False) -> Verdict:
        deciding = self._deciding(measures, scores, outputs_only)
        verdict = Verdict(self.kind, accepted=True, measures=measures, data=self.data,
                          limits={name: getattr(self.limits, name) for name in deciding})
        for name in deciding:
            value, limit = measures[name], getattr(self.limits, name)
            ok = value >= limit if name == "top1_agreement" else value <= limit
            if not ok:  # (a NaN measure is never ok)
                verdict.accepted = False
                verdict.failed.append(_phrase(name, value, limit))
                verdict.hints.append(self._hint(name, limit))
        if not verdict.accepted and self.evaluator is None and not outputs_only:
            verdict.hints.append("give evaluate (the task metric then decides)")
        return verdict

    def _deciding(self, measures: dict, scores: bool, outputs_only: bool) -> list[str]:
        if "metric_drop" in measures and not outputs_only:
            return ["metric_drop"]
        names = ["rel_error"]
        if scores and "top1_agreement" in measures:
            names.append("top1_agreement")
        elif not scores and "loss_increase" in measures and not outputs_only:
            names.append("loss_increase")
        return names

    def _hint(self, name: str, limit: float) -> str:
        verb = "lower" if name == "top1_agreement" else "raise"
        shown = f"{limit:.1%}" if name == "top1_agreement" else f"{limit:g}"
        return f"{verb} {self.settings[name]} (now {shown})"


def _measures(ref: dict, got: dict, evaluator: Evaluator | None) -> dict:
    out: dict = {"rel_error": deviation(ref["outputs"], got["outputs"]).rel}
    agreement = top1_agreement(ref["outputs"], got["outputs"])
    if agreement is not None:
        out["top1_agreement"] = agreement
    if ref.get("losses") and got.get("losses"):
        before, after = sum(ref["losses"]) / len(ref["losses"]), sum(got["losses"]) / len(got["losses"])
        out.update(loss_before=before, loss_after=after, loss_increase=(after - before) / max(abs(before), 1e-12))
    if evaluator is not None and "metric" in got:
        out.update(metric_before=ref["metric"], metric_after=got["metric"],
                   metric_drop=evaluator.drop(ref["metric"], got["metric"]))
    return out


# ============================================================================================ measuring

def class_scores(output) -> torch.Tensor | None:
    """The class scores in a model's output, or None: the `logits` entry of a mapping (Hugging Face outputs), else
    a lone floating-point output of shape (batch, classes) or (batch, positions, classes) with at least 2 classes."""
    if hasattr(output, "keys") and "logits" in output.keys():
        logits = output["logits"]
        return logits if isinstance(logits, torch.Tensor) and logits.is_floating_point() else None
    if isinstance(output, torch.Tensor) and output.is_floating_point() and output.dim() in (2, 3) \
            and output.shape[-1] >= 2:
        return output
    return None


def top1_agreement(ref_outputs: list, got_outputs: list) -> float | None:
    """Share of positions whose top-1 class is unchanged, over all items; None when outputs are not class scores."""
    same = total = 0
    for ref, got in zip(ref_outputs, got_outputs):
        ref_scores, got_scores = class_scores(ref), class_scores(got)
        if ref_scores is None or got_scores is None or ref_scores.shape != got_scores.shape:
            return None
        same += int((ref_scores.argmax(-1) == got_scores.argmax(-1)).sum())
        total += ref_scores.argmax(-1).numel()
    return same / total if total else None


def run_items(module: nn.Module, items: list, loss_fn, seed: int) -> tuple[list, list]:
    """Outputs (and losses, with a loss_fn) of `module` on each item, in eval mode without gradients; the mode,
    buffers and RNG state are left as they were."""
    outs, losses = [], []
    was = module.training
    module.eval()
    try:
        with torch.no_grad(), buffers_kept(module), torch.random.fork_rng(devices=[]):
            for args, kwargs in items:
                torch.manual_seed(seed)
                out = module(*args, **kwargs)
                outs.append(pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out))
                if loss_fn is not None:
                    losses.append(float(compute_loss(loss_fn, out, args, kwargs)))
    finally:
        module.train(was)
    return outs, losses


def run_metric(module: nn.Module, evaluator: Evaluator) -> float:
    """`evaluator.fn(module)` as a float; the mode, buffers and RNG state are left as they were."""
    was = module.training
    try:
        with buffers_kept(module), torch.random.fork_rng(devices=[]):
            value = evaluator.fn(module)
    finally:
        module.train(was)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise FxmemError(f"evaluate(module) must return a number, got {type(value).__name__}") from None


# ============================================================================================ building guards

@dataclass(frozen=True)
class GuardOptions:
    """The guard's settings from the policy's `verify` section, resolved once by the manager (`from_verify`) and
    handed to passes as `PassContext.guard`. A limit left None takes the default of each kind of change."""
    lossy_tolerance: float | None = None
    top1_agreement: float | None = None
    loss_increase: float | None = None
    metric_tolerance: float | None = None
    outputs: Literal["auto", "scores", "values"] = "auto"
    items: int = 8  # the last `items` calibration items are the guard data

    @classmethod
    def from_verify(cls, verify) -> GuardOptions:
        """From a policy's `VerifyOptions` (validated there)."""
        return cls(lossy_tolerance=verify.lossy_tolerance, top1_agreement=verify.top1_agreement,
                   loss_increase=verify.loss_increase, metric_tolerance=verify.metric_tolerance,
                   outputs=verify.outputs, items=verify.guard_items)


def limits_for(kind: str, options: GuardOptions, tolerance: float | None = None,
               metric_tolerance: float | None = None) -> Limits:
    """The kind's defaults, with the policy's settings on top: `verify.*` for every kind, the pass's own
    `tolerance` / `metric_tolerance` for its kinds."""
    base = KIND_LIMITS[kind]
    return Limits(rel_error=_first_set(tolerance, options.lossy_tolerance, base.rel_error),
                  top1_agreement=_first_set(options.top1_agreement, base.top1_agreement),
                  loss_increase=_first_set(options.loss_increase, base.loss_increase),
                  metric_drop=_first_set(metric_tolerance, options.metric_tolerance, base.metric_drop))


def _first_set(*values) -> float:
    return float(next(value for value in values if value is not None))


def guard_items(ctx, program: Program) -> tuple[list, str]:
    """The guard data: the last `ctx.guard.items` calibration items, or the example inputs; and how the report
    names it."""
    cal = list(ctx.calibration or [])
    if cal:
        items = [normalize_item(it) for it in cal[-ctx.guard.items:]]
        return items, f"{len(items)} calibration item(s)"
    return [(tuple(program.example_args), dict(program.example_kwargs))], "the example inputs"


def guard_for(ctx, program: Program, kind: str, *, section: str | None = None, tolerance: float | None = None,
              metric_tolerance: float | None = None, items: list | None = None, data: str | None = None) -> LossGuard:
    """The guard of one kind of change made to `program`, from the pass context (`fxmem.pass_api.PassContext`: its
    guard options, calibration, loss_fn, evaluate, seed). `section` is the pass's policy section ("passes.pruning"),
    whose `tolerance` / `metric_tolerance` the pass gives here and hints name; `items` overrides the guard data
    (normalized (args, kwargs) pairs)."""
    options: GuardOptions = ctx.guard
    if items is None:
        items, data = guard_items(ctx, program)
    own = section is not None and (tolerance is not None or options.lossy_tolerance is None)
    settings = {"rel_error": f"{section}.tolerance" if own else "verify.lossy_tolerance",
                "top1_agreement": "verify.top1_agreement", "loss_increase": "verify.loss_increase",
                "metric_drop": f"{section}.metric_tolerance" if metric_tolerance is not None
                else "verify.metric_tolerance"}
    return LossGuard(reference=program, kind=kind, limits=limits_for(kind, options, tolerance, metric_tolerance),
                     items=items, data=data or f"{len(items)} item(s)", settings=settings, loss_fn=ctx.loss_fn,
                     evaluator=ctx.evaluate, outputs=options.outputs, seed=ctx.seed)


# ============================================================================================ back-off

@dataclass
class Outcome:
    """The result of a back-off search: the first accepted candidate (None when none was) and its state, the
    verdict on what was asked (the first candidate) and on what was kept."""
    program: Program | None
    state: Any
    payload: Any
    asked: Verdict | None
    verdict: Verdict | None
    tries: int


def first_accepted(guard: LossGuard | None, build: Callable, states: Iterable, kind: str = "lossy") -> Outcome:
    """Build a candidate per state (`build(state) -> (Program, payload)`), in order, until the guard accepts one.
    Without a guard the first candidate is taken as it is (`unjudged`)."""
    asked, tries = None, 0
    for state in states:
        program, payload = build(state)
        tries += 1
        verdict = guard.judge(program) if guard is not None else unjudged(kind)
        asked = asked or verdict
        if verdict.accepted:
            return Outcome(program, state, payload, asked, verdict, tries)
    return Outcome(None, None, None, asked, None, tries)


def exclusion_steps(order: list) -> Iterator[list]:
    """Prefixes of `order` (sites by their own error, largest first) to leave out: none, then 1, 2, 4, ... sites,
    then all but one; never all (that is the program unchanged)."""
    site_count, left_out = len(order), 0
    while left_out < site_count:
        yield list(order[:left_out])
        if left_out == site_count - 1:
            return
        left_out = min(max(1, 2 * left_out), site_count - 1)
