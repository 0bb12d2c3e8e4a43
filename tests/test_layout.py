"""The package is src/disagg/, laid out as it is imported, and its dependencies point one way:
cli -> planner -> router -> serving -> kv_transfer / kv_state / tools -> engine -> model -> kernels,
proto. Every `disagg.*` import of every module (at the top, under TYPE_CHECKING or inside a
function) is checked, imports are absolute, and no two modules import each other in a ring. And
tests/ mirrors the packages: tests/worker/engine holds the tests of src/disagg/worker/engine.

`python tests/test_layout.py` prints the layer table (the test prints it too, shown with -s)."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = "src"  # the folder that holds the package `disagg`

# Lower layers never import higher ones; packages on one layer do not import each other.
LAYERS: dict[str, int] = {
    "disagg.proto": 0,
    "disagg.kernels": 0,
    "disagg.worker.model": 1,
    "disagg.worker.engine": 2,
    "disagg.worker.tools": 3,
    "disagg.worker.kv_transfer": 3,
    "disagg.worker.kv_state": 3,
    "disagg.worker.serving": 4,
    "disagg.worker.router": 5,
    "disagg.worker.planner": 6,  # it simulates the router's and the workers' policies
    "disagg.worker.cli": 7,
    "disagg.operator": 7,
}
# The package's own modules outside the layers: `disagg` and `disagg.worker` only name the packages.
UNLAYERED = ["disagg", "disagg.worker"]
# Folders of tests/ that stand for no package: tests/cluster runs the operator on a real cluster.
NOT_MIRRORED = ("cluster",)
# Packages outside the product, mirrored in tests/ as the product's are: hack/node (the real-node
# rig) is tested in tests/hack/node.
TOOLING = ("hack",)
# The operator image carries no torch: of the worker it may use only these torch-free modules.
OPERATOR_MAY_IMPORT = (
    "disagg.worker.cli.flags",
    "disagg.worker.engine.args",
    "disagg.worker.kv_state.keys",
    "disagg.worker.model.precisions",
    "disagg.worker.router.args",
    "disagg.worker.serving.args",
    "disagg.worker.serving.process_args",
)


def _package(module: str) -> str | None:
    best = None
    for pkg in LAYERS:
        if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best)):
            best = pkg
    return best


def _modules() -> dict[str, Path]:
    """Every module of the package by its import name, read from its path under src/."""
    found = {}
    src = ROOT / SRC
    for path in (src / "disagg").rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = [p for p in path.relative_to(src).with_suffix("").parts if p != "__init__"]
        found[".".join(parts)] = path
    return found


def _import_nodes(path: Path) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import | ast.ImportFrom)]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in out if m.startswith("disagg.")}


def violations() -> list[str]:
    modules = _modules()
    bad = []
    for module, path in modules.items():
        here = _package(module)
        for imported in _imports(path):
            there = _package(imported)
            if there is None or there == here:
                continue
            if here == "disagg.operator":
                if there.startswith("disagg.worker") and not imported.startswith(OPERATOR_MAY_IMPORT):
                    bad.append(
                        f"{module} imports {imported}: the operator may use only {OPERATOR_MAY_IMPORT}"
                    )
                continue
            if there == "disagg.operator" and module != "disagg.worker.cli":
                bad.append(f"{module} imports {imported} (the operator)")
            elif LAYERS[there] >= LAYERS[here] and there != "disagg.operator":
                bad.append(f"{module} (layer {LAYERS[here]}) imports {imported} (layer {LAYERS[there]})")
    return sorted(bad)


def relative_imports() -> list[str]:
    return sorted(
        f"{module}: from {'.' * node.level}{node.module or ''} import ..."
        for module, path in _modules().items()
        for node in _import_nodes(path)
        if isinstance(node, ast.ImportFrom) and node.level
    )


def module_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports: `from pkg import name` is an edge to the module
    pkg.name where there is one, else to pkg."""
    modules = _modules()

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in _import_nodes(path):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges |= {owner(n) for n in names if n.startswith("disagg.")}
        graph[module] = edges - {"", module}
    return graph


def cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The rings of the module graph (its strongly connected components of two or more modules,
    Tarjan's algorithm), each sorted. A module that imports a name of its own package's `__init__`
    is not a ring with it."""
    graph = {m: {e for e in es if not m.startswith(e + ".")} for m, es in (graph or module_graph()).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                ring.append(w)
                if w == v:
                    break
            if len(ring) > 1:
                found.append(sorted(ring))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_table() -> str:
    """Per package, lowest layer first: its modules, lines, and the packages it imports."""
    modules = _modules()
    by_package: dict[str, list[str]] = defaultdict(list)
    for module in modules:
        if (pkg := _package(module)) is not None:
            by_package[pkg].append(module)
    graph = module_graph()
    uses: dict[str, set[str]] = defaultdict(set)
    for module, edges in graph.items():
        here = _package(module)
        for e in edges:
            there = _package(e)
            if here and there and there != here:
                uses[here].add(there)
    rows = [f"{'layer':>5}  {'package':<28}{'modules':>8}{'lines':>8}  imports"]
    for pkg in sorted(LAYERS, key=lambda p: (LAYERS[p], p)):
        lines = sum(len(modules[m].read_text().splitlines()) for m in by_package[pkg])
        used = ", ".join(p.removeprefix("disagg.") for p in sorted(uses[pkg], key=lambda p: (LAYERS[p], p)))
        rows.append(f"{LAYERS[pkg]:>5}  {pkg:<28}{len(by_package[pkg]):>8}{lines:>8}  {used or '-'}")
    edges = sum(len(v) for v in uses.values())
    rows.append(
        f"{len(LAYERS)} packages, {edges} package-to-package imports, {len(cycles(graph))} module rings"
    )
    return "\n".join(rows)


def test_every_module_belongs_to_a_layer():
    assert sorted(m for m in _modules() if _package(m) is None) == UNLAYERED


def test_dependencies_point_one_way():
    print("\n" + layer_table())
    assert violations() == []


def test_imports_are_absolute():
    assert relative_imports() == []


def test_no_two_modules_import_each_other():
    assert cycles() == []


def _fake_package(tmp_path: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = tmp_path / SRC / "disagg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """A lazy import of router code from the engine is caught like a top-level one."""
    _fake_package(
        tmp_path,
        {
            "worker/engine/__init__.py": "",
            "worker/engine/bad.py": "def f():\n    from disagg.worker.router.app import Router\n",
        },
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations() == [
        "disagg.worker.engine.bad (layer 2) imports disagg.worker.router.app (layer 5)",
        "disagg.worker.engine.bad (layer 2) imports disagg.worker.router.app.Router (layer 5)",
    ]


def test_the_checks_see_a_ring_and_a_relative_import(tmp_path, monkeypatch):
    _fake_package(
        tmp_path,
        {
            "worker/model/__init__.py": "from disagg.worker.model import a\n",  # a re-export: no ring
            "worker/model/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from disagg.worker.model.b import B\n",
            "worker/model/b.py": "from disagg.worker.model import a\nfrom .a import x\n",
        },
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert cycles() == [["disagg.worker.model.a", "disagg.worker.model.b"]]
    assert relative_imports() == ["disagg.worker.model.b: from .a import ..."]


def unmirrored() -> list[str]:
    """The folders of tests/ with test files whose path under tests/ is no package folder of the
    product (tests/worker/engine mirrors src/disagg/worker/engine, tests/operator/autoscaling
    src/disagg/operator/autoscaling) or of the tooling (tests/hack/node mirrors hack/node);
    tests/ itself holds the tests of the whole."""
    tests = ROOT / "tests"
    folders = {path.parent.relative_to(tests) for path in tests.rglob("test_*.py")}

    def mirrors(folder: Path) -> bool:
        base = ROOT if folder.parts[0] in TOOLING else ROOT / SRC / "disagg"
        return (base / folder / "__init__.py").is_file()

    return sorted(
        f"tests/{folder.as_posix()}"
        for folder in folders
        if folder.parts and folder.parts[0] not in NOT_MIRRORED and not mirrors(folder)
    )


def test_tests_mirror_the_packages():
    assert unmirrored() == []


def test_the_mirror_check_sees_a_test_folder_with_no_package(tmp_path, monkeypatch):
    for package in (f"{SRC}/disagg/worker/engine", f"{SRC}/disagg/operator", "hack/node", "docs/engine"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    folders = (
        "",
        "worker/engine",
        "operator",
        "hack/node",
        "cluster",
        "worker/foo",
        "foo",
        "docs/engine",
        "worker",
    )
    for folder in folders:
        (tmp_path / "tests" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / folder / "test_x.py").write_text("")
    (tmp_path / "tests" / "worker" / "bar").mkdir()
    (tmp_path / "tests" / "worker" / "bar" / "helpers.py").write_text("")  # no test files
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert unmirrored() == ["tests/docs/engine", "tests/foo", "tests/worker", "tests/worker/foo"]


if __name__ == "__main__":
    print(layer_table())
