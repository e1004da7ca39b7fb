"""Run an fxmem-transformed GraphModule under torch.distributed, as users already run their models.

    torch.distributed.init_process_group("gloo")          # or nccl; the user's launcher as usual
    module = fxmem.distribute(result.module, "fsdp")      # or "ddp", OffloadOptions, a Policy, a dict
    loss = loss_fn(module(x)); loss.backward(); opt.step()

DDP wraps the module in `DistributedDataParallel`. FSDP2 needs called modules that own their parameters, which a
captured graph has none of: each block (`fxmem.blocks`) is outlined into a body under a `ShardedBlock`, and
`fully_shard` is applied to every block and to the root. A block that cannot be made is sharded with the root,
with a warning (`module.fxmem_distribute_notes`). `measure_rank(module, args, ...)` measures one step on this
rank; `fxmem.estimate(program, world_size=W, zero_stage=S)` predicts it.
Design: docs/design/distributed.md.
"""
from __future__ import annotations

import gc
import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from .blocks import block_paths, named_stack
from .costmodel import estimate
from .errors import FxmemError
from .measure import StorageTracker
from .nn.regions import region_info
from .outline import OutlineError, check_outline, outline
from .policy import Policy
from .program import Program
from .step import compute_loss

__all__ = ["distribute", "declared_mode", "ShardedBlock", "measure_rank", "estimate_rank", "DistributeOptions"]


@dataclass
class DistributeOptions:
    mode: str = "ddp"  # "ddp" | "fsdp"
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy (parameters, gradients and optimizer step on CPU)
    param_dtype: torch.dtype | None = None  # FSDP2 MixedPrecisionPolicy
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    blocks: list | None = None  # module paths to shard separately (default: found from the graph)


class ShardedBlock(nn.Module):
    """A block that owns its parameters (same children as the captured module at its path) and runs `body`.

    The graph calls it with the block's non-parameter inputs; `param_slots` says at which body argument each of
    its parameters goes (by name relative to this module), read at call time so FSDP's unsharded parameters
    are the ones used.
    """

    def __init__(self, owner: nn.Module, body: nn.Module, n_args: int, param_slots: dict[int, str], label: str):
        super().__init__()
        for name, child in owner.named_children():
            self.add_module(name, child)
        for name, param in owner.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in owner.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        self.body = body
        self.n_args = n_args
        self.param_slots = dict(param_slots)
        self.label = label

    def forward(self, *args):
        inputs = iter(args)
        full = [self.get_parameter(self.param_slots[i]) if i in self.param_slots else next(inputs)
                for i in range(self.n_args)]
        return self.body(*full)

    def extra_repr(self) -> str:
        return f"label={self.label!r}, params={len(self.param_slots)}"


