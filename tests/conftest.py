"""Shared fixtures: example model files loaded once per session, deterministic torch settings."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import os
import pathlib
import signal
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxmem.nn.compiled_recompute import SHARES_REGION_ID

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py") if p.stem != "__init__")

# one intra-op thread per pytest-xdist worker (the workers share the cores), else up to two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
warnings.filterwarnings("ignore", category=FutureWarning)
# a suite started in the background of a non-interactive shell inherits SIGINT ignored, and the interrupt tests
# (tests/test_cli_safety.py) would see no KeyboardInterrupt, here or in the processes they start: Python's own
# handler, as in a terminal
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# a test of what a compiled remat plan saves: it holds where remat sites share one checkpoint region (torch 2.13)
needs_shared_remat_region = pytest.mark.xfail(not SHARES_REGION_ID, strict=True, reason=(
    "this torch numbers each checkpoint region's graph id itself (fxmem.nn.compiled_recompute): under "
    "torch.compile every remat site is its own region and the compiled step keeps nested sites' inputs"))


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops (packet name) and records the row counts of mm/addmm inputs."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}
        self.mm_rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        self.ops[name] = self.ops.get(name, 0) + 1
        if name in ("mm", "addmm"):
            a = args[1] if name == "addmm" else args[0]
            self.mm_rows.append(int(a.shape[0]))
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> int:
        return self.ops.get("mm", 0) + self.ops.get("addmm", 0)


NO_CUDA = "no CUDA device"


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are collected everywhere and skipped where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


# the fused SDPA kernels by the aten op each dispatches to (CPU's flash kernel is `..._flash_attention_for_cpu`);
# the math kernel is no op of its own: it decomposes into matmuls and a softmax
SDPA_KERNEL_OPS = {"flash": "_scaled_dot_product_flash_attention", "efficient": "_scaled_dot_product_efficient_attention",
                   "cudnn": "_scaled_dot_product_cudnn_attention"}


def sdpa_kernels(counter: "OpCounter") -> set[str]:
    """The fused SDPA kernels (flash, efficient, cudnn) whose ops `counter` saw run, forward or backward."""
    return {kernel for kernel, op in SDPA_KERNEL_OPS.items() if any(name.startswith(op) for name in counter.ops)}


def on_device(tree, device):
    """`tree` (arguments, keyword arguments, outputs) with every tensor in it moved to `device`."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def example_on(name: str, device, **build_kwargs):
    """`example(name)` with the model and its inputs on `device`."""
    model, args, kwargs, loss_fn = example(name, **build_kwargs)
    return model.to(device), on_device(args, device), on_device(kwargs, device), loss_fn


@functools.lru_cache(maxsize=None)
def example_module(name: str):
    return importlib.import_module(f"examples.{name}")


def example(name: str, **build_kwargs):
    """(model, args, kwargs, loss_fn) for an example, built fresh (deterministic)."""
    from fxmem.modelfile import split_inputs
    mod = example_module(name)
    model = mod.build_model(**build_kwargs)
    args, kwargs = split_inputs(mod.example_inputs())
    return model, args, kwargs, getattr(mod, "loss_fn", None)


@functools.lru_cache(maxsize=None)
def trained_digits_state(hidden: int) -> dict:
    """The state of a digits MLP (`examples/mlp_digits.py`, width `hidden`) trained six epochs of Adam on
    scikit-learn's digits, training split (images 0..1499); trained once per session and width."""
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data[:1500], dtype=torch.float32) / 16.0
    y = torch.tensor(data.target[:1500])
    model = example_module("mlp_digits").build_model(hidden=hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        perm = torch.randperm(1500, generator=g)
        for s in range(0, 1500, 128):
            idx = perm[s:s + 128]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def scale_output_pass(name: str, exact: bool) -> type:
    """A test-only pass class `name` that multiplies the graph's first output by its option `scale` (default
    1.01); `exact` is what it claims (it never is). Register it with `fxmem.pass_api.register`."""
    from fxmem.pass_api import Change, Pass, PassResult

    @dataclasses.dataclass
    class ScaleOptions:
        scale: float = 1.01

    def run(self, program, ctx):
        graph = program.graph
        out = next(n for n in graph.nodes if n.op == "output")
        many = isinstance(out.args[0], (list, tuple))
        first = out.args[0][0] if many else out.args[0]
        with graph.inserting_before(out):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (first, ctx.options.scale))
        out.args = ((scaled, *out.args[0][1:]),) if many else (scaled,)
        return PassResult(program, True, [Change("scale", "", [first.name], [scaled.name], "test")])
    return type("ScaleOutputPass", (Pass,), {"name": name, "exact": exact, "extra": True, "Options": ScaleOptions,
                                             "run": run, "__doc__": scale_output_pass.__doc__})


