"""`fxmem optimize | estimate | diff | policies`.

A model file is user code and runs as such, exactly like `python model.py`: only pass files you trust. Exit codes: 0
success, 2 user error (bad policy, model file, inputs, budget, a required budget out of reach, output path, a result
that cannot be written), 3 refused by --strict (a pass failed or was rolled back, a lossy pass did less than its policy
asked, or the result is over its budget), 1 internal error, 130 interrupted (SIGINT), 143 terminated (SIGTERM). An
interrupt or SIGTERM unwinds like an exception, so every cleanup runs: scratch files are removed and `--out` is left as
it was, or holds the complete result. The exit status says which: once the result is complete on disk a signal no longer
changes the outcome (exit 0), and a run that was interrupted before is never reported as a success.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import sysconfig
import threading
import traceback
from pathlib import Path

from .errors import FxmemError

# (each command imports what it uses when it runs: `fxmem --help` and flag errors answer without loading them)

MODEL_FILE_HELP = ("a Python file defining build_model() and example_inputs() (optional loss_fn(output, inputs), "
                   "calibration_data(), evaluate(module) with evaluate_mode = 'max' or 'min'); it is user code and "
                   "runs as such")
_FXMEM_DIR = os.path.dirname(os.path.abspath(__file__))
EXIT_CODES_HELP = ("exit codes: 0 success; 2 user error (policy, model file, inputs, budget, a required budget out "
                   "of reach, output path); 3 refused "
                   "by --strict (a pass failed or was rolled back, a lossy pass did less than its policy asked, or "
                   "the result is over its budget); 1 internal error; 130 interrupted (SIGINT); 143 terminated "
                   "(SIGTERM)")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so the same cleanup runs (`finally`, `except BaseException`,
    context managers: scratch files, the output's temp dir); the CLI then exits 143."""


class _Signals:
    """SIGINT and SIGTERM while a command runs (main thread only). Until the command's outcome is settled they are
    raised (KeyboardInterrupt, `Terminated`) so every cleanup runs; once it is settled (the result it writes is
    complete on disk, or the command has finished) they are only noted, so a result on disk is never reported as
    interrupted, and no traceback comes from a signal that arrives while the process ends."""

    def __init__(self):
        self.output = None  # the OutputDir the command writes into (optimize)
        self.raised: int | None = None  # a signal raised as an exception before the outcome was settled
        self.noted: list[int] = []  # signals that came after
        self.finished = False

    def settled(self) -> bool:
        return self.finished or bool(self.output is not None and self.output.committed)

    def written(self) -> bool:
        return bool(self.output is not None and self.output.committed)

    def handle(self, signum, frame):
        if self.settled():
            self.noted.append(signum)
            return
        self.raised = signum
        raise Terminated() if signum == getattr(signal, "SIGTERM", None) else KeyboardInterrupt()

    @contextlib.contextmanager
    def installed(self, *, for_the_process: bool):
        """Handle SIGINT (unless the process was started ignoring it) and SIGTERM. After the block: the previous
        handlers back, or with `for_the_process` (main() reading sys.argv: the process exits next) both ignored."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {}
        for signal_number in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
            handler = signal.getsignal(signal_number) if signal_number is not None else None
            if handler is None or (signal_number == signal.SIGINT and handler == signal.SIG_IGN):
                continue  # not a Python handler, or an interrupt the parent asked this process to ignore
            old[signal_number] = handler
            signal.signal(signal_number, self.handle)
        try:
            yield
        finally:
            self.finished = True
            for signal_number, handler in old.items():
                signal.signal(signal_number, signal.SIG_IGN if for_the_process else handler)


def main(argv=None) -> int:
    """The command line. `argv=None` reads sys.argv: the process's own command, which ends when main returns, so
    SIGINT and SIGTERM stay ignored after the outcome is decided (a late Ctrl-C cannot turn it into a traceback)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "cmd", None):
        parser.print_help()
        return 2
    args.signals = signals = _Signals()
    with signals.installed(for_the_process=argv is None):
        code, message = _run(args, signals)
    if message:
        print(message, file=sys.stderr)
    late = signals.noted + ([signals.raised] if signals.raised is not None else [])
    if code == 0 and late:  # (a signal raised before the outcome was settled gives 0 only when the result is on disk)
        what = "terminated (SIGTERM)" if late[0] != signal.SIGINT else "interrupted"
        kept = f": the result is complete in {signals.output.shown}" if signals.written() else ""
        print(f"fxmem: {what} after the run had completed{kept}; exit status 0", file=sys.stderr)
    return code


