"""The Triton implementations of `disagg.kernels.OP_NAMES`, with the torch twins' signatures.

On CPU these only run under TRITON_INTERPRET=1 (set before this module is imported), which is
how the tests prove each kernel against its twin.
"""

from __future__ import annotations

from disagg.kernels.triton_activation import silu_and_mul
from disagg.kernels.triton_decode_attention import decode_attention
from disagg.kernels.triton_kv_cache import write_kv_cache
from disagg.kernels.triton_norm import rms_norm
from disagg.kernels.triton_prefill_attention import prefill_attention
from disagg.kernels.triton_rotary import rotary_embedding

__all__ = [
    "rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "write_kv_cache",
    "prefill_attention",
    "decode_attention",
]