def _set_module(root: nn.Module, path: str, mod: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent._modules[leaf] = mod


def make_blocks(graph_module: fx.GraphModule, paths: list[str] | None = None,
                dry_run: bool = False) -> tuple[list[str], list[str]]:
    """Turn each block into a ShardedBlock call (in place). Returns (blocks made, notes). `dry_run`: the same
    answer without changing `graph_module` (what `estimate_rank` shards)."""
    paths = block_paths(graph_module) if paths is None else list(paths)
    notes: list[str] = []
    made: list[str] = []
    prog = Program(graph_module, (), {}, "train")
    for path in paths:
        graph = graph_module.graph
        members = [n for n in graph.nodes if n.op in ("call_function", "call_module")
                   and any(stack_path == path for stack_path, _ in named_stack(n))
                   and not (n.op == "call_module" and n.target in ("input_guard", "mode"))]
        if not members:
            notes.append(f"{path}: no graph nodes; its parameters are sharded with the root")
            continue
        modules = [n for n in members if n.op == "call_module"]
        try:
            owner = graph_module.get_submodule(path)
        except AttributeError:
            notes.append(f"{path}: not a module of the graph; its parameters are sharded with the root")
            continue
        own_params = {id(param): name for name, param in owner.named_parameters()}
        # a node outside the block reading its parameters: a region joining part of it to another block (a
        # checkpoint segment h.0.mlp + h.1.ln_1), whose call is not the block's
        member_set = set(members)
        spanning = [u.target if u.op == "call_module" else u.name for n in graph.nodes if n.op == "get_attr"
                    and n.target.startswith(path + ".") for u in n.users if u not in member_set]
        # an existing region covering the block becomes its body; else the block's nodes, with the regions inside
        # it (checkpointed attention, MLP), are outlined into one
        whole = len(modules) == 1 and all(n is modules[0] or (n.op == "call_function" and n.target is
                                                               operator.getitem and n.args[0] is modules[0])
                                          for n in members)
        if spanning:
            notes.append(f"{path}: {spanning[0]} reads its parameters from outside the block (a region joining "
                         f"part of it to another; passes.checkpoint.within_blocks: true keeps regions inside "
                         f"blocks); its parameters are sharded with the root")
            continue
        call_name = "fxmem_block_" + path.replace(".", "_")
        if not whole:
            try:
                check_outline(members, call_name)
            except OutlineError as error:
                notes.append(f"{path}: cannot be one call ({error}); its parameters are sharded with the root")
                continue
        made.append(path)
        if dry_run:
            continue
        if whole:
            call = modules[0]
            body = graph_module.get_submodule(call.target)
        else:
            call = outline(prog, members, call_name)
            body = graph_module.get_submodule(call.target)
            delattr(graph_module, call.target)
        # which arguments are this block's parameters
        slots: dict[int, str] = {}
        keep: list = []
        for slot, arg in enumerate(call.args):
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                try:
                    param = graph_module.get_parameter(arg.target)
                except AttributeError:
                    param = None
                if param is not None and id(param) in own_params:
                    slots[slot] = own_params[id(param)]
                    continue
            keep.append(arg)
        block = ShardedBlock(owner, body, len(call.args), slots, path)
        _set_module(graph_module, path, block)
        call.target = path
        call.args = tuple(keep)
    if dry_run:
        return made, notes
    graph_module.graph.eliminate_dead_code(
        is_impure_node=lambda n: n.op in ("placeholder", "output", "call_module")
        or (n.op == "call_function" and getattr(getattr(n.target, "_schema", None), "is_mutable", False)))
    graph_module.graph.lint()
    graph_module.recompile()
    return made, notes


# ============================================================================================ distribute

def _section_options(policy, name: str):
    """The options of a policy's `passes.<name>` section (None: no such section, or not a Policy)."""
    passes = getattr(policy, "passes", None)
    section = passes.get(name) if isinstance(passes, dict) else None
    return getattr(section, "options", None)


def declared_mode(policy) -> str:
    """The distribution a policy declares for the module (`Policy.distribution`): "none", "ddp" or "fsdp"; "none"
    for anything that is not a Policy."""
    return policy.distribution if isinstance(policy, Policy) else "none"


def _options(policy_or_options: Any, module: nn.Module, overrides: dict) -> DistributeOptions:
    options = DistributeOptions()
    plan = getattr(module, "fxmem_offload", None) or {}
    src = policy_or_options
    if src is None:
        src = plan.get("distributed", "none")
        if src == "none":
            raise FxmemError("fxmem.distribute: no mode given and the module has no offload plan with "
                             "`distributed: ddp|fsdp`; pass 'ddp' or 'fsdp'")
    if isinstance(src, str):
        options.mode = src
    elif isinstance(src, DistributeOptions):
        options = DistributeOptions(**vars(src))
    elif isinstance(src, dict):
        for key, value in src.items():
            if key == "distributed":
                options.mode = value
            elif hasattr(options, key):
                setattr(options, key, value)
            else:
                raise FxmemError(f"fxmem.distribute: unknown option {key!r}")
    else:
        opts = src
        if hasattr(src, "passes"):  # a Policy
            opts = _section_options(src, "offload")
            if opts is None:
                raise FxmemError("fxmem.distribute: the policy has no passes.offload section with `distributed`")
        mode = getattr(opts, "distributed", None)
        if mode in (None, "none"):
            raise FxmemError("fxmem.distribute: passes.offload.distributed is 'none'; set it to 'ddp' or 'fsdp'")
        options.mode = mode
        options.cpu_offload = bool(getattr(opts, "grads", False))
        if hasattr(src, "passes"):  # the precision pass's compute dtype -> FSDP2 MixedPrecisionPolicy
            psec = src.passes.get("precision") if isinstance(src.passes, dict) else None
            popts = _section_options(src, "precision") if getattr(psec, "enabled", False) else None
            compute = getattr(popts, "compute", "fp32")
            if compute in ("bf16", "fp16"):
                options.param_dtype = torch.bfloat16 if compute == "bf16" else torch.float16
                options.reduce_dtype = torch.float32
    for key, value in overrides.items():
        if value is not None:
            setattr(options, key, value)
    if options.mode not in ("ddp", "fsdp"):
        raise FxmemError(f"fxmem.distribute: mode must be 'ddp' or 'fsdp', got {options.mode!r}")
    prec = getattr(module, "fxmem_precision", None)
    if isinstance(prec, dict) and options.param_dtype is None:
        options.param_dtype = prec.get("param_dtype")
        options.reduce_dtype = options.reduce_dtype or prec.get("reduce_dtype")
    return options


def distribute(module: nn.Module, policy_or_options: Any = None, *, mode: str | None = None,
               cpu_offload: bool | None = None, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, blocks: list | None = None, device_mesh=None,
               **ddp_kwargs) -> nn.Module:
    """Wrap `module` for data-parallel training on the current process group (see the module docstring).

    policy_or_options: "ddp" | "fsdp", a DistributeOptions, a dict of its fields, OffloadOptions / a Policy
    (their `distributed` field), or None (the plan the offload pass recorded on the module).
    Returns the DDP wrapper, or (FSDP2) the module itself, sharded in place.
    """
    import torch.distributed as dist  # (only here: the rest of fxmem runs without a process group)
    if not dist.is_available() or not dist.is_initialized():
        raise FxmemError("fxmem.distribute: torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group(...) first (one process per rank)")
    options = _options(policy_or_options, module, dict(mode=mode, cpu_offload=cpu_offload, param_dtype=param_dtype,
                                                       reduce_dtype=reduce_dtype, blocks=blocks))
    if options.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        dev = next((p.device for p in module.parameters()), torch.device("cpu"))
        if dev.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [dev])
        return DDP(module, **ddp_kwargs)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    shard_kwargs: dict = {"reshard_after_forward": options.reshard_after_forward}
    if device_mesh is not None:
        shard_kwargs["mesh"] = device_mesh
    if options.cpu_offload:
        shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs CUDA
    if options.param_dtype is not None or options.reduce_dtype is not None:
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=options.param_dtype,
                                                         reduce_dtype=options.reduce_dtype)
    made: list[str] = []
    if isinstance(module, fx.GraphModule):
        made, notes = make_blocks(module, options.blocks)
        module.fxmem_distribute_notes = notes
        if notes:  # each rank then all-gathers those parameters whole, with the root's: say so
            warnings.warn("fxmem.distribute (FSDP2): " + "; ".join(notes), stacklevel=2)
    else:
        made = list(options.blocks or [])
    for path in made:
        fully_shard(module.get_submodule(path), **shard_kwargs)
    fully_shard(module, **shard_kwargs)
    module.fxmem_sharded_blocks = made
    return module


