"""The worker tests' tiny model fixtures (tests/worker/conftest.py), shared with the kernel tests.

tests/ is on sys.path already when the root conftest is imported in pytest's default import
mode; adding it here keeps `worker.conftest` importable in any mode.
"""

import sys
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parents[1])
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from worker.conftest import (  # noqa: E402, F401
    paged,
    tiny_llama_dir,
    tiny_mistral_dir,
    tiny_model_dir,
    tiny_qwen2_dir,
)
