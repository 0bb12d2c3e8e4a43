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

from disagg.kernels import kv_quant, torch_ops

OP_NAMES = (
    "rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "write_kv_cache",
    "prefill_attention",
    "decode_attention",
)
# over a quantized KV cache (`kv_quant`): the torch twins there, the Triton kernels in triton_kv_quant
KV_QUANT_OP_NAMES = ("write_kv_quantized", "decode_attention_quantized")


def _namespace(module, kv_module, backend: str) -> SimpleNamespace:
    ops = {name: getattr(module, name) for name in OP_NAMES}
    ops.update({name: getattr(kv_module, name) for name in KV_QUANT_OP_NAMES})
    return SimpleNamespace(backend=backend, **ops)


def get_ops(device: str | torch.device) -> SimpleNamespace:
    """The op table for `device`: attributes named as in OP_NAMES and KV_QUANT_OP_NAMES, plus `backend`."""
    choice = os.environ.get("DISAGG_KERNELS", "auto").lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"DISAGG_KERNELS must be auto, torch or triton, got {choice!r}")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "triton" or (choice == "auto" and on_cuda):
        try:
            from disagg.kernels import triton_kv_quant, triton_ops
        except ImportError:
            if choice == "triton":
                raise
        else:
            return _namespace(triton_ops, triton_kv_quant, "triton")
    return _namespace(torch_ops, kv_quant, "torch")
