"""Generate the gRPC modules from the .proto files here (never edit the output): into this folder for a
development checkout (`make install`), into the wheel when the package is built (setup.py).

The include path is src/, so the sources are named `disagg/proto/x.proto` and the generated modules
import each other as `disagg.proto.x_pb2`, the installed package name.
Regenerates only when a .proto is newer than its outputs.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1]  # the folder that holds disagg/


def _stale(src: Path, out_dir: Path) -> bool:
    outs = [out_dir / f"{src.stem}_pb2.py", out_dir / f"{src.stem}_pb2_grpc.py"]
    return any(not o.exists() or o.stat().st_mtime < src.stat().st_mtime for o in outs)


def build(force: bool = False, out_dir: Path = HERE) -> list[str]:
    """Generate into `out_dir` (this folder; setup.py passes the wheel's build folder)."""
    from grpc_tools import protoc

    sources = sorted(HERE.glob("*.proto"))
    todo = [s for s in sources if force or _stale(s, out_dir)]
    if not todo:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "protoc",
            f"-I{SRC}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [f"disagg/proto/{s.name}" for s in todo]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {[s.name for s in todo]}")
        for f in (Path(tmp) / "disagg" / "proto").glob("*_pb2*"):
            shutil.copy(f, out_dir / f.name)
    return [s.name for s in todo]


if __name__ == "__main__":
    done = build(force="--force" in sys.argv)
    print(f"generated gRPC modules for {', '.join(done)}" if done else "gRPC modules up to date")
