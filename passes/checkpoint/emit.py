"""Emission: each region a plan recomputes becomes a `CheckpointRegion` submodule (`ckpt_<module path>`).

The region's nodes are outlined (`fxmem.outline`) into a body the submodule runs through non-reentrant
`torch.utils.checkpoint` (RNG state preserved), keeping what the choice keeps (selective: the keep ops' outputs;
full: the region's dropout masks). Parameters stay owned by the outer module and are passed in as arguments.
"""
from __future__ import annotations

import torch
from torch import fx

from fxmem import ops as optable
from fxmem.costmodel import CandidateRegion
from fxmem.nn.checkpoint import CheckpointRegion
from fxmem.nn.recast import install as install_recast
from fxmem.nn.region_graph import explicit_values
from fxmem.nn.remat import op_call
from fxmem.outline import OutlineError, outline, region_boundary
from fxmem.pass_api import Change
from fxmem.program import Program
from fxmem.units import format_bytes


def restore_args(inputs: list, nodes: list) -> tuple[int, ...]:
    """Indices of region inputs that are buffers the region updates in place (batch-norm running stats)."""
    mutated: set = set()
    for node in nodes:
        target, args = op_call(node.target, node.args)  # (a remat_call batch norm runs inside a region as the norm)
        if target in (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default):
            for arg in args[3:5]:
                if isinstance(arg, fx.Node):
                    mutated.add(arg)
        mutated.update(a for a in optable.written_args(target, args) if isinstance(a, fx.Node))
    return tuple(i for i, a in enumerate(inputs) if a in mutated and a.op == "get_attr")


def emit_regions(program: Program, regions: list[CandidateRegion], plan: list[str],
                 keep_ops: frozenset) -> list[Change]:
    """Outline every region `plan` does not keep into a CheckpointRegion (in place on `program`, whose nodes
    carry the regions' node names: it may be a snapshot of the program they were found on). A region that
    cannot be outlined is skipped, and its Change says why. A region planned to run as recipes
    (`CandidateRegion.runs_as_recipes`) has its body's saved values written as graph values
    (`fxmem.nn.region_graph.explicit_values`)."""
    changes = []
    by_name = {n.name: n for n in program.graph.nodes}
    for region, choice in zip(regions, plan):
        if choice != "keep":
            changes.append(_emit_region(program, region, choice, [by_name[n.name] for n in region.nodes], keep_ops))
    program.graph.lint()
    program.module.recompile()  # once for all the regions (outline(recompile=False))
    if any(change.kind != "checkpoint_skipped" for change in changes):
        install_recast(program.module)  # (its scope runs the regions as recipes: fxmem.nn.region_recipe)
    return changes


def _emit_region(program: Program, region: CandidateRegion, choice: str, nodes: list[fx.Node],
                 keep_ops: frozenset) -> Change:
    keep = {"selective": keep_ops | region.keep_full, "full": region.keep_full}.get(choice, frozenset())
    inputs, _ = region_boundary(nodes)
    restore = restore_args(inputs, nodes)
    label = region.path.split("#")[0]
    before = [n.name for n in nodes]
    recipes = region.runs_as_recipes(choice) and not restore

    def wrap(body):
        if recipes:
            explicit_values(body.graph)
            body.recompile()
        return CheckpointRegion(body, keep, label=label, restore_args=restore, recipes=recipes)
    try:
        call = outline(program, nodes, "ckpt_" + region.path.replace("#", "_"), wrap=wrap, recompile=False)
    except OutlineError as error:
        return Change("checkpoint_skipped", label, before, [], f"not outlined: {error}", 0)
    return Change(
        kind="checkpoint_" + choice, module=label, nodes_before=before, nodes_after=[call.name],
        reason=(("full recompute, dropout masks drawn again" if choice == "redraw" else f"{choice} recompute")
                + (" of what backward reads, as recipes" if recipes else "")
                + f": frees about {format_bytes(region.freed(choice))} of saved activations "
                f"for {region.cost(choice):.3g} recompute cost"
                + (f" (keeps outputs of {', '.join(sorted(keep))})" if keep else "")),
        bytes_saved=region.freed(choice),
        details={"choice": choice, "recipes": recipes, "saved_bytes": region.saved,
                 "kept_bytes": region.kept if choice == "selective" else region.kept_full,
                 "recompute_cost": region.cost(choice), "submodule": call.target})
