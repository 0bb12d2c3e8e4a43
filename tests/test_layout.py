"""Dependencies point one way: cli -> router -> serving -> kv_transfer / kv_state -> engine -> model
-> kernels. Every `disagg.*` import of every module (at the top or inside a function) is checked.
And tests/ mirrors the packages: tests/worker/engine holds the tests of worker/engine."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "worker": "disagg.worker",
    "kernels": "disagg.kernels",
    "proto": "disagg.proto",
    "operator": "disagg.operator",
}

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
# Folders of tests/ that stand for no package: tests/cluster runs the operator on a real cluster.
NOT_MIRRORED = ("cluster",)
# Packages outside the product's layers, mirrored in tests/ as the product's are: hack/node (the
# real-node rig) is tested in tests/hack/node.
TOOLING = ("hack",)
# The operator image carries no torch: of the worker it may use only these torch-free modules.
OPERATOR_MAY_IMPORT = (
    "disagg.worker.engine.args",
    "disagg.worker.kv_state.keys",
    "disagg.worker.model.precisions",
    "disagg.worker.router.args",
    "disagg.worker.serving.args",
)


def _package(module: str) -> str | None:
    best = None
    for pkg in LAYERS:
        if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best)):
            best = pkg
    return best


def _modules() -> dict[str, Path]:
    found = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([name, *parts])] = path
    return found


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
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


def test_every_module_belongs_to_a_layer():
    # disagg.worker itself only re-exports the engine's public names, lazily
    assert [m for m in _modules() if _package(m) is None] == ["disagg.worker"]


def test_dependencies_point_one_way():
    assert violations() == []


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """A lazy import of router code from the engine is caught like a top-level one."""
    engine = tmp_path / "worker" / "engine"
    engine.mkdir(parents=True)
    (engine / "__init__.py").write_text("")
    (engine / "bad.py").write_text("def f():\n    from disagg.worker.router.app import Router\n")
    for folder in ("kernels", "proto", "operator"):
        (tmp_path / folder).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations() == [
        "disagg.worker.engine.bad (layer 2) imports disagg.worker.router.app (layer 5)",
        "disagg.worker.engine.bad (layer 2) imports disagg.worker.router.app.Router (layer 5)",
    ]


def unmirrored() -> list[str]:
    """The folders of tests/ with test files whose path under tests/ is no package folder of the
    product (tests/worker/engine mirrors worker/engine, tests/operator/autoscaling
    operator/autoscaling); tests/ itself holds the tests of the whole."""
    tests = ROOT / "tests"
    folders = {path.parent.relative_to(tests) for path in tests.rglob("test_*.py")}
    return sorted(
        f"tests/{folder.as_posix()}"
        for folder in folders
        if folder.parts
        and folder.parts[0] not in NOT_MIRRORED
        and not (folder.parts[0] in (*FOLDERS, *TOOLING) and (ROOT / folder / "__init__.py").is_file())
    )


def test_tests_mirror_the_packages():
    assert unmirrored() == []


def test_the_mirror_check_sees_a_test_folder_with_no_package(tmp_path, monkeypatch):
    for package in ("worker/engine", "operator", "docs/engine"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    for folder in ("", "worker/engine", "operator", "cluster", "worker/foo", "foo", "docs/engine", "worker"):
        (tmp_path / "tests" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / folder / "test_x.py").write_text("")
    (tmp_path / "tests" / "worker" / "bar").mkdir()
    (tmp_path / "tests" / "worker" / "bar" / "helpers.py").write_text("")  # no test files
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert unmirrored() == ["tests/docs/engine", "tests/foo", "tests/worker", "tests/worker/foo"]