def _run(args, signals: _Signals) -> tuple[int, str]:
    """Run the command: (exit status, the line for stderr). Tracebacks (internal errors) are printed here."""
    code, error = 0, None
    try:
        code = args.func(args)
        signals.finished = True  # the outcome is decided: a signal from here on is noted, not raised
    except BaseException as caught:  # noqa: BLE001 - sorted below
        signals.finished = True
        error = caught
    # what is on disk decides: a complete result is never reported as interrupted, and an interrupt that some code
    # turned into another error (or swallowed) still makes an interrupted run
    if not signals.written() and (signals.raised is not None or isinstance(error, KeyboardInterrupt)):
        term = isinstance(error, Terminated) or signals.raised == getattr(signal, "SIGTERM", None)
        out = signals.output
        unchanged = f" ({out.shown} is unchanged)" if out is not None and out.overwrite else ""
        word = "terminated" if term else "interrupted"
        return (143 if term else 130), f"fxmem: {word}; nothing was written{unchanged}"
    if error is None or isinstance(error, KeyboardInterrupt):
        return code, ""
    if isinstance(error, FxmemError):
        return error.exit_code, f"fxmem: error: {error}"
    if isinstance(error, SystemExit):
        site = _exit_site(error)
        if site is not None:
            return 2, (f"fxmem: error: {site}: the model's code raised SystemExit({error.code!r}) (sys.exit(), exit() "
                       "or quit()) while fxmem ran it; nothing was written")
    traceback.print_exception(error)
    return 1, f"fxmem: internal error: {type(error).__name__}: {error}"


def _exit_site(error: SystemExit) -> str | None:
    """`file:line` of the code outside fxmem and the standard library that raised `error` (the model's code: the
    innermost such frame); None when it is fxmem's own."""
    paths = sysconfig.get_paths()
    stdlib = os.path.abspath(paths["stdlib"]) + os.sep
    installed = tuple(os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib"))
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        filename = os.path.abspath(frame.filename)
        if filename.startswith(_FXMEM_DIR + os.sep):
            return None
        if not filename.startswith(stdlib) or filename.startswith(installed):
            return f"{frame.filename}:{frame.lineno}"
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxmem", description="A model-surgery compiler that makes PyTorch models "
                                     "fit in memory. " + MODEL_FILE_HELP[0].upper() + MODEL_FILE_HELP[1:] + ".",
                                     epilog=EXIT_CODES_HELP)
    sub = parser.add_subparsers(dest="cmd")

    estimate = sub.add_parser("estimate", help="estimate (and optionally measure) the memory of a training step")
    estimate.add_argument("model", help=MODEL_FILE_HELP)
    estimate.add_argument("--mode", choices=["train", "inference"], default="train")
    estimate.add_argument("--optimizer", default="adamw", help="none, sgd, sgd-momentum, adam, adamw, adamw8bit, ...")
    estimate.add_argument("--method", choices=["static", "traced"], default="static")
    estimate.add_argument("--measure", action="store_true", help="also run real steps and show measured bytes")
    estimate.add_argument("--meta", action="store_true", help="build the model on the meta device: sized without "
                          "allocating its weights (a model larger than this machine), not run")
    estimate.add_argument("--budget", help="device budget like 16GiB: print the largest batch that fits")
    estimate.add_argument("--device", default=None,
                          help="device the estimate and budget are for (default: the model's; cuda reserves "
                               "context memory and names what the estimate leaves out there)")
    estimate.add_argument("--world-size", type=int, default=1)
    estimate.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    estimate.add_argument("--json", action="store_true", help="print JSON instead of tables")
    estimate.set_defaults(func=cmd_estimate)

    optimize = sub.add_parser("optimize", help="transform a model under a policy and write the result and a report",
                              epilog=EXIT_CODES_HELP)
    optimize.add_argument("model", help=MODEL_FILE_HELP)
    optimize.add_argument("--policy", default="high", help="preset name (fxmem policies) or a YAML file")
    optimize.add_argument("--budget", help="memory budget: a size like 4GiB or a fraction like 40%% of the baseline "
                          "peak; required (out of reach: exit 2) unless --set budget_strict=false makes it a target")
    optimize.add_argument("--activation-budget", help="activations kept at the end of forward: a size like 1GiB or "
                          "a fraction like 30%% of the baseline's (what torch.compile's activation_memory_budget "
                          "bounds)")
    optimize.add_argument("--out", help="output directory (default: ./fxmem-out/<model name>)")
    optimize.add_argument("--overwrite", action="store_true",
                          help="replace an existing result of fxmem optimize at --out atomically (never a directory "
                               "holding anything else, nor the working directory or one holding the model or policy "
                               "file)")
    optimize.add_argument("--measure", action="store_true", help="measure memory before/after with real steps")
    optimize.add_argument("--fit", choices=["batch", "length"],
                          help="batch: among the batches whose transformed step fits --budget (a size) by the cost "
                          "model, the one with the most samples/s by its estimate; length: the longest sequence (dim "
                          "1 of the inputs) that fits; the result is transformed and written at that size")
    optimize.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                          help="override a policy key, e.g. passes.checkpoint.solver=greedy (repeatable)")
    optimize.add_argument("--strict", action="store_true",
                          help="a pass that fails or is rolled back, a lossy pass that does less than the policy "
                               "asks, or a result over its budget, is an error: exit 3, nothing is written")
    optimize.add_argument("--json", action="store_true", help="print the report as JSON")
    optimize.add_argument("--quiet", action="store_true")
    optimize.set_defaults(func=cmd_optimize)

    diff = sub.add_parser("diff", help="graph diff of two saved results, or of a saved result and its original (the "
                          "code generated from each result's checked module.json: what fxmem.load loads)")
    diff.add_argument("a", help="a directory written by fxmem optimize")
    diff.add_argument("b", nargs="?", help="another result directory (default: A's original graph)")
    diff.set_defaults(func=cmd_diff)

    policies = sub.add_parser("policies", help="list presets, or show one resolved")
    policies.add_argument("action", nargs="?", choices=["list", "show"], default="list")
    policies.add_argument("name", nargs="?")
    policies.set_defaults(func=cmd_policies)
    return parser


