"""The weights stage: linears swapped for bitsandbytes int8 / nf4 / fp4 layers (LoRA-wrapped for QLoRA targets) and
convolution, embedding and 3-D expert weights stored quantized (`weight_sites`), judged end to end by the guard, the
sites whose own error is largest backed off first."""
from __future__ import annotations

import torch
from torch import nn

from fxmem.compare import deviation
from fxmem.depgroups import attr_of
from fxmem.intent import Intent, guard_stop
from fxmem.lossguard import exclusion_steps, first_accepted
from fxmem.nn.recast import install as install_recast
from fxmem.pass_api import Change, PassContext
from fxmem.program import Program
from fxmem.weights_left import describe as describe_weights_left, weights_left

from .linears import LinearSite, build_quant, linear_sites, swap_linear
from .lora import add_dense_lora, lora_module
from .measure import record_values, site_error_module
from .nodes import matching_pattern
from .options import PrecisionOptions
from .stage import SITE_ITEMS, StageLog, back_off_why, by_error, stage_guard
from .weight_sites import build_weight, swap_weight, weight_sites


def weights_stage(program: Program, ctx: PassContext, opts: PrecisionOptions, kind: str, compute: torch.dtype,
                  log: StageLog) -> Program:
    """Swap the linears for bitsandbytes layers and store convolution, embedding and 3-D expert weights quantized;
    the guard judges the whole model, backing off the sites whose own error is largest first. Returns the program
    kept (the given one when nothing was accepted)."""
    sites, skipped = linear_sites(program.module, opts)
    others, left = weight_sites(program.module, opts)
    log.notes.extend(f"{sk['module']}: linear kept ({sk['why']})" for sk in skipped)
    setting = "passes.precision.qlora" if opts.weights in ("none", "fp32") else "passes.precision.weights"
    if not sites and not others:
        log.intents.append(Intent(setting, f"{kind} weights", "quantized none", False, _no_site_reason(skipped),
                                  "lower passes.precision.min_params or narrow skip_modules",
                                  _not_covered(program, program, opts, left)))
        return program
    guard_kind = "4bit" if kind in ("nf4", "fp4") else kind
    guard = stage_guard(ctx, program, opts, guard_kind)
    quant = {s.node.name: build_quant(program.module, s, opts, kind, compute) for s in sites}
    quant.update({w.name: build_weight(program.module, w, kind) for w in others})
    errors = {**_weight_site_errors(program, sites, quant, guard), **_stored_weight_errors(program, others, quant)}
    log.sites.extend({"site": s.node.name, "module": s.path, "decision": kind, "rel": errors[s.node.name],
                      "reverted": False} for s in sites)
    log.sites.extend({"site": w.name, "module": w.target, "decision": kind, "role": w.role, "rel": errors[w.name],
                      "reverted": False} for w in others)

    def build(excluded):
        cand = program.snapshot()
        changes = swap_weight_sites(cand, opts, kind, quant, set(excluded))
        changes += swap_sites(cand, opts, kind, quant, set(excluded), compute, ctx.seed)
        cand.refresh()
        return cand, changes
    outcome = first_accepted(guard, build, exclusion_steps(by_error(errors)), guard_kind)
    kept, changes, excluded = _kept(program, outcome, build, sites, others, opts, kind)
    log.changes.extend(_explain_reverts(changes, outcome, errors))
    log.record(outcome)
    for row in log.sites:
        row["reverted"] = row["site"] in excluded
    stopped_by, change = guard_stop(outcome.asked)
    done, total = len(sites) + len(others) - len(excluded), len(sites) + len(others)
    asked = f"{kind} weights on {len(sites)} linear(s)" + (f" and {len(others)} other weight(s)" if others else "")
    backed_off = {w.target: f"backed off by the accuracy guard ({back_off_why(outcome, 'the quantized weights')})"
                  for w in others if w.name in excluded}
    log.intents.append(Intent(setting, asked, f"quantized {done} of {total}", done == total, stopped_by, change,
                              _not_covered(kept, program, opts, {**left, **backed_off})))
    return kept


def _kept(program: Program, outcome, build, sites: list, others: list, opts: PrecisionOptions, kind: str):
    """(the program kept, its Changes, the names of the sites left out) from the guard's outcome."""
    if outcome.program is not None:
        return outcome.program, outcome.payload, set(outcome.state)
    # nothing accepted: every site keeps its weights (QLoRA targets get a dense-base adapter)
    excluded = {s.node.name for s in sites} | {w.name for w in others}
    if opts.qlora is not None:
        kept, changes = build(excluded)
        return kept, changes, excluded
    changes = [Change("precision.reverted", s.path, [s.node.name], [s.node.name], "", 0, {"decision": kind})
               for s in sites]
    changes += [_reverted_weight(w, kind) for w in others]
    return program, changes, excluded


def _not_covered(kept: Program, original: Program, opts: PrecisionOptions, why: dict[str, str]) -> str:
    """The line naming the large weights `kept` still holds in full precision, with the reasons in `why`."""
    return describe_weights_left(weights_left(kept.module, opts.min_params, why), original.module)


