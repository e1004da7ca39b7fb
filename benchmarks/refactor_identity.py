"""Behaviour identity across a refactoring: dump what fxmem decides and reports on every bundled example, compare.

    python benchmarks/refactor_identity.py --out DIR [--quick] [--examples gpt,unet] [--policies low,high]
                                           [--no-accuracy]
    python benchmarks/refactor_identity.py --compare DIR_A DIR_B

Dump: for every example in examples/ (loaded as the CLI loads a model file) and every preset policy, torch seeded
before each, `fxmem.transform` (measure=False) and one canonical JSON file per (example, policy): the estimates
before and after, every pass record (status, changes with their nodes and bytes, notes, metrics, reason), the
deterministic report JSON (no wall-clock timings), the transformed module's generated code (root and every graph
submodule) and its state_dict (keys, shapes, dtypes, a hash of the values). Per example also the static and
traced estimates of the captured program (train and inference) and its per-node costs. Unless --no-accuracy,
`benchmarks/costmodel_accuracy.py` runs too and its table, without the timing columns, is kept.

--quick runs the policies low and high only (it leaves out medium, inference and their passes: precision's bf16
and int8 rewrites, the 8-bit optimizer's estimates, inference-mode transforms).

--compare exits 1 on any difference and prints the first ones; 0 when the two dumps are identical. Every file of
DIR_B is compared with DIR_A's; DIR_B may hold fewer (a --quick dump against a full one): the files of DIR_A it
leaves out are counted in the last line, a file of DIR_B that DIR_A lacks is a difference.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

EXAMPLES = ["gpt", "hf_llama", "hf_gpt2", "hf_bert", "gcn", "gat", "gnn_stan", "unet", "vit", "mlp_digits"]
POLICIES = ["low", "medium", "high", "inference"]
QUICK_POLICIES = ["low", "high"]
CALIBRATION_BATCHES = 8  # the CLI takes up to 64; 8 is every example's default and keeps the dump quick
ADDRESS = re.compile(r"\b(at|object at) 0x[0-9a-fA-F]{6,}")


def canonical(value):
    """JSON-ready and deterministic: sorted keys, tuples as lists, tensors as summaries, addresses scrubbed."""
    if isinstance(value, dict):
        return {str(key): canonical(item) for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(item) for item in value]
    if isinstance(value, set):
        return sorted(canonical(item) for item in value)
    if isinstance(value, torch.Tensor):
        return tensor_summary(value)
    if isinstance(value, str):
        return ADDRESS.sub(r"\1 0x...", value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if hasattr(value, "to_dict"):
        return canonical(value.to_dict())
    return ADDRESS.sub(r"\1 0x...", repr(value))


def tensor_summary(tensor: torch.Tensor) -> dict:
    data = tensor.detach().cpu().contiguous().reshape(-1)
    raw = data.view(torch.uint8) if data.numel() and data.dtype != torch.bool else data.to(torch.uint8)
    digest = hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype), "sha256": digest}


def without_timings(value):
    """The same structure with wall-clock keys (`seconds`, `*_s`, `*_ms`: fxmem.report.is_timing_key) removed at
    every depth."""
    from fxmem.report import is_timing_key
    if isinstance(value, dict):
        return {key: without_timings(item) for key, item in value.items() if not is_timing_key(key)}
    if isinstance(value, list):
        return [without_timings(item) for item in value]
    return value


def module_code(module) -> dict:
    """Generated code of the root GraphModule and of every GraphModule under it, by qualified name."""
    from torch import fx
    return {name or "<root>": sub.code for name, sub in module.named_modules() if isinstance(sub, fx.GraphModule)}


def state_summary(module) -> dict:
    out = {}
    for key, value in module.state_dict().items():
        out[key] = tensor_summary(value) if isinstance(value, torch.Tensor) else repr(value)
    return out


def load_example(name: str):
    from fxmem.modelfile import load_model_file
    torch.manual_seed(0)
    return load_model_file(ROOT / "examples" / f"{name}.py")


def dump_transform(name: str, policy: str) -> dict:
    import fxmem
    model_file = load_example(name)
    calibration = model_file.calibration(limit=CALIBRATION_BATCHES)
    torch.manual_seed(0)
    result = fxmem.transform(model_file.model, model_file.args, model_file.kwargs, policy=policy,
                             calibration=calibration, loss_fn=model_file.loss_fn, measure=False,
                             model_file=model_file.module)
    report = json.loads(result.report.to_json(deterministic=True))
    return canonical({
        "example": name, "policy": policy,
        "before": result.before.to_dict(), "after": result.after.to_dict(),
        "records": [without_timings(record.to_dict(with_timing=False)) for record in result.records],
        "report": without_timings(report),
        "code": module_code(result.module),
        "state_dict": state_summary(result.module),
    })


def dump_estimates(name: str) -> dict:
    import fxmem
    from fxmem.costmodel import node_costs
    model_file = load_example(name)
    out = {"example": name}
    for mode in ("train", "inference"):
        torch.manual_seed(0)
        program = fxmem.capture(model_file.model, model_file.args, model_file.kwargs, mode=mode)
        program.refresh()
        for method in ("static", "traced"):
            estimate = fxmem.estimate(program, mode=mode, method=method, loss_fn=model_file.loss_fn)
            out[f"{mode}/{method}"] = estimate.to_dict()
        loss_fn = model_file.loss_fn if mode == "train" else None
        costs = node_costs(program, mode=mode, loss_fn=loss_fn)
        out[f"{mode}/node_costs"] = {node: vars(cost) for node, cost in costs.items()}
    return canonical(out)


def accuracy_rows(out_dir: pathlib.Path) -> list:
    """costmodel_accuracy.py's table without its timing columns (static s, traced s)."""
    from benchmarks import costmodel_accuracy
    scratch = out_dir / "costmodel_accuracy"
    costmodel_accuracy.main(["--out", str(scratch)])
    text = (scratch / "costmodel_accuracy.md").read_text()
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row[:-2]] for row in rows]


