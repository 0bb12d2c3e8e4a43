"""disagg.kernels: the engine's hot operations behind one dispatch point.

`get_ops(device)` returns the implementation the engine should call: Triton kernels on
CUDA (when the Triton module is available), the plain-torch twins elsewhere.
`DISAGG_KERNELS=torch` forces the torch twins on CUDA (debugging); `DISAGG_KERNELS=triton`
forces the Triton kernels everywhere (CPU only works under TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from disagg.kernels import torch_ops

OP_NAMES = (
    "rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "write_kv_cache",
    "prefill_attention",
    "decode_attention",
)


def _namespace(module, backend: str) -> SimpleNamespace:
    return SimpleNamespace(backend=backend, **{name: getattr(module, name) for name in OP_NAMES})


def get_ops(device: str | torch.device) -> SimpleNamespace:
    """The op table for `device`: attributes named as in OP_NAMES plus `backend`."""
    choice = os.environ.get("DISAGG_KERNELS", "auto").lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"DISAGG_KERNELS must be auto, torch or triton, got {choice!r}")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "triton" or (choice == "auto" and on_cuda):
        try:
            from disagg.kernels import triton_ops
        except ImportError:
            if choice == "triton":
                raise
        else:
            return _namespace(triton_ops, "triton")
    return _namespace(torch_ops, "torch")
