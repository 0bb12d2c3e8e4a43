"""The checkpoint a benchmark runs: a generated preset under `.models/<preset>`, made once.

Progress goes to stderr so that a benchmark's table on stdout stays clean.
"""

from __future__ import annotations

import sys
from pathlib import Path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_model(path: str | Path, preset: str) -> Path:
    """`path`, holding the `preset` model (seed 0): made now if it is not there yet. A checkpoint
    that `disagg make-model` did not write (a real model's directory, a GGUF file) is used as it is."""
    from disagg.worker.tools.make_model import MARKER_FILE, make_model

    path = Path(path)
    ours = (path / MARKER_FILE).is_file()
    if path.is_file() or (
        path.is_dir() and not ours and ((path / "config.json").is_file() or any(path.glob("*.gguf")))
    ):
        return path
    if not (path / "config.json").is_file():
        log(f"making the {preset} model in {path} (once; a trained preset takes minutes)")
    return make_model(path, preset=preset, seed=0, progress=log)
