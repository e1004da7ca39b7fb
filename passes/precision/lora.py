"""QLoRA adapters: a LoRA wrapper around a frozen base linear (4-bit, or the original weights where the guard
reverted the 4-bit ones), and the freezing of every other parameter."""
from __future__ import annotations

import torch
from torch import fx, nn

from fxmem.depgroups import attr_of
from fxmem.errors import PolicyError
from fxmem.nn.lowbit import FrozenLinear, LoRALinear
from fxmem.pass_api import Change

from .linears import LinearSite, swap_linear
from .options import PrecisionOptions, QLoRAOptions
from .params import replace_params


def lora_module(base: nn.Module, qlora: QLoRAOptions, device, seed: int) -> nn.Module:
    """A LoRA adapter (`fxmem.nn.lowbit.LoRALinear`) around a frozen base linear."""
    return LoRALinear(base, base.in_features, base.out_features, rank=qlora.rank, alpha=qlora.alpha,
                      dropout=qlora.dropout, device=device, seed=seed)


def add_dense_lora(graph_module: fx.GraphModule, site: LinearSite, opts: PrecisionOptions, compute: torch.dtype,
                   seed: int) -> Change:
    """A LoRA adapter on a targeted linear whose 4-bit weights the guard reverted: its own weight, frozen (stored
    in bf16 with `params: bf16`, else not copied), computing in `compute` as the 4-bit base would have, is the base
    (`fxmem.nn.lowbit.FrozenLinear`), so the adapters still train where QLoRA was asked."""
    qlora = opts.qlora
    stored = torch.bfloat16 if opts.params == "bf16" else None
    weight = attr_of(graph_module, site.weight)
    bias = attr_of(graph_module, site.bias) if site.bias else None
    w_base, b_base = (t if t is None or stored is None else t.detach().to(stored) for t in (weight, bias))
    base = FrozenLinear(w_base, b_base, transposed=site.transposed, compute_dtype=compute)
    mod = lora_module(base, qlora, weight.device, seed)
    name_before = site.node.name
    target = swap_linear(graph_module, site, mod)
    return Change("precision.lora", site.path, [name_before], [target],
                  f"LoRA rank {qlora.rank} on the original-precision weights (the guard reverted the 4-bit ones); "
                  f"weights frozen; state_dict: {site.weight} -> {target}.base.weight", 0,
                  {"base": "dense", "rank": qlora.rank})


def freeze_for_lora(graph_module: fx.GraphModule, changes: list[Change], sites: list[LinearSite], skipped: list[dict],
                    qlora: QLoRAOptions) -> Change:
    """Freeze every base parameter for QLoRA; a PolicyError when no adapter was added (nothing would train)."""
    adapted = [c for c in changes if c.kind in ("precision.quantize+lora", "precision.lora")]
    if not adapted:
        if sites:
            names = ", ".join(s.path for s in sites[:6]) + (", ..." if len(sites) > 6 else "")
            why = f"matched none of the {len(sites)} linear(s) that can take one ({names})"
        else:
            kept = [f"{sk['module']}: {sk['why']}" for sk in skipped[:3]] + (["..."] if len(skipped) > 3 else [])
            why = f"found no linear that can take one ({', '.join(kept) or 'the model has no linear'})"
        raise PolicyError(f"passes.precision.qlora.targets {qlora.targets} {why}: no LoRA adapter, so nothing "
                          f"would train")
    frozen = replace_params(graph_module, lambda p: nn.Parameter(p.detach(), requires_grad=False))
    n_lora = sum(p.numel() for n, p in graph_module.named_parameters() if "lora_" in n and p.requires_grad)
    n_dense = sum(1 for c in adapted if c.kind == "precision.lora")
    return Change("precision.freeze", "", [], [], f"QLoRA: {len(frozen)} base parameter(s) frozen; {n_lora} adapter "
                  f"weights train on {len(adapted)} linear(s)" + (f", {n_dense} of them on original-precision "
                                                                   f"weights" if n_dense else ""),
                  None, {"frozen": frozen, "lora_params": n_lora, "adapted": [c.module for c in adapted]})
