"""The package layout holds: the import graph of ``planner/`` read from the source (AST), every import counted,
including those inside functions (only ``if TYPE_CHECKING:`` blocks are left out: they never run).

1. no cycles between modules;
2. the pure core (cost model, simulator, placers, search, the op graph, the roofline) imports no torch, rich,
   typer, runtime, profiling, application layer or CLI;
3. only ``planner.report`` and ``planner.cli`` import rich (one renderer);
4. the core plans a synthetic case in a subprocess where importing torch, rich or typer fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "planner"
CORE = ("planner.partition", "planner.graph", "planner.roofline")
CORE_MAY_NOT_IMPORT = ("torch", "rich", "typer", "planner.runtime", "planner.profile", "planner.app",
                       "planner.cli", "planner.report", "planner.data", "planner.examples")
RENDERERS = ("planner.report", "planner.cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    """Every module name imported anywhere in ``path`` (relative imports resolved), except under TYPE_CHECKING."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _graph() -> tuple[nx.DiGraph, dict[str, set[str]]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    external: dict[str, set[str]] = {}
    for name, path in modules.items():
        external[name] = set()
        for imported in _imports(path):
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target.startswith("planner"):
                if target != name:
                    graph.add_edge(name, target)
            else:
                external[name].add(imported.split(".")[0])
    return graph, external


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_import_graph_has_no_cycles() -> None:
    graph, _ = _graph()
    # A package's __init__ importing its own submodules is how packages expose names, not a cycle.
    edges = [(a, b) for a, b in graph.edges if not (b.startswith(a + ".") or a.startswith(b + "."))]
    cycles = list(nx.simple_cycles(nx.DiGraph(edges)))
    assert cycles == [], f"import cycles: {cycles[:5]}"


def test_the_pure_core_imports_no_torch_terminal_or_runtime() -> None:
    graph, external = _graph()
    core = [m for m in graph.nodes if _in(m, CORE)]
    assert len(core) > 15  # the test must see the core: partition/{model,sim,placers,search}, graph, roofline
    reached = set(core) | {d for m in core for d in nx.descendants(graph, m)}
    bad_modules = sorted(m for m in reached if _in(m, CORE_MAY_NOT_IMPORT))
    bad_packages = sorted({(m, pkg) for m in reached for pkg in external.get(m, ()) if pkg in ("torch", "rich", "typer")})
    assert bad_modules == [], f"the core reaches {bad_modules}"
    assert bad_packages == [], f"the core (or what it imports) imports {bad_packages}"


def test_only_the_report_package_and_the_cli_import_rich() -> None:
    _, external = _graph()
    importers = sorted(m for m, pkgs in external.items() if "rich" in pkgs and not _in(m, RENDERERS))
    assert importers == []


@pytest.mark.slow  # plans 48 layers on 12 devices with every method in a fresh process: outside the fast tier
def test_the_core_plans_in_a_process_where_torch_rich_and_typer_cannot_be_imported() -> None:
    script = textwrap.dedent("""
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "rich", "typer"):
                    raise ImportError(f"{name} is blocked in this test")
                return None

        sys.meta_path.insert(0, Refuse())
        sys.path.insert(0, "bench")
        from synthetic import synthetic_cluster, transformer_like
        from planner.partition import partition
        from planner.partition.validate import validate_plan

        profile = transformer_like(48, seed=1)
        cluster = synthetic_cluster(6, per_host=3)  # two hosts, two device types (12 devices: 3x the time, same imports)
        for method in ("greedy", "dp", "ilp", "uniform"):
            plan = partition(profile, cluster, method=method, microbatches=8, schedule="1f1b", refine=method == "greedy")
            assert validate_plan(plan, profile, cluster) == [], method
        assert not any(m.split(".")[0] in ("torch", "rich", "typer") for m in sys.modules)
        print("planned", len(plan.stages))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("planned")
