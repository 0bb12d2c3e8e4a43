"""The worker tests' tiny model fixtures (tests/worker/conftest.py), shared with the kernel tests
(tests/, a folder without __init__.py, is on sys.path as pytest's rootdir-relative conftest import
puts it)."""

from worker.conftest import (  # noqa: F401
    paged,
    tiny_llama_dir,
    tiny_mistral_dir,
    tiny_model_dir,
    tiny_qwen2_dir,
)