# ============================================================================================ estimate

def cmd_estimate(args) -> int:
    from . import costmodel
    budget = _estimate_budget(args)
    model_file, program = _estimate_program(args)
    estimate = costmodel.estimate(program, mode=args.mode, optimizer=args.optimizer, method=args.method,
                                  loss_fn=model_file.loss_fn, world_size=args.world_size, zero_stage=args.zero_stage,
                                  device=args.device)
    measured = None
    if args.measure:
        from .measure import measure
        from .program import deep_copy
        measured = measure(deep_copy(program.module), model_file.args, model_file.kwargs, mode=args.mode,
                           optimizer=args.optimizer, loss_fn=model_file.loss_fn)
    plan = None
    if budget is not None:
        plan = costmodel.plan_batch(program, budget=budget, mode=args.mode, optimizer=args.optimizer,
                                    loss_fn=model_file.loss_fn, device=estimate.device)
    if args.json:
        out = {"model": str(args.model), "estimate": estimate.to_dict(),
               "specialized": [str(s) for s in program.specialized], "meta": args.meta}
        if measured is not None:
            out["measured"] = measured.to_dict()
        if plan is not None:
            out["plan_batch"] = plan
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    _print_estimate(args, program, estimate, measured, plan)
    return 0


def _estimate_budget(args) -> int | None:
    """The options of `fxmem estimate` checked before any work; the --budget in bytes (None without one)."""
    import torch  # noqa: F401

    from .step import OPTIMIZERS
    from .units import parse_size
    budget = None
    if args.budget is not None:
        try:
            budget = parse_size(args.budget)
        except ValueError as error:
            raise FxmemError(f"--budget: {error}") from None
        if budget <= 0:
            raise FxmemError(f"--budget: a device budget must be more than 0 bytes, got {args.budget!r}")
    if args.optimizer not in OPTIMIZERS:
        raise FxmemError(f"--optimizer: unknown optimizer {args.optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    if args.world_size < 1:
        raise FxmemError(f"--world-size: must be 1 or more, got {args.world_size}")
    if args.meta and args.measure:
        raise FxmemError("--measure: a model built with --meta has no weights to run; drop one of the two")
    return budget


def _estimate_program(args):
    """The model file loaded (on the meta device with --meta) and its program captured and refreshed."""
    from .capture import capture
    from .meta_models import capture_meta
    from .modelfile import check_inputs, load_model_file
    model_file = load_model_file(args.model, on_meta=args.meta)
    if args.meta:
        program = capture_meta(model_file.model, model_file.args, model_file.kwargs, args.mode)
    else:
        check_inputs(model_file, mode=args.mode)
        program = capture(model_file.model, model_file.args, model_file.kwargs, mode=args.mode)
    program.refresh()
    return model_file, program


def _print_estimate(args, program, estimate, measured, plan) -> None:
    """`fxmem estimate`'s table and lines: estimated (and measured) bytes by category, peaks, FLOPs, heaviest
    modules, unknown ops, static dims, the largest batch under --budget."""
    from .units import format_bytes
    head = f"{'':18s}{'estimated (' + estimate.method + ')':>22s}"
    if measured is not None:
        head += f"{'measured':>16s}{'ratio':>8s}"
    print(f"fxmem estimate: {Path(args.model).name}  mode={args.mode}  optimizer={estimate.optimizer}  "
          f"world_size={args.world_size} zero_stage={args.zero_stage}")
    print(head)
    for row in ("params", "buffers", "grads", "optimizer_state", "inputs", "activations", "peak"):
        line = f"{row:18s}{format_bytes(getattr(estimate, row)):>22s}"
        if measured is not None:
            measured_bytes = getattr(measured, row)
            ratio = f"{getattr(estimate, row) / measured_bytes:.3f}" if measured_bytes else "-"
            line += f"{format_bytes(measured_bytes):>16s}{ratio:>8s}"
        print(line)
    if args.meta:
        print(program.notes[-1])
    print(f"peak at: {estimate.peak_at} ({estimate.peak_phase}"
          f"{', ' + estimate.peak_module if estimate.peak_module else ''})")
    if measured is not None:
        print(f"measured peak at: {measured.peak_at} ({measured.peak_phase})")
        if measured.allocator:
            print(measured.allocator_line())
    print(f"FLOPs per step (estimated): forward {estimate.flops_forward:.3g}, "
          f"backward {estimate.flops_backward:.3g}")
    if estimate.by_module:
        print("heaviest modules (bytes saved for backward, estimated):")
        for module, saved in estimate.by_module[:10]:
            print(f"  {format_bytes(saved):>12s}  {module}")
    print("unknown ops: " + (", ".join(estimate.unknown_ops) if estimate.unknown_ops else "none"))
    for note in estimate.notes:
        print(f"note: {note}")
    if program.specialized:
        print("static dims: " + "; ".join(str(s) for s in program.specialized))
    if plan is not None:
        if plan["batch"] == 0:
            print(f"budget {args.budget}: even batch 1 does not fit (estimated peak {format_bytes(plan['peak'])})")
        else:
            print(f"budget {args.budget} ({estimate.device}): largest batch that fits = {plan['batch']} "
                  f"(estimated peak {format_bytes(plan['peak'])}, usable {format_bytes(plan['usable'])})")


# ============================================================================================ optimize

def _flag_budget(flag: str, value: str | None, key: str | None = None) -> str | None:
    """A budget given on the command line, checked now (before any work) and named by the flag the user typed.
    Returned in the exact form the policy reads back; an empty value or `null` is an error, not "no budget"."""
    if value is None:
        return None
    from .units import parse_budget
    try:
        return str(parse_budget(value))
    except ValueError as error:
        raise FxmemError(f"{flag}{f' ({key})' if key else ''}: {error}") from None


def cmd_optimize(args) -> int:
    from .api import transform
    from .output_dir import OutputDir
    from .modelfile import check_inputs, load_model_file
    budget = _flag_budget("--budget", args.budget)
    activation_budget = _flag_budget("--activation-budget", args.activation_budget,
                                     "passes.checkpoint.activation_budget")
    if args.out is not None and not args.out.strip():
        raise FxmemError("--out: the output path is empty; nothing was written")
    out_arg = args.out if args.out else os.path.join("fxmem-out", Path(args.model).stem)
    protect = [("the model file", args.model)]
    if args.policy and os.path.isfile(args.policy):
        protect.append(("the policy file", args.policy))
    # checked and reserved before any work: a run that cannot write its result fails now, not after the transform
    args.signals.output = output_dir = OutputDir(out_arg, overwrite=args.overwrite, protect=protect)
    try:
        model_file = load_model_file(args.model)
        check_inputs(model_file)
        quiet = args.quiet or args.json
        log = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        options = dict(policy=args.policy, activation_budget=activation_budget,
                       calibration=model_file.calibration(limit=64), loss_fn=model_file.loss_fn,
                       evaluate=model_file.evaluator(), measure=args.measure, strict=args.strict, overrides=args.set,
                       log=log, model_file=model_file.module)
        result = (_fitted(model_file, args.fit, budget, options) if args.fit
                  else transform(model_file.model, model_file.args, model_file.kwargs, budget=budget, **options))
        output_dir.write(result)
        _print_summary(args, result, output_dir)
        return 0
    finally:
        output_dir.discard()


def _fitted(model_file, what: str, budget, options: dict):
    """--fit batch|length: the result at the size `fxmem.fit_batch` / `fxmem.fit_length` chooses under the budget,
    its search in the report's notes."""
    from .fit import fit_batch, fit_length
    if budget is None:
        raise FxmemError(f"--fit {what}: give the memory cap with --budget (a size like 16GiB)")
    search = fit_batch if what == "batch" else fit_length
    fit = search(model_file.model, model_file.args, model_file.kwargs, budget=budget, **options)
    fit.result.report.notes.append(fit.summary())
    fit.result.fit_summary = fit.summary()
    return fit.result


def _print_summary(args, result, output_dir) -> None:
    from .intent import coverage_lines, shortfall_lines
    from .units import format_bytes
    if args.json:
        print(result.report.to_json())
        return
    before, after = result.before, result.after
    print(f"\nfxmem optimize: {Path(args.model).name}  policy={result.policy.name}  mode={result.policy.mode}")
    if result.fit_summary:
        print(result.fit_summary)
    for miss in (result.report.budget_miss(), result.report.activation_budget_miss()):
        if miss:
            print(f"OVER BUDGET: {miss}")
    for line in shortfall_lines(result.records):
        print(f"SHORT OF THE POLICY: {line}")
    for line in coverage_lines(result.records):
        print(f"NOT COVERED BY THE POLICY: {line}")
    print(f"{'':18s}{'before':>14s}{'after':>14s}   (estimated, static)")
    for field in ("params", "grads", "optimizer_state", "activations", "peak"):
        print(f"{field:18s}{format_bytes(getattr(before, field)):>14s}{format_bytes(getattr(after, field)):>14s}")
    if result.measured_before is not None:
        print(f"{'peak (measured)':18s}{format_bytes(result.measured_before.peak):>14s}"
              f"{format_bytes(result.measured_after.peak):>14s}")
    for rec in result.records:
        extra = f" — {rec.reason}" if rec.reason else ""
        print(f"  pass {rec.name:11s} {rec.status:12s} {len(rec.changes)} change(s){extra}")
    for line in (result.report.budget_line(), result.report.activation_budget_line()):
        if line:
            print(line)
    print(f"wrote {output_dir.given.rstrip(os.sep)}/ (report.md, report.html, report.json, transformed.py, module)")


# ============================================================================================ diff / policies

def cmd_diff(args) -> int:
    """The code a result's module runs, generated from its checked module.json (what `fxmem.load` loads; the
    transformed.py beside it is a readable copy), against another result's or against its captured original."""
    from .report import diff_text
    from .resultdir import original_code, transformed_code
    result_a = Path(args.a)
    if args.b:
        result_b = Path(args.b)
        text = diff_text(transformed_code(result_a), transformed_code(result_b), f"{result_a}/transformed.py",
                         f"{result_b}/transformed.py")
    else:
        text = diff_text(original_code(result_a), transformed_code(result_a), f"{result_a}/original.py",
                         f"{result_a}/transformed.py")
    print(text if text.strip() else "no differences")
    return 0


def cmd_policies(args) -> int:
    from .pipeline import load_passes
    from .policy_loader import load_policy
    from .policy_presets import list_presets
    load_passes()
    if args.action == "list":
        for name in list_presets():
            pol = load_policy(name)
            print(f"{name:12s} {pol.description}")
        return 0
    if not args.name:
        raise FxmemError("fxmem policies show NAME: name a preset or a YAML file")
    print(load_policy(args.name).dump_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
