"""Precision pass: a dtype for every edge of the graph, chosen from the policy's intent and what the kernels can
do, with every kind of change judged end to end by the accuracy guard and backed off where it refuses.

Two stages run on copies of the program: `weights_stage` (linears swapped for bitsandbytes int8 / nf4 / fp4 layers,
QLoRA adapters; convolution, embedding and 3-D expert weights stored quantized) and `compute_stage` (bf16 / fp16 compute
with fp32 islands, `plan` + `casts`); QLoRA then freezes every base parameter (`lora`). The pass is lossy (`exact =
False`): the PassManager rolls it back when a verdict it returns refuses. Options: `options.PrecisionOptions`. Design:
docs/design/precision.md.
"""
from __future__ import annotations

import torch

from fxmem.lossguard import guard_items
from fxmem.nn.recast import cast_param
from fxmem.pass_api import Pass, PassContext, PassResult, register
from fxmem.program import Program

from .casts import apply_plan, simplify_casts
from .compute_stage import compute_stage
from .linears import linear_sites
from .lora import freeze_for_lora
from .measure import losses_after_steps, output_deviation
from .nodes import node_args
from .options import DTYPES, KEEP_GROUPS, PrecisionOptions, QLoRAOptions, validate, weight_kind
from .plan import ACC_BF16, ACC_FP16, CAST_OPS, plan
from .stage import StageLog
from .weights_stage import weights_stage

# what tests and benchmarks reach through the package besides the pass
__all__ = ["ACC_BF16", "ACC_FP16", "CAST_OPS", "DTYPES", "KEEP_GROUPS", "PrecisionOptions", "PrecisionPass",
           "QLoRAOptions", "apply_plan", "cast_param", "linear_sites", "node_args", "plan", "simplify_casts"]


@register
class PrecisionPass(Pass):
    name = "precision"
    exact = False
    Options = PrecisionOptions

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        opts: PrecisionOptions = ctx.options
        validate(opts)
        low, kind = DTYPES[opts.compute], weight_kind(opts)
        log = StageLog()
        if opts.qlora is not None and opts.weights in ("none", "fp32"):
            log.notes.append("qlora: base weights quantized to nf4 (weights: none was given)")
        if low == torch.float32 and kind is None and opts.params == "fp32":
            return PassResult(program, False, notes=["compute fp32, no weight quantization: nothing to do"])
        metrics: dict = {"compute": opts.compute, "islands": opts.islands, "params": opts.params,
                         "weights": opts.weights}
        est_before = _safe_estimate(ctx, program) if opts.report_estimate else None
        result = _run_stages(program, ctx, opts, low, kind, log, metrics)
        _site_metrics(log, metrics)
        _whole_model(program, result, ctx, opts, metrics, log.notes)
        _estimates(ctx, result, opts, est_before, metrics, log.notes)
        return _pass_result(program, result, log, metrics)


def _run_stages(program: Program, ctx: PassContext, opts: PrecisionOptions, low: torch.dtype, kind: str | None,
                log: StageLog, metrics: dict) -> Program:
    """The weights stage, the compute stage, then QLoRA's freezing; returns the program kept (refreshed)."""
    reference = program
    want_compute = low != torch.float32
    if kind is not None:
        program = weights_stage(program, ctx, opts, kind, low if want_compute else torch.float32, log)
    quantized = [c for c in log.changes if c.kind.startswith("precision.quantize")]
    metrics["linears_quantized"] = sum("role" not in c.details for c in quantized)
    metrics["weights_stored_quantized"] = sum("role" in c.details for c in quantized)
    if quantized and ctx.mode == "train" and opts.qlora is None:
        log.notes.append("quantized weights are frozen (bitsandbytes int8/4-bit linears and the convolution, "
                         "embedding and expert weights stored quantized take no gradient); the rest of the model "
                         "trains")
    if want_compute:
        program = compute_stage(program, ctx, opts, low, log, metrics)
        _training_notes(opts, ctx.mode, log)
    if opts.qlora is not None:
        _freeze_for_qlora(reference, program, opts, kind, log, metrics)
    program.refresh()
    return program


