"""How the attention kernels' `tl.dot`s round their float32 operands on a GPU.

The kernels widen K, V and probabilities to float32 before each dot. For a bf16 or fp16 model,
TF32 tensor cores keep more mantissa than the operands ever had; a float32 model's reference is
float32 arithmetic, which TF32 misses by ~1e-3 relative, so its dots run in full precision.
"""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s `input_precision` for attention over a model of `dtype`."""
    return "ieee" if dtype == torch.float32 else "tf32"
