"""The registry of passes: one table, written by `fxmem.pass_api.register`, read by the PassManager (which passes
exist and in which order they run) and by the policy (which `passes.NAME` sections exist and the options class each
section is validated against).

The product's passes live in `fxmem.passes` (`passes/` in the source tree) and run in CANONICAL_ORDER. A pass
outside that order (an extra pass: an example, a test, a user's own) registers the same way and runs after the
canonical ones, in name order.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# rewrites that change what exists come first; the budget passes come last, so they plan on the final graph
CANONICAL_ORDER: tuple[str, ...] = ("attention", "pruning", "gating", "precision", "checkpoint", "offload")

# passes that plan against the peak budget with what the passes before them left: a budget pass that runs before
# one of them may stop short of the budget instead of failing (checkpoint before offload)
TAKES_BUDGET_REST: frozenset[str] = frozenset({"offload"})

# passes that read the budget (the others make the same changes whatever it is, e.g. at another batch size)
BUDGET_PASSES: tuple[str, ...] = ("checkpoint", "offload")


@dataclass(frozen=True)
class Registration:
    """One registered name: its pass class and the options class its policy section is validated against."""

    name: str
    pass_class: type | None  # None: a section with options and no pass (the policy's own tests, tools)
    options: type | None  # a dataclass; None: the section takes no options
    extra: bool = False  # outside CANONICAL_ORDER: runs after the canonical passes
    exact: bool = True  # the pass keeps outputs, gradients and buffers equal (verified)
    exact_for: Callable[[Any], bool] | None = None  # exactness that depends on the options (the pass's is_exact)

    def is_exact(self, options: Any) -> bool:
        return bool(self.exact_for(options)) if self.exact_for is not None else self.exact


REGISTRY: dict[str, Registration] = {}
LOAD_ERRORS: dict[str, str] = {}  # pass name -> why its module failed to import
_loaded = False


def add(entry: Registration, *, replace: bool = False) -> Registration:
    """Record `entry`. Another options class for a name that has one needs replace=True."""
    old = REGISTRY.get(entry.name)
    if old is not None and old.options is not None and entry.options is not None \
            and old.options is not entry.options and not replace:
        raise ValueError(f"pass {entry.name!r} already has options class {old.options.__qualname__}; "
                         f"pass replace=True to replace it")
    REGISTRY[entry.name] = entry
    return entry


def set_options(name: str, options: type | None, *, replace: bool = False) -> None:
    """Give `name` an options class (None: take it away), keeping its pass class if it has one."""
    old = REGISTRY.get(name)
    if old is None:
        if options is not None:
            add(Registration(name, None, options, extra=name not in CANONICAL_ORDER))
        return
    if options is None and old.pass_class is None:
        del REGISTRY[name]
        return
    add(dataclasses.replace(old, options=options), replace=replace or options is None)


def options_class(name: str) -> type | None:
    entry = REGISTRY.get(name)
    return entry.options if entry is not None else None


def pass_class(name: str) -> type | None:
    entry = REGISTRY.get(name)
    return entry.pass_class if entry is not None else None


def known_passes() -> tuple[str, ...]:
    """The names a policy may have a section for: the canonical ones, then the registered extra ones, sorted."""
    return CANONICAL_ORDER + tuple(sorted(n for n in REGISTRY if n not in CANONICAL_ORDER))


def budget_rest_taken(names, after: str | None = None) -> bool:
    """Whether a pass in `names` (after `after` in that sequence, when given) takes the rest of the budget."""
    names = list(names)
    later = names[names.index(after) + 1:] if after in names else names
    return any(name in TAKES_BUDGET_REST for name in later)


# ============================================================================================ loading
def _passes_package():
    """`fxmem.passes`: the installed package, or `passes/` of the source tree."""
    try:
        return importlib.import_module("fxmem.passes")
    except ModuleNotFoundError:
        src = Path(__file__).resolve().parent.parent / "passes"
        if not (src / "__init__.py").exists():
            raise
        spec = importlib.util.spec_from_file_location("fxmem.passes", src / "__init__.py",
                                                      submodule_search_locations=[str(src)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["fxmem.passes"] = pkg
        spec.loader.exec_module(pkg)
        return pkg


def pass_module(name: str):
    """One pass's module (`fxmem.passes.<name>`) alone, without importing the others (tests and benchmarks of one
    pass run while another may be mid-edit)."""
    _passes_package()
    return importlib.import_module(f"fxmem.passes.{name}")


def load_passes() -> dict[str, Registration]:
    """Import the pass modules (`fxmem.passes`, which is `passes/` in the source tree); each registers its pass."""
    global _loaded
    if _loaded:
        return REGISTRY
    where = Path(_passes_package().__path__[0])
    for name in CANONICAL_ORDER:
        if (where / f"{name}.py").exists() or (where / name / "__init__.py").exists():  # a module or a package
            try:
                importlib.import_module(f"fxmem.passes.{name}")
            except Exception as error:  # noqa: BLE001 - one broken pass must not take the others down
                LOAD_ERRORS[name] = f"{type(error).__name__}: {error}"
    _loaded = True
    return REGISTRY
