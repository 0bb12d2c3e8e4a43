"""`make gpu-wheels`: the folder of wheels a bare GPU machine needs to run `make gpu-check`.

That machine's python3 (3.12) holds torch, Triton, transformers, tokenizers, jinja2, numpy,
safetensors, aiohttp, httpx, pytest and prometheus-client, and reaches no package registry. What it
lacks travels with the working tree, whose whole size is capped (CARRY_LIMIT): this project's own
wheel (with its generated gRPC modules), pydantic and llguidance, the Redis client, the gRPC and
protobuf runtimes our generated modules were made for, and NIXL for CUDA 13 with UCX.

NIXL's CUDA 13 wheel is 59 MB: most of it is the expert-parallel extension (built three times, one
per torch) and the storage plugins (S3, Azure, GDS, ...). `slim_nixl` rewrites it keeping the
Python API, the core libraries, the UCX plugin and UCX's own transports (cma, CUDA IPC), and
every bundled library those need, found by walking their ELF `NEEDED` entries; the wheel's
RECORD is rewritten to match.

    python bench/gpu/wheels.py [--dest .gpu/wheels]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY_LIMIT = 64 * 2**20  # what one device call may carry: working tree + carried folders
PYTHON_VERSION = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# Pinned to what the development environment runs, so both sides run the same code.
WHEELS = {
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "llguidance": "1.9.1",
    "redis": "8.1.0",
    "grpcio": "1.85.3",
    "protobuf": "7.36.2",
    "nixl": "1.5.1",
    "nixl-cu13": "1.5.1",
    "gguf": "0.19.0",
}
# Kept from nixl-cu13 besides what they need: the Python package, the core, UCX and its modules.
NIXL_ROOTS = (
    r"nixl_cu13/[^/]+\.(py|so|typed)$",
    r"\.nixl_cu13\.mesonpy\.libs/lib(nixl|nixl_common|nixl_build|serdes|stream)\.so$",
    r"\.nixl_cu13\.mesonpy\.libs/plugins/libplugin_UCX\.so$",
    r"nixl_cu13\.libs/nixl/libplugin_UCX\.so$",
    r"nixl_cu13\.libs/ucx/lib(uct_cma|uct_cuda|ucm_cuda)\.so[.0-9]*$",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def download(names: dict[str, str], dest: Path) -> None:
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", PYTHON_VERSION, "--implementation", "cp", *platform_args, "-d", str(dest),
        *(f"{n}=={v}" for n, v in names.items()),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)


def needed(path: Path) -> list[str]:
    """The shared libraries an ELF file names as NEEDED."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def keep_closure(files: list[str], tree: Path) -> set[str]:
    """The root files and every file of the tree a kept ELF file needs, transitively."""
    by_name: dict[str, list[str]] = {}
    for f in files:
        by_name.setdefault(Path(f).name, []).append(f)
    keep = {f for f in files if any(re.fullmatch(p, f) for p in NIXL_ROOTS)}
    todo = [f for f in keep if ".so" in f]
    while todo:
        for lib in needed(tree / todo.pop()):
            for f in by_name.get(lib, []):
                if f not in keep:
                    keep.add(f)
                    todo.append(f)
    return keep


def _record_line(rel: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}"


def slim_nixl(wheel: Path) -> Path:
    """Rewrite the nixl-cu13 wheel in place with only what the UCX backend needs; returns it."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tree)
            names = [n for n in z.namelist() if not n.endswith("/")]
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        payload = [n for n in names if not n.startswith(dist_info + "/")]
        keep = keep_closure(payload, tree)
        meta = [n for n in names if n.startswith(dist_info + "/") and not n.endswith("/RECORD")]
        record = dist_info + "/RECORD"
        lines = []
        out = wheel.with_suffix(".slim")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            for rel in sorted(keep) + meta:
                data = (tree / rel).read_bytes()
                info = zipfile.ZipInfo(rel, date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr = ((tree / rel).stat().st_mode & 0o777) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, data)
                lines.append(_record_line(rel, data))
            z.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
        out.replace(wheel)
        log(f"nixl-cu13: kept {len(keep)} of {len(payload)} files")
    return wheel


def build_project_wheel(dest: Path) -> Path:
    """This checkout as a wheel (the gRPC modules generated into it, as setup.py does)."""
    for old in dest.glob("disagg-*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
           "-w", str(dest), str(ROOT)]  # fmt: skip
    subprocess.run(cmd, check=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    return next(dest.glob("disagg-*.whl"))


def tree_bytes() -> int:
    """Bytes of what a device call sends besides carried folders: tracked and untracked files
    that git does not ignore."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dest", default=str(ROOT / ".gpu" / "wheels"), help="the wheel folder (default: %(default)s)"
    )
    args = p.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    missing = {
        n: v for n, v in WHEELS.items()
        if not any(dest.glob(f"{n.replace('-', '_')}-{v}-*.whl"))
    }  # fmt: skip
    if missing:
        log(f"downloading {', '.join(missing)}")
        download(missing, dest)
        if "nixl-cu13" in missing:
            slim_nixl(next(dest.glob("nixl_cu13-*.whl")))
    log("building this project's wheel")
    build_project_wheel(dest)
    for whl in sorted(dest.glob("*.whl")):
        print(f"{whl.stat().st_size / 2**20:8.2f} MiB  {whl.name}")
    carried = folder_bytes(dest.parent)
    tree = tree_bytes()
    total = carried + tree
    print(f"{carried / 2**20:8.2f} MiB  {dest.parent} (carried)")
    print(f"{tree / 2**20:8.2f} MiB  working tree (tracked and untracked, not ignored)")
    print(f"{total / 2**20:8.2f} MiB  of the {CARRY_LIMIT / 2**20:.0f} MiB one device call may carry")
    if total > CARRY_LIMIT:
        log("too large to carry: leave something out")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
