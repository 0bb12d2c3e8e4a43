"""The precisions a model may run in, each set named once: weight and activation dtypes, 8-bit
weight quantizations and 8-bit KV-cache dtypes.

Standard library only: `EngineArgs`, the loader, the KV handshake, `disagg make-model` and the
operator's CRD parser (no torch there) all read these tuples.
"""

from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")  # weights and activations
QUANTIZATIONS = ("int8", "fp8")  # 8-bit weights, one scale per output channel
KV_CACHE_DTYPES = ("int8", "fp8")  # 8-bit K/V, one scale per token and KV head
