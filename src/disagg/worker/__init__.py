"""disagg.worker: the inference engine, the worker servers and the router.

`LLM`, `SamplingParams` and `LLMEngine` are imported lazily: `disagg operator` lives in the
same package tree and must not pay for importing torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "LLM": "disagg.worker.engine.llm",
    "LLMEngine": "disagg.worker.engine.llm_engine",
    "SamplingParams": "disagg.worker.engine.sampling_params",
    "RequestOutput": "disagg.worker.engine.outputs",
    "CompletionOutput": "disagg.worker.engine.outputs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'disagg.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