def _site_metrics(log: StageLog, metrics: dict) -> None:
    """The per-site rows of both stages, how many went back, and the guard's verdicts on what was asked."""
    metrics["sites"] = log.sites
    metrics["sites_reverted"] = sum(1 for s in log.sites if s["reverted"])
    metrics["guard_asked"] = [v.to_dict() for v in log.asked]


def _pass_result(reference: Program, program: Program, log: StageLog, metrics: dict) -> PassResult:
    modified = program is not reference
    if not modified:
        log.notes.append("the guard accepted no change: the model is left as it was")
    return PassResult(program, modified, changes=log.changes, notes=log.notes, metrics=metrics,
                      intents=log.intents, verdicts=log.verdicts)


def _training_notes(opts: PrecisionOptions, mode: str, log: StageLog) -> None:
    if opts.compute == "fp16" and mode == "train":
        log.notes.append("fp16 training needs loss scaling: gradients below 6e-8 flush to zero in fp16; use "
                         "torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()) "
                         "— tested with fxmem on CPU")
    if opts.params == "bf16" and mode == "train":
        log.notes.append("bf16 parameters: build the optimizer with fxmem.make_optimizer(module, policy), which keeps "
                         "fp32 master weights and fp32 optimizer state (the cost model's estimate assumes optimizer "
                         "state in the parameter dtype)")


def _freeze_for_qlora(reference: Program, program: Program, opts: PrecisionOptions, kind: str, log: StageLog,
                      metrics: dict) -> None:
    """QLoRA: only the adapters train (a PolicyError naming the linears of `reference` when no adapter was added)."""
    sites, skipped = linear_sites(reference.module, opts)
    log.changes.append(freeze_for_lora(program.module, log.changes, sites, skipped, opts.qlora))
    metrics["lora_params"] = log.changes[-1].details["lora_params"]
    dense_sites = [c.module for c in log.changes if c.kind == "precision.lora"]
    if dense_sites:
        log.notes.append(f"qlora: {len(dense_sites)} targeted linear(s) whose {kind} weights the accuracy guard "
                         f"reverted keep their original weights, frozen, under a LoRA adapter (adapter training as "
                         f"asked, no 4-bit saving there): {', '.join(dense_sites)}")


def _whole_model(reference: Program, program: Program, ctx: PassContext, opts: PrecisionOptions, metrics: dict,
                 notes: list) -> None:
    """The whole model against the pass's input: output deviation on the guard data, and in training the losses
    after `loss_steps` optimizer steps (report figures)."""
    if not opts.guard or program is reference:
        return
    inputs = guard_items(ctx, reference)[0]
    try:
        metrics["output_deviation"] = output_deviation(reference.module, program.module, inputs)
    except Exception as error:  # noqa: BLE001
        notes.append(f"output deviation not measured: {type(error).__name__}: {error}")
    if ctx.mode == "train" and opts.loss_steps > 0:
        try:
            args, kwargs = inputs[0]
            metrics["loss_fp32"] = losses_after_steps(reference.module, args, kwargs, ctx.loss_fn, opts.loss_steps,
                                                      ctx.seed)
            metrics["loss_new"] = losses_after_steps(program.module, args, kwargs, ctx.loss_fn, opts.loss_steps,
                                                     ctx.seed)
        except Exception as error:  # noqa: BLE001
            notes.append(f"loss after {opts.loss_steps} steps not measured: {type(error).__name__}: {error}")


def _estimates(ctx: PassContext, program: Program, opts: PrecisionOptions, est_before, metrics: dict,
               notes: list) -> None:
    if not opts.report_estimate:
        return
    est_after = _safe_estimate(ctx, program)
    if est_before is None or est_after is None:
        notes.append("cost-model estimate before/after not available (the static estimate failed)")
        return
    metrics["estimate"] = {k: {"before": getattr(est_before, k), "after": getattr(est_after, k)}
                           for k in ("params", "activations", "optimizer_state", "peak")}


def _safe_estimate(ctx: PassContext, program):
    try:
        return ctx.estimate(program)
    except Exception:  # noqa: BLE001 - the estimate is a report figure here, not a decision input
        return None
