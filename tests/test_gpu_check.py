"""`make gpu-check` without a GPU: a dry run that lists every step and runs none, and the steps'
own code proven on this CPU at tiny shapes (the Triton kernels in Triton's interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "bench" / "gpu" / "check.py"
sys.path.insert(0, str(CHECK.parent))

from check import STEPS  # noqa: E402


def run_check(*args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK), "--out", str(out), "--work", str(out / "work"), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the check runs for real")
def test_without_cuda_it_is_a_dry_run_listing_every_step(tmp_path):
    done = run_check(out=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"none of the {len(STEPS)} steps ran" in done.stdout
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["ran"] is False
    assert list(report["steps"]) == [s.name for s in STEPS]
    assert {r["status"] for r in report["steps"].values()} == {"not run"}


def test_an_unknown_step_is_refused(tmp_path):
    done = run_check("--dry-run", "--only", "kernels,warp-drive", out=tmp_path)
    assert done.returncode == 2 and "warp-drive" in done.stderr


@pytest.mark.slow
def test_the_kernel_step_passes_on_this_cpu_and_a_broken_kernel_fails_it(tmp_path):
    done = run_check("--smoke", "--only", "kernels,graphs", out=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    kernels = report["steps"]["kernels"]
    assert kernels["status"] == "passed" and len(kernels["checks"]) > 50
    assert report["steps"]["graphs"]["notes"] == ["CUDA graphs need a GPU: capture not tried"]
    # the same step with one kernel off by a little: its check fails, and so does the run
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "import disagg.kernels.triton_activation as m\n"
        "_f = m.silu_and_mul\n"
        "m.silu_and_mul = lambda x: _f(x) * 1.01\n"
    )
    env_run = subprocess.run(
        [sys.executable, str(CHECK), "--smoke", "--only", "kernels", "--out", str(tmp_path / "b"),
         "--work", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(broken)},
    )  # fmt: skip
    assert env_run.returncode == 1
    failed = [
        c["name"]
        for c in json.loads((tmp_path / "b" / "gpu-check.json").read_text())["steps"]["kernels"]["checks"]
        if not c["passed"]
    ]
    assert failed and all(name.startswith("silu_and_mul") for name in failed)