# ============================================================================================ per-rank memory

def measure_rank(module: nn.Module, args: tuple, kwargs: dict | None = None, *, optimizer: torch.optim.Optimizer,
                 loss_fn=None, steps: int = 2) -> dict:
    """Live tensor bytes on this rank over a steady-state step (the last of `steps`).

    Parameters and optimizer state are counted by their local shards (DTensor.to_local()); everything a step
    allocates (all-gathered parameters, gradients, reduce buffers, activations) by the same storage tracker
    fxmem.measure uses. Returns {"peak", "params", "optimizer_state", "base"} in bytes.
    """

    from torch.utils import _pytree as pytree

    kwargs = dict(kwargs or {})

    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    def state_tensors():
        out = []
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    out.append(local(value))
        return out

    def step(tracker=None):
        out = module(*args, **kwargs)
        loss = compute_loss(loss_fn, out, args, kwargs)
        if tracker is not None:
            tracker.phase = "backward"
        loss.backward()
        if tracker is not None:
            tracker.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(steps - 1):
        step()
    gc.collect()
    params = [local(p) for p in module.parameters()]
    device = params[0].device if params else torch.device("cpu")
    tracker = StorageTracker(device=device if device.type == "cuda" else None)  # device memory, as fxmem.measure
    tracker.seed(params)
    tracker.seed([local(b) for b in module.buffers()])
    tracker.seed(pytree.tree_leaves((args, kwargs)))
    tracker.seed(state_tensors())
    base = tracker.current
    res = {"params": tracker.bytes_of(params), "optimizer_state": tracker.bytes_of(state_tensors()), "base": base}
    tracker.reset_peak()
    tracker.record = True
    tracker.phase = "forward"
    try:
        with tracker:
            step(tracker)
        res["peak"] = tracker.peak
        res["peak_phase"] = tracker.peak_phase
        res["peak_at"] = tracker.peak_label
        res["timeline"] = tracker.timeline
    finally:
        tracker.close()
    return res