def _no_site_reason(skipped: list[dict]) -> str:
    """Why no linear could take quantized weights, from the skip rules that kept them."""
    if not skipped:
        return "the model has no linear layer"
    shown = ", ".join(f"{sk['module']}: {sk['why']}" for sk in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    return f"no linear qualifies ({shown})"


def _weight_site_errors(program: Program, sites: list, quant: dict, guard) -> dict[str, float]:
    """Each linear's own relative output error with its quantized layer, on the guard data (ordering only)."""
    if guard is None:
        return {s.node.name: float("nan") for s in sites}
    keep = {n for s in sites for n in (s.node.name, s.x.name)}
    values = record_values(program.module, guard.items[:SITE_ITEMS], keep)
    return {s.node.name: site_error_module(s.node, quant[s.node.name], values, s.x)[1] for s in sites}


def swap_sites(cand: Program, opts: PrecisionOptions, kind: str, quant: dict, excluded: set,
               compute: torch.dtype, seed: int) -> list[Change]:
    """Swap every site of `cand` not in `excluded` for its quantized layer (LoRA-wrapped for QLoRA targets); an
    excluded QLoRA target gets an adapter on its original weights. Returns the Changes."""
    graph_module = cand.module
    targets = opts.qlora.targets if opts.qlora is not None else []
    changes = []
    for site in linear_sites(graph_module, opts)[0]:
        lora = opts.qlora is not None and matching_pattern(site.path, targets) is not None
        if site.node.name in excluded:
            changes.append(Change("precision.reverted", site.path, [site.node.name], [site.node.name], "", 0,
                                  {"decision": kind}))
            if lora:
                changes.append(add_dense_lora(graph_module, site, opts, compute, seed))
            continue
        changes.append(_swap_one(graph_module, site, opts, kind, quant[site.node.name], lora, seed))
    return changes


def _stored_weight_errors(program: Program, others: list, quant: dict) -> dict[str, float]:
    """Each stored weight's own relative error (dequantized vs the weight; orders the back-off only)."""
    out = {}
    for site in others:
        weight = attr_of(program.module, site.target)
        with torch.no_grad():
            out[site.name] = deviation(weight, quant[site.name].dequantize()).rel
    return out


def swap_weight_sites(cand: Program, opts: PrecisionOptions, kind: str, quant: dict, excluded: set) -> list[Change]:
    """Store every weight site of `cand` not in `excluded` quantized (its reads become calls of the module holding
    it); the recast hooks make backward dequantize again rather than keep the copy. Returns the Changes."""
    graph_module = cand.module
    changes = []
    for site in weight_sites(graph_module, opts)[0]:
        if site.name in excluded:
            changes.append(_reverted_weight(site, kind))
            continue
        module = quant[site.name]
        dense = attr_of(graph_module, site.target)
        nodes_before = [n.name for n in site.nodes]
        target = swap_weight(graph_module, site, module)
        dense_bytes, quant_bytes = dense.numel() * dense.element_size(), module.quantized_bytes()
        names = ", ".join(f"{target}.{name}" for name, _ in module.named_buffers())
        changes.append(Change("precision.quantize", site.target, nodes_before, [target],
                              f"{site.role} -> bitsandbytes {kind} storage, dequantized where the graph reads it; "
                              f"weight frozen; state_dict: {site.target} -> {names}", dense_bytes - quant_bytes,
                              {"dense_bytes": dense_bytes, "quant_bytes": quant_bytes, "role": site.role}))
    if any(c.kind == "precision.quantize" for c in changes):
        install_recast(graph_module)
    return changes


def _reverted_weight(site, kind: str) -> Change:
    return Change("precision.reverted", site.target, [site.name], [site.name], "", 0,
                  {"decision": kind, "role": site.role})


def _swap_one(graph_module, site: LinearSite, opts: PrecisionOptions, kind: str, mod: nn.Module, lora: bool,
              seed: int) -> Change:
    weight = attr_of(graph_module, site.weight)
    bias = attr_of(graph_module, site.bias) if site.bias else None
    dense = weight.numel() * weight.element_size() + (bias.numel() * bias.element_size() if bias is not None else 0)
    if lora:
        mod = lora_module(mod, opts.qlora, weight.device, seed)
    name_before = site.node.name
    target = swap_linear(graph_module, site, mod)
    qbytes = (mod.base if lora else mod).weight_bytes()
    inner = f"{target}.{'base.' if lora else ''}"
    return Change("precision.quantize" + ("+lora" if lora else ""), site.path, [name_before], [target],
                  f"aten.linear -> bitsandbytes {kind} linear" + (f" + LoRA rank {opts.qlora.rank}" if lora else "")
                  + f"; weights frozen; state_dict: {site.weight} -> {inner}inner.weight (+ bitsandbytes state keys); "
                    f"bias -> {inner}bias", dense - qbytes, {"dense_bytes": dense, "quant_bytes": qbytes})


def _explain_reverts(changes: list[Change], outcome, errors: dict) -> list[Change]:
    """Fill in why each backed-off site kept its precision (the guard's verdict on the whole model) and each kept
    site's own error."""
    why = back_off_why(outcome, "it")
    for change in changes:
        rel = errors.get(change.nodes_before[0] if change.nodes_before else "", float("nan"))
        change.details["rel"] = rel
        if change.kind == "precision.reverted":
            what = change.details.get("decision", "")
            change.reason = f"{what}: kept in its original precision: {why} (its own relative error {rel:.3g})"
        elif change.kind.startswith("precision.quantize"):
            change.reason += f" (site relative error {rel:.3g})"
    return changes
