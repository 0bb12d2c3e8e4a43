"""Weight quantization: which scheme a model is served with, and making 8-bit weights.

Two schemes, both weight-only with one scale per output channel (activations stay in the
model's dtype, so the matmul reads 8-bit weights and computes in the activation dtype):

- int8: symmetric, scale = max|W_r| / 127, values round(W / scale) in [-127, 127] (W8A16);
- fp8: e4m3 (float8_e4m3fn), scale = max|W_r| / 448 (its largest finite value), values W / scale
  rounded to the nearest e4m3.

A float checkpoint is quantized at load (`quantization="int8"|"fp8"`): the four matmuls of every
layer (qkv, o, gate_up, down) and, for int8, the LM head (fp8 keeps it in the model dtype:
`LM_HEAD_SCHEMES`); the embedding table stays in the model dtype (a step reads one row of it per
token). A pre-quantized checkpoint in the compressed-tensors
layout (llm-compressor: `quantization_config` in config.json, `*.weight` int8 or
float8_e4m3fn with `*.weight_scale`) is loaded as it is, and its scheme is the model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from disagg.kernels.quantized import SCHEMES, QuantizedWeight, tensor_bytes

QUANTIZATION_SETTINGS = ("auto", "none", *SCHEMES)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# compressed-tensors formats whose weights are stored unpacked, in their quantized dtype.
_UNPACKED_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Per-output-row symmetric int8 of w [N, K] (computed in float32)."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # an all-zero row stays zero
    data = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(data.contiguous(), scale.contiguous())


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    """Per-output-row e4m3 of w [N, K]: each row scaled so its largest magnitude is e4m3's largest."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    data = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(data.contiguous(), scale.contiguous())


# Schemes that quantize the LM head too. fp8 keeps it in the model's dtype (tied: the embedding
# itself, no copy): e4m3's 3-bit mantissa on the LM head alone costs SmolLM2-135M +5.5% perplexity
# (bench/perplexity.py: fp8 weights +8.6%, +3.0% with the head kept), the head being the one matmul
# whose every output row is a logit; per-channel int8 keeps it within 0.2%.
LM_HEAD_SCHEMES = ("int8",)


def lm_head_scheme(scheme: str | None) -> str | None:
    """The scheme the LM head is quantized to when the layers' matmuls are `scheme` (None: kept)."""
    return scheme if scheme in LM_HEAD_SCHEMES else None


def decode_weight_bytes(weights) -> int:
    """Bytes of weights one decode step reads (`ModelWeights`): every layer, the final norm and
    the LM head (the embedding table is only indexed, unless it is the tied LM head); 8-bit weights
    count their bytes and their scales. At batch 1, the weight bytes per generated token."""
    total = sum(tensor_bytes(t) for layer in weights.layers for t in vars(layer).values())
    return total + tensor_bytes(weights.norm) + tensor_bytes(weights.lm_head)


def quantize(w: torch.Tensor, scheme: str) -> QuantizedWeight:
    if scheme == "int8":
        return quantize_int8(w)
    if scheme == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")


def scheme_from_config(raw: dict) -> str | None:
    """The scheme a checkpoint's config.json declares (None: not quantized). Refuses, naming the
    key, what this engine cannot load as it is."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method != "compressed-tensors":
        raise ValueError(
            f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
            "(only compressed-tensors int8 / fp8 weights)"
        )
    fmt = qc.get("format")
    if fmt not in _UNPACKED_FORMATS:
        raise ValueError(
            f"quantization_config.format {fmt!r} is not supported (one of {', '.join(_UNPACKED_FORMATS)})"
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty")
    schemes = set()
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}.weights"
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8:
            raise ValueError(f"{where}.num_bits must be 8, got {weights.get('num_bits')!r}")
        if not weights.get("symmetric", True):
            raise ValueError(f"{where}.symmetric must be true (no zero points)")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"{where}.strategy must be channel or tensor, got {weights.get('strategy')!r}")
        kind = weights.get("type")
        if kind not in ("int", "float"):
            raise ValueError(f"{where}.type must be int or float, got {kind!r}")
        schemes.add("int8" if kind == "int" else "fp8")
    if len(schemes) > 1:
        raise ValueError("quantization_config.config_groups mix int and float weights")
    return schemes.pop()


def checkpoint_scheme(model_dir: str | Path) -> str | None:
    config = Path(model_dir) / "config.json"
    return scheme_from_config(json.loads(config.read_text())) if config.is_file() else None


def resolve(requested: str, checkpoint: str | None) -> str | None:
    """The scheme to serve with (None: plain weights) from the setting and the checkpoint's own."""
    if requested not in QUANTIZATION_SETTINGS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SETTINGS)}, got {requested!r}")
    if requested == "auto":
        return checkpoint
    if checkpoint is not None and requested != checkpoint:
        raise ValueError(
            f"quantization={requested!r} conflicts with the checkpoint, which is pre-quantized as "
            f"{checkpoint} (compressed-tensors); use quantization='auto' or {checkpoint!r}"
        )
    return None if requested == "none" else requested


def prequantized(data: list[torch.Tensor], scales: list[torch.Tensor], names: list[str]) -> QuantizedWeight:
    """One fused weight from the checkpoint's quantized parts (stacked along the rows) and their
    scales: per channel ([rows] or [rows, 1]) or per tensor (one value, spread over its rows)."""
    rows = []
    for t, s, name in zip(data, scales, names, strict=True):
        if t.dtype not in SCHEMES.values():
            raise ValueError(
                f"tensor {name} is {t.dtype}, a quantized checkpoint stores int8 or float8_e4m3fn"
            )
        s = s.to(torch.float32).reshape(-1)
        if s.numel() == 1:
            s = s.expand(t.shape[0])
        elif s.numel() != t.shape[0]:
            raise ValueError(
                f"tensor {name}_scale has {s.numel()} values; per-channel needs {t.shape[0]}, per-tensor 1"
            )
        rows.append(s)
    if len({t.dtype for t in data}) > 1:
        raise ValueError(f"tensors {', '.join(names)} are fused but stored in different dtypes")
    fused = data[0] if len(data) == 1 else torch.cat(data, dim=0)
    return QuantizedWeight(fused.contiguous(), torch.cat(rows).contiguous())
