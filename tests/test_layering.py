"""The import graph of fxmem/ and passes/ has no cycle, counting imports inside functions too (a function-local
import that papers over a cycle is still one)."""
import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for fxmem and its passes (shipped as fxmem.passes)."""
    out = {}
    for package in ("fxmem", "passes"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[0] == "passes":
                parts = ["fxmem", *parts]
            out[".".join(parts)] = path
    return out


def imported_modules(module: str, path: Path, known: dict) -> set[str]:
    """The modules of `known` that `module` imports anywhere in its file (the innermost known module a name
    resolves to: `from fxmem.costmodel import trace` is fxmem.costmodel.trace)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:len(module.split(".")) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name] + [f"{name}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name == "passes" or name.startswith("passes."):
                name = "fxmem." + name
            while name and name not in known:
                name = name.rpartition(".")[0]
            # a package importing its own submodules is not an edge back to itself
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


def import_graph() -> nx.DiGraph:
    known = module_files()
    graph = nx.DiGraph()
    for module, path in known.items():
        graph.add_node(module)
        graph.add_edges_from((module, target) for target in imported_modules(module, path, known))
    return graph


def test_the_import_graph_of_fxmem_and_passes_is_acyclic():
    graph = import_graph()
    # the parser found the imports: relative ones, absolute ones of the passes, ones inside functions
    assert graph.number_of_edges() > 100
    assert graph.has_edge("fxmem.api", "fxmem.capture") and graph.has_edge("fxmem.passes.offload", "fxmem.outline")
    assert graph.has_edge("fxmem.cli", "fxmem.modelfile")
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_the_cost_model_sits_above_the_program():
    graph = import_graph()
    below_program = nx.descendants(graph, "fxmem.program")
    assert not any(name.startswith("fxmem.costmodel") for name in below_program), sorted(below_program)
