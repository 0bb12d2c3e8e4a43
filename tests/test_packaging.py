"""Each image's Python environment, built in a clean virtual environment from the Dockerfile's own
install line: the operator gets no torch or NIXL, the worker no kopf, and neither a dev-only
package (the gRPC modules are generated while the wheel is built)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the Dockerfiles COPY into /src before installing.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "src")


def project_install_line(dockerfile: Path) -> list[str]:
    """The arguments of the Dockerfile's `pip install ".[extra]"` (the project itself)."""
    for line in dockerfile.read_text().splitlines():
        m = re.search(r'pip install (".*?\[\w+\]")', line)
        if m:
            return shlex.split(m.group(1))
    raise AssertionError(f"{dockerfile.name} has no pip install of the project with an extra")


def torch_pin() -> str:
    """The Makefile's torch pin: the CPU build on this machine (images take their CUDA build)."""
    return re.search(r"^TORCH := (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def _venv(tmp: Path, install: list[list[str]]) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*_pb2*.py*"))
        else:
            shutil.copy(path, src / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # the pip script, as the Dockerfiles call it
    pip = [str(venv / "bin" / "pip"), "--disable-pip-version-check", "-q"]
    for args in install:
        subprocess.run([*pip, "install", *args], cwd=src, check=True, timeout=900)
    return venv


def _imports(venv: Path, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=venv).returncode == 0


def _run(venv: Path, *args: str) -> subprocess.CompletedProcess:
    # the venv first, then the system (its C compiler, as on the image); a fresh home for caches
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(venv.parent)}
    return subprocess.run(args, cwd=venv, capture_output=True, text=True, timeout=300, env=env)


def test_each_dockerfile_installs_the_project_with_its_own_extra():
    assert project_install_line(ROOT / "docker" / "operator.Dockerfile") == [".[operator]"]
    assert project_install_line(ROOT / "docker" / "worker.Dockerfile") == [".[worker]"]
    assert project_install_line(ROOT / "docker" / "worker-cpu.Dockerfile") == [".[worker]"]


@pytest.mark.slow
def test_operator_image_environment(tmp_path):
    venv = _venv(tmp_path, [project_install_line(ROOT / "docker" / "operator.Dockerfile")])
    assert _imports(venv, "kopf")
    for absent in ("torch", "nixl", "grpc", "transformers", "pytest"):
        assert not _imports(venv, absent), f"the operator image must not install {absent}"
    done = _run(
        venv, str(venv / "bin" / "python"), "-c", "import disagg.operator.main, disagg.operator.handlers"
    )
    assert done.returncode == 0, done.stderr
    help_text = _run(venv, str(venv / "bin" / "disagg"), "operator", "--help")
    assert help_text.returncode == 0 and "--all-namespaces" in help_text.stdout, help_text.stderr


@pytest.mark.slow
def test_worker_image_environment(tmp_path):
    line = project_install_line(ROOT / "docker" / "worker.Dockerfile")
    venv = _venv(tmp_path, [[torch_pin()], line])
    assert _imports(venv, "torch") and _imports(venv, "nixl")
    for absent in ("kopf", "grpc_tools", "transformers", "pytest"):
        assert not _imports(venv, absent), f"the worker image must not install {absent}"
    code = (
        "from disagg.proto import worker_pb2, worker_pb2_grpc, kv_transfer_pb2;"
        "import disagg.worker.serving.main, disagg.worker.router.app, disagg.worker.kv_transfer.nixl_transport"
    )
    done = _run(venv, str(venv / "bin" / "python"), "-c", code)
    assert done.returncode == 0, done.stderr
    # the native CPU kernels' sources ship in the wheel and build there (a C compiler is on the image)
    native = _run(venv, str(venv / "bin" / "python"), "-c",
                  "from disagg.kernels import native_build; import sys; sys.exit(0 if native_build.available() else 1)")  # fmt: skip
    assert native.returncode == 0, native.stderr
    for command in ("worker", "router", "generate", "make-model"):
        shown = _run(venv, str(venv / "bin" / "disagg"), command, "--help")
        assert shown.returncode == 0, f"disagg {command} --help: {shown.stderr}"