def write_json(path: pathlib.Path, value) -> None:
    path.write_text(json.dumps(value, indent=1, sort_keys=True, allow_nan=False) + "\n")


def run_dump(args) -> int:
    warnings.filterwarnings("ignore")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",") if args.policies else (QUICK_POLICIES if args.quick else POLICIES)
    for name in args.examples.split(","):
        started = time.perf_counter()
        write_json(out_dir / f"{name}.estimates.json", dump_estimates(name))
        print(f"{name:11s} estimates {time.perf_counter() - started:7.1f} s", flush=True)
        for policy in policies:
            started = time.perf_counter()
            write_json(out_dir / f"{name}.{policy}.json", dump_transform(name, policy))
            print(f"{name:11s} {policy:9s} {time.perf_counter() - started:7.1f} s", flush=True)
    if not args.no_accuracy:
        write_json(out_dir / "costmodel_accuracy.json", accuracy_rows(out_dir))
    return 0


def first_differences(left, right, where: str = "", limit: int = 20) -> list[str]:
    """Paths at which two JSON values differ (at most `limit`)."""
    found: list[str] = []

    def walk(a, b, path):
        if len(found) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if key not in a or key not in b:
                    found.append(f"{path}/{key}: only in {'A' if key in a else 'B'}")
                else:
                    walk(a[key], b[key], f"{path}/{key}")
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                found.append(f"{path}: {len(a)} items in A, {len(b)} in B")
            for index, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{index}]")
        elif a != b:
            found.append(f"{path}: A {str(a)[:200]!r} != B {str(b)[:200]!r}")
    walk(left, right, where)
    return found


def compare(dir_a: str, dir_b: str) -> int:
    left, right = pathlib.Path(dir_a), pathlib.Path(dir_b)
    names_a = {p.name for p in left.glob("*.json")}
    names_b = {p.name for p in right.glob("*.json")}
    if not names_b:
        print(f"{dir_b}: no dump files")
        return 1
    problems = [f"{name}: only in {dir_b}" for name in sorted(names_b - names_a)]
    for name in sorted(names_a & names_b):
        a, b = json.loads((left / name).read_text()), json.loads((right / name).read_text())
        if a != b:
            problems += [f"{name}{line}" for line in first_differences(a, b)]
    for line in problems[:40]:
        print(line)
    if problems:
        print(f"DIFFERENT: {len(problems)} difference(s) listed (at most 20 per file)")
        return 1
    left_out = len(names_a - names_b)
    print(f"identical: {len(names_b)} file(s)" + (f" ({left_out} file(s) of {dir_a} not in {dir_b}, not compared)"
                                                   if left_out else ""))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory to write the dump to")
    parser.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"))
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--policies", default="", help="comma-separated presets (default: all four)")
    parser.add_argument("--quick", action="store_true", help="policies low and high only")
    parser.add_argument("--no-accuracy", action="store_true", help="skip benchmarks/costmodel_accuracy.py")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("--out DIR or --compare DIR_A DIR_B")
    return run_dump(args)


if __name__ == "__main__":
    sys.exit(main())
