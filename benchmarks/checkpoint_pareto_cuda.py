"""The device side of `benchmarks/checkpoint_pareto.py --device cuda`: each model at the batch its estimate picks,
a time limit shared among the models that leaves out (with a note) what would start after it, timing with the
device synchronized, and the CUDA caching allocator's counts of every row's step, compiled ones included.

`DeviceRun` is what `checkpoint_pareto.run_model` asks for these; it runs on CPU too (tests: tiny shapes), where
the allocator's columns are absent.
"""
from __future__ import annotations

import copy
import importlib
import time
import traceback

import torch

import fxmem
from benchmarks.cuda_measure import Deadline, step_peak, to_device
from fxmem.units import format_bytes

# per model: build_model and example_inputs arguments (the batch is chosen by the estimate)
SHAPES = {"gpt": (dict(n_layer=6, n_head=8, d_model=512, block_size=512), dict(seq_len=512)),
          "unet": (dict(base=64), dict(size=128))}
TARGET = "4GiB"  # the estimated eager training peak each model's batch is chosen for
MAX_BATCH = 1024  # the U-Net's inputs come from the 1797 digits scikit-learn ships
TIME_LIMIT_S = 270.0
WRITE_S = 15.0  # kept back from the limit for the report and the plot
SETUP_S = 30.0  # a model's two captures, its estimates and the anchors' build: a model starts only if these fit
# seconds a method of each kind is assumed to take until one of its kind has run on this model (then: the most
# one took); cold torch.compile runs are the long ones, and the fitted rows (about eight plans, each partitioned)
FIRST_GUESS_S = {"fxmem": 10.0, "compile": 45.0, "stack": 45.0, "stack_at_b": 45.0, "bytes": 10.0,
                 "bytes_stack": 45.0, "fit_stack": 90.0, "fit_stack_flops": 90.0,
                 "fit_timed": 180.0}
# what one row costs once built, from the eager step time: fixed seconds (copies, fxmem.measure's dispatch-mode
# overhead), steps beyond the timed rounds (warm-ups, fxmem.measure's two, the allocator's two, the hooks'
# forward), and a factor for steps that recompute
ROW_FIXED_S, ROW_EXTRA_STEPS, ROW_STEP_FACTOR = 1.0, 8, 1.5


def batch_for_peak(ex, model, input_kwargs: dict, target: int, device) -> tuple[int, int]:
    """The largest batch (up to MAX_BATCH) whose estimated training peak (fxmem.estimate, AdamW, the example's
    loss) is at most `target` bytes, and that peak: `model` captured at batch 2 on `device`, the batch scaled by
    fxmem.plan_batch with no reserve."""
    program = fxmem.capture(model, to_device(ex.example_inputs(batch=2, **input_kwargs), device))
    plan = fxmem.plan_batch(program, budget=target, loss_fn=ex.loss_fn, device=str(device), context_bytes=0,
                            fragmentation=0.0, max_batch=MAX_BATCH)
    if plan["batch"] == 0:
        raise ValueError(f"{ex.__name__}: batch 1 already has an estimated peak of {format_bytes(plan['peak'])}, "
                         f"over the target {format_bytes(target)}")
    return plan["batch"], plan["peak"]


def allocator_columns(make_step, module) -> dict:
    """The CUDA allocator on the second step of `make_step(after_forward)` (the optimizer's state exists by then),
    which trains `module`: its peak above the step's start, and what is allocated once the loss is computed, above
    the same start. The start holds parameters, optimizer state and whatever else is on the device, no gradients."""
    after_forward = []
    step = make_step(lambda: after_forward.append(torch.cuda.memory_allocated()))
    step()
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    peak = step_peak(step)
    module.zero_grad(set_to_none=True)
    return {"alloc_peak": peak, "alloc_acts": after_forward[-1] - start}


def one_line(error: BaseException) -> str:
    text = str(error).splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


class DeviceRun:
    """checkpoint_pareto on `device`: models at the batch their estimate picks (`shapes`, `target` bytes), under a
    limit of `seconds` for the whole run, split evenly among the models left when each starts."""

    def __init__(self, device, seconds: float, *, target: int, rounds: int, shapes: dict = SHAPES):
        self.device = torch.device(device)
        self.limit = Deadline(seconds - WRITE_S)
        self.deadline = self.limit
        self.target, self.rounds, self.shapes = target, rounds, shapes
        self.took: dict[str, float] = {}  # the most seconds a method of each kind took on this model
        self.row_s = ROW_FIXED_S

    def start_model(self, models_left: int) -> bool:
        """Give the next model its share of the time left; False when its setup does not fit in it."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.deadline = Deadline(self.limit.left() / models_left)
        self.took = {}
        return self.deadline.allows(SETUP_S)

    def setup(self, name: str):
        """(example module, model, inputs, a note on the size) for `name` on the device."""
        ex = importlib.import_module(f"examples.{name}")
        model_kwargs, input_kwargs = self.shapes[name]
        model = ex.build_model(**model_kwargs).to(self.device)
        batch, _ = batch_for_peak(ex, model, input_kwargs, self.target, self.device)
        x = to_device(ex.example_inputs(batch=batch, **input_kwargs), self.device)
        shape = " ".join(f"{k}={v}" for k, v in {**model_kwargs, **input_kwargs}.items())
        return ex, model, x, (f"{shape} batch={batch}, the largest batch estimated to fit "
                              f"{format_bytes(self.target)}")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def calibrate(self, step) -> None:
        """What a row costs once built (memory and timing), from the eager `step()`: the best of three after a
        warm-up."""
        step()
        times = []
        for _ in range(3):
            self.sync()
            started = time.monotonic()
            step()
            self.sync()
            times.append(time.monotonic() - started)
        self.row_s = ROW_FIXED_S + (self.rounds + ROW_EXTRA_STEPS) * ROW_STEP_FACTOR * min(times)

    def allows(self, kind: str, rows: int) -> bool:
        """Whether building a `kind` method, then measuring and timing `rows` rows, fits the model's time left."""
        return self.deadline.allows(self.took.get(kind, FIRST_GUESS_S[kind]) + rows * self.row_s)

    def timed(self, kind: str, key: str, build) -> dict[str, str]:
        """Run `build()` and note how long a `kind` method took; {key: why} if it failed (printed; the run goes
        on without that row), else {}."""
        started = time.monotonic()
        try:
            build()
        except Exception as e:  # noqa: BLE001 - one compile or pass failing must not lose the other rows
            traceback.print_exc()
            return {key: f"failed: {one_line(e)}"}
        finally:
            self.took[kind] = max(self.took.get(kind, 0.0), time.monotonic() - started)
        return {}

    def allocator_extra(self, bench, step_fn):
        """checkpoint_pareto.memory_rows' extra columns: on CUDA the allocator's counts of a step of each row
        (`step_fn` builds it; a compiled row's own module, a copy of any other); None elsewhere."""
        if self.device.type != "cuda":
            return None

        def extra(key, module):
            own = module if "compile" in key else copy.deepcopy(module)
            return allocator_columns(lambda after: step_fn(own, bench.x, bench.loss_fn, after), own)
        return extra