def estimate_rank(program: Program, mode: str, world_size: int, *, optimizer: str = "adamw", loss_fn=None,
                  blocks: list[str] | None = None) -> dict:
    """Per-rank peak predicted by the cost model for DDP (zero_stage 0) or FSDP2 (zero_stage 3).

    `fxmem.estimate(..., world_size, zero_stage)` shards parameters, gradients and optimizer state; on top of it:
    DDP keeps gradient buckets (one more copy of the trainable parameters' bytes); FSDP2 holds the root's
    parameters unsharded from forward until the end of backward, up to two blocks' unsharded parameters
    (the one computing and the one prefetched), and in a block's backward its unsharded gradients plus the
    reduce-scatter input copied from them (twice the largest block, or the root's parameters, whose gradients are
    reduced at the end of backward, when they are larger). With offload regions, also a block's all-gather output,
    alive until it is copied out into the block's parameters: offloaded activations come back inside that window
    (benchmarks/offload.py --distributed, rank 0's timeline: the step peaks there, one block above the rest).
    With checkpoint regions the same block is counted as a margin, not from a timeline: the checkpointed decoder
    measured 2.00 MiB on its own and 2.19 MiB (one block more) in some runs of the benchmark's worker, cause not
    established. Without regions the step peaks elsewhere and the term would count one block high. `program` must
    be at the per-rank input shapes.
    Returns {"peak", "base_estimate", "extra", "zero_stage"} in bytes and "blocks", the blocks sharded apart.
    """
    stage = 0 if mode == "ddp" else 3
    paths: list[str] = []
    est = estimate(program, mode="train", optimizer=optimizer, world_size=world_size, zero_stage=stage,
                   loss_fn=loss_fn)
    graph_module = program.module
    trainable = [(name, param) for name, param in graph_module.named_parameters() if param.requires_grad]
    extra = 0
    if mode == "ddp":
        extra = sum(param.numel() * param.element_size() for _, param in trainable)
    else:
        # the blocks `distribute` makes: a block a checkpoint or offload region covers only in part is not one, and
        # its parameters are sharded with the root
        paths, _ = make_blocks(graph_module, blocks, dry_run=True)
        per_block = {block: 0 for block in paths}
        root = 0
        for name, param in graph_module.named_parameters():
            block = next((block for block in paths if name.startswith(block + ".")), None)
            size = param.numel() * param.element_size()
            if block is None:
                root += size
            else:
                per_block[block] += size
        unsharded_root = root - -(-root // world_size)
        biggest = sorted(per_block.values(), reverse=True)[:2]
        largest = biggest[0] if biggest else 0
        # the all-gather output of the block being gathered, alive until copied out into its parameters while
        # offloaded activations come back (with checkpoint regions: a margin, see above)
        regions = any(region_info(m) is not None for m in graph_module.modules())
        staging = largest if regions else 0
        # in a block's backward (the root's: at the end of backward): its unsharded gradients and the flat
        # reduce-scatter input built from them
        reduce_scatter = 2 * max(largest, root)
        extra = unsharded_root + sum(biggest) + staging + reduce_scatter
    return {"peak": est.peak + extra, "base_estimate": est.peak, "extra": extra, "zero_stage": stage,
            "blocks": paths if mode != "ddp" else []}