def grads(module, args, kwargs, loss_fn):
    """(output, {param name: grad}) of one forward + default-or-given loss + backward, from cleared grads."""
    from fxmem.step import compute_loss
    for p in module.parameters():
        p.grad = None
    out = module(*args, **kwargs)
    compute_loss(loss_fn, out, args, kwargs).backward()
    return out, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def step_difference(ref, module, args, kwargs, loss_fn) -> str | None:
    """What differs between one training step of `ref` and one of `module` (both in train mode, the same seed):
    their outputs' tensors and their parameters' gradients, bit for bit; None when nothing does."""
    import torch
    from torch.utils import _pytree as pytree
    outs = []
    for m in (ref, module):
        m.train()
        torch.manual_seed(1)
        outs.append(grads(m, args, kwargs, loss_fn))
    (o1, g1), (o2, g2) = outs
    leaves = [[t for t in pytree.tree_leaves(o) if isinstance(t, torch.Tensor)] for o in (o1, o2)]
    problems = []
    if len(leaves[0]) != len(leaves[1]):
        problems.append(f"output leaves {len(leaves[0])} vs {len(leaves[1])}")
    elif any(not torch.equal(a, b) for a, b in zip(*leaves)):
        bad = [(a, b) for a, b in zip(*leaves) if not torch.equal(a, b)]
        problems.append(f"{len(bad)} outputs differ (max abs {_largest_gap(bad)})")
    if set(g1) != set(g2):
        problems.append(f"gradients of different parameters: {sorted(set(g1) ^ set(g2))[:5]}")
    else:
        bad = [k for k in g1 if not torch.equal(g1[k], g2[k])]
        if bad:
            problems.append(f"{len(bad)}/{len(g1)} gradients differ, e.g. {bad[:3]} (max abs "
                            f"{_largest_gap([(g1[k], g2[k]) for k in bad])})")
    return "; ".join(problems) or None


def _largest_gap(pairs) -> str:
    gaps = [float((a.double() - b.double()).abs().max()) for a, b in pairs if a.shape == b.shape]
    return f"{max(gaps):.3g}" if gaps else "shapes differ"


def gpt_at_activation_budget(budget: str, **options):
    """The example decoder through fxmem.transform with the checkpoint pass at activation budget `budget` (and
    more of its `options`), measured: (a copy of the model as it was, the result, args, kwargs, loss_fn, the
    checkpoint pass's record)."""
    import copy

    import fxmem
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = example("gpt")
    ref = copy.deepcopy(model)
    res = fxmem.transform(model, args, kwargs, loss_fn=loss_fn, measure=True, policy={
        "version": 1, "passes": {"checkpoint": {"activation_budget": budget, **options}}})
    return ref, res, args, kwargs, loss_fn, next(r for r in res.report.passes if r.name == "checkpoint")


def train_and_clear(module, args, kwargs, loss_fn) -> None:
    """One training forward and backward of `module`, its gradients cleared after (a step the benchmarks' clocks
    time, without an optimizer)."""
    module.train()
    loss = loss_fn(module(*args, **kwargs), args)
    loss.backward()
    module.zero_grad(set_to_none=True)


def force_remat_and_regions(monkeypatch) -> None:
    """The checkpoint pass emits remat + regions below what remat alone reaches, whichever of that and regions
    alone it would have found cheaper (for tests of the remat + regions program itself)."""
    from fxmem.pipeline import pass_module
    monkeypatch.setattr(pass_module("checkpoint").CheckpointPass, "_remat_or_not",
                        staticmethod(lambda options, lim: options[0][0](False)))  # (with_remat, its cost) first


def planner_sets(program, loss_fn, remat: bool = False, opts=None):
    """The checkpoint pass's candidate sets, built as the pass builds them: on `program` after compact_dropout
    (and, with `remat`, every remat site applied), traced, with their memory models. Returns (the program planned
    on, its estimate, the sets, estimate_of(cs, plan)): the static estimate of `plan` emitted on a copy, to hold the
    memory model to."""
    from fxmem.costmodel import default_balance, estimate_from_trace
    from fxmem.pipeline import PassContext, pass_module
    ck = pass_module("checkpoint")
    opts = opts or ck.CheckpointOptions()
    ctx = PassContext(policy=None, options=opts, mode="train", optimizer="adamw", budget=1, baseline=None,
                      enabled=("checkpoint",), loss_fn=loss_fn)
    prog = program.snapshot()
    steps = [ck.compact_dropout]
    if remat:
        steps.append(lambda pr: ck.apply_remat(pr, ck.remat_sites(pr, ck.CheckpointPass._trace(pr, ctx),
                                                                  default_balance(pr))))
    for step in steps:
        step(prog)
        prog.graph.lint()
        prog.module.recompile()
    traced = ck.CheckpointPass._trace(prog, ctx)
    est0 = estimate_from_trace(prog, traced, mode="train", optimizer="adamw", loss_fn=loss_fn)
    keep = frozenset(opts.keep_ops)
    sets = ck.CheckpointPass._candidate_sets(prog, traced, est0, opts, keep)

    def estimate_of(cs, plan):
        trial = prog.snapshot()
        ck.CheckpointPass._emit(trial, cs.regions, plan, keep)
        return ctx.estimate(trial)
    return prog, est0, sets, estimate_of


def estimates_and_measured(program, args) -> tuple:
    """(peak, activations) of `program`'s training step three ways: the static estimate, the traced one, and
    `fxmem.measure` on a copy of the program at `args`."""
    import copy

    import fxmem
    static = fxmem.estimate(program)
    traced = fxmem.estimate(program, method="traced")
    measured = fxmem.measure(copy.deepcopy(program.module), args)
    return tuple((memory.peak, memory.activations) for memory in (static, traced, measured))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


class StarvedWorker:
    """An I/O executor whose thread never gets to drop a finished task's arguments (a starved thread, as on a
    loaded machine): it runs each task at once and keeps the task for good (`tasks`)."""

    def __init__(self):
        self.tasks = []

    def submit(self, fn, *args):
        self.tasks.append((fn, args))
        done = concurrent.futures.Future()
        done.set_result(fn(*args))
        return done
