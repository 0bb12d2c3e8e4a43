"""A whole decode step of a Llama-family model in one native call (`cpu_decode_step.c`): float32,
whose four matmuls per layer and LM head take float32 or 8-bit weights (`QuantizedWeight`: int8 or
fp8 e4m3, one kind per model), or bfloat16 throughout (weights, activations and cache; the same
rounding as the per-op bf16 kernels, `cpu_bf16.c`).

For small batches: there a step is bound by reading the weights once, and the per-layer
torch matmuls and small ops cost more than the reading (dispatch, temporaries, threads idling
between ops). Larger batches are matrix-matrix work; the step takes them where its matmuls are
the per-op path's own GEMMs, in pieces each thread runs inside the step (so the same products), and
up to as many rows as those take: float32 weights in the native float32 GEMM's register tiles
(`gemm_native_max_rows`), and where AMX is usable, bf16 or int8 weights on its tiles (`amx_rows`).
The dispatch and small ops it saves are then a third of a 16-sequence step or more.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from disagg.kernels import cpu_native, native_build
from disagg.kernels.kv_quant import KVQuantFormat
from disagg.kernels.quantized import (
    BF16_AMX_MAX_ROWS,
    BF16_AMX_MIN_ROWS,
    INT8_AMX_MAX_ROWS,
    W8A8_MIN_ROWS,
    QuantizedWeight,
    gemm_native_max_rows,
)

# The rows every model's step takes (the GEMVs of 8-bit weights without AMX, bf16 ones without AMX:
# 5-6 rows, a verify step of 4-5 proposals, cost about one on a memory-bound model); float32 and
# AMX steps take more (`max_batch`).
MAX_BATCH = 6

PHASES = ("add + rms norm", "qkv", "rotary + KV write + attention", "o", "gate/up + SiLU", "down", "LM head")


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
            "down_bias", "qkv_scale", "o_scale", "gate_up_scale", "down_scale",
        )
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("num_layers", "hidden", "inter", "num_q_heads", "num_kv_heads",
                                              "head_dim", "vocab")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", ctypes.c_void_p),
        ("cos_sin", ctypes.c_void_p),
        ("lm_head_scale", ctypes.c_void_p),
        ("weight_kind", ctypes.c_int64),
        ("amx_min_batch", ctypes.c_int64),
    ]  # fmt: skip


_WEIGHT_KINDS = {"int8": 1, "fp8": 2}  # WEIGHTS_INT8, WEIGHTS_FP8 in cpu_decode_step.c
_BF16_MODEL = 3  # WEIGHTS_BF16


MATMULS = ("qkv", "o", "gate_up", "down")


@dataclass
class DecodeLayer:
    """One layer's weights (float32 or bf16), torch Linear layout; gate_up is [gate; up]. A float32
    model's matmul weights may be 8-bit `QuantizedWeight`s."""

    input_norm: torch.Tensor
    qkv: torch.Tensor | QuantizedWeight
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | QuantizedWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | QuantizedWeight
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | QuantizedWeight
    down_bias: torch.Tensor | None


def supports(weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the native step of a `dtype` model takes this matmul weight: in a float32 model
    float32, or int8 / fp8 with per-row scales; in a bf16 model bf16."""
    if isinstance(weight, QuantizedWeight):
        return dtype == torch.float32 and weight.scheme in _WEIGHT_KINDS
    return weight.dtype == dtype and dtype in (torch.float32, torch.bfloat16)


def _ptr(t: torch.Tensor | QuantizedWeight | None) -> int | None:
    if isinstance(t, QuantizedWeight):
        return t.data.data_ptr()
    return None if t is None else t.data_ptr()


def _scale_ptr(t: torch.Tensor | QuantizedWeight) -> int | None:
    return t.scale.data_ptr() if isinstance(t, QuantizedWeight) else None


def _layer_struct(layer: DecodeLayer) -> _Layer:
    values = {f: _ptr(getattr(layer, f)) for f in vars(layer)}
    values.update({f"{name}_scale": _scale_ptr(getattr(layer, name)) for name in MATMULS})
    return _Layer(**values)


def _flatten(t: torch.Tensor | QuantizedWeight, dense: str = "f32") -> list[tuple[str, torch.Tensor]]:
    """The tensors behind a weight with the kind the C code reads them as (`dense`: the model's
    own dtype, f32 or bf16)."""
    if isinstance(t, QuantizedWeight):
        if not t.data.is_contiguous() or t.device.type != "cpu":
            raise ValueError("8-bit weights must be contiguous CPU tensors")
        return [("f32", t.scale), (t.scheme, t.data)]
    return [(dense, t)]


_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_STEP = [_p, _p, _i64, _p, _p, _p, _i64, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p]
_SIGNATURES = {
    "decode_step_f32": (_STEP, ctypes.c_int),
    "decode_step_bf16": (_STEP, ctypes.c_int),
    "decode_step_kvq8": (
        [_p, _p, _i64, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int, _p, _i64, _p, _i64, _p, _p, _i64, _p],
        ctypes.c_int,
    ),
    "decode_step_work_floats": ([_p, _i64, _i64, _i64], _i64),
    "decode_step_phases": ([], _i64),
}


def amx_rows(weight: torch.Tensor | QuantizedWeight) -> tuple[int, int]:
    """(from, to) rows over which a step whose matmuls have weights like `weight` multiplies on AMX
    tiles, where AMX is usable: bf16 and int8 weights, over the rows the per-op path's AMX GEMMs
    take (cpu_amx.c, in pieces: the same numbers); (0, 0) where it does not."""
    if not native_build.amx_usable():
        return 0, 0
    if isinstance(weight, QuantizedWeight):
        return (W8A8_MIN_ROWS, INT8_AMX_MAX_ROWS) if weight.scheme == "int8" else (0, 0)
    return (BF16_AMX_MIN_ROWS, BF16_AMX_MAX_ROWS) if weight.dtype == torch.bfloat16 else (0, 0)


def max_batch(weight: torch.Tensor | QuantizedWeight) -> int:
    """The most sequences the native step takes for a model whose matmuls have weights like
    `weight`: float32 weights as many as the native float32 GEMM (whose tiles the step's matmuls
    run from two rows on), with AMX what its GEMM takes, else MAX_BATCH."""
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
        return max(MAX_BATCH, gemm_native_max_rows())
    return max(MAX_BATCH, amx_rows(weight)[1])


class NativeDecodeStep:
    """The model's weights bound once (pointers into tensors this object keeps alive); each call
    runs one decode step of up to `max_batch` sequences and returns float32 logits [B, vocab]. The
    model's dtype is its final norm's: float32, or bfloat16 (then every tensor but the rotary table
    is bf16, and so are the residual stream and the cache; logits are rounded to bf16, as the per-op
    bf16 path's LM head rounds them)."""

    def __init__(
        self,
        layers: list[DecodeLayer],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        eps: float,
        scale: float,
    ):
        self._lib = native_build.bind(_SIGNATURES)
        hidden = final_norm.shape[0]
        inter = layers[0].down.shape[1]
        head_dim = cos_sin_cache.shape[1]
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        expect = {
            "qkv": ((num_q_heads + 2 * num_kv_heads) * head_dim, hidden),
            "o": (hidden, num_q_heads * head_dim),
            "gate_up": (2 * inter, hidden),
            "down": (hidden, inter),
            "input_norm": (hidden,),
            "post_norm": (hidden,),
        }
        self.dtype = final_norm.dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the native decode step runs float32 or bfloat16 models, not {self.dtype}")
        dense = "bf16" if self.dtype == torch.bfloat16 else "f32"
        tensors = [*_flatten(final_norm, dense), *_flatten(lm_head, dense), *_flatten(cos_sin_cache)]
        for i, layer in enumerate(layers):
            for name, shape in expect.items():
                t = getattr(layer, name)
                if tuple(t.shape) != shape:
                    raise ValueError(f"layer {i} {name}: shape {tuple(t.shape)}, expected {shape}")
                bias = getattr(layer, f"{name}_bias", None)
                if bias is not None and tuple(bias.shape) != shape[:1]:
                    raise ValueError(
                        f"layer {i} {name}_bias: shape {tuple(bias.shape)}, expected {shape[:1]}"
                    )
            tensors += [kt for t in vars(layer).values() if t is not None for kt in _flatten(t, dense)]
        if lm_head.shape[1] != hidden:
            raise ValueError(f"lm_head: shape {tuple(lm_head.shape)} does not match hidden size {hidden}")
        cpu_native.check_cpu(
            torch.float32, **{f"weight {i}": t for i, (kind, t) in enumerate(tensors) if kind == "f32"}
        )
        cpu_native.check_cpu(
            torch.bfloat16, **{f"weight {i}": t for i, (kind, t) in enumerate(tensors) if kind == "bf16"}
        )
        kinds = {kind for kind, _ in tensors if kind not in ("f32", "bf16")}
        if dense == "bf16" and kinds:
            raise ValueError(f"a bfloat16 model's native decode step takes bf16 weights, got {sorted(kinds)}")
        if len(kinds) > 1:
            raise ValueError(
                f"the native decode step takes one kind of 8-bit weights per model, got {sorted(kinds)}"
            )
        self._tensors = tensors  # the pointers below stay valid while these live
        self._layers = (_Layer * len(layers))(*(_layer_struct(layer) for layer in layers))
        self._model = _Model(
            len(layers), hidden, inter, num_q_heads, num_kv_heads, head_dim, lm_head.shape[0], eps, scale,
            self._layers, final_norm.data_ptr(), _ptr(lm_head), cos_sin_cache.data_ptr(), _scale_ptr(lm_head),
            _BF16_MODEL if dense == "bf16" else _WEIGHT_KINDS.get(next(iter(kinds), ""), 0),
            amx_rows(layers[0].qkv)[0],
        )  # fmt: skip
        self.max_batch = max_batch(layers[0].qkv)
        self.vocab_size = lm_head.shape[0]
        self.hidden = hidden
        self.max_positions = cos_sin_cache.shape[0]
        self._work = torch.empty(0)
        # Per-phase seconds, accumulated over calls while not None (see `PHASES`).
        self.phase_seconds: torch.Tensor | None = None

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_caches: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_format: KVQuantFormat | None = None,
    ) -> torch.Tensor:
        """hidden [B, H]: the tokens' embeddings in the model's dtype (overwritten: the residual
        stream). kv_caches: the whole model's cache [layers, blocks, 2, block_size, Hkv, D],
        contiguous, in the model's dtype, or (float32 models) with `kv_format` a quantized cache
        [layers, blocks, region_bytes] of that format.
        block_tables [B, W] and seq_lens [B] as for decode attention (any int dtype)."""
        cpu_native.check_cpu(self.dtype, hidden=hidden)
        b = hidden.shape[0]
        if hidden.shape[1] != self.hidden or not 0 < b <= self.max_batch:
            raise ValueError(f"hidden {tuple(hidden.shape)}: need [1..{self.max_batch}, {self.hidden}]")
        m = self._model
        if kv_format is not None and self.dtype != torch.float32:
            raise ValueError("a quantized KV cache needs a float32 model in the native decode step")
        if kv_format is None:
            cpu_native.check_cpu(self.dtype, kv_caches=kv_caches)
            if kv_caches.shape[0] != m.num_layers or kv_caches.shape[4:] != (m.num_kv_heads, m.head_dim):
                raise ValueError(f"kv_caches {tuple(kv_caches.shape)} do not match the model")
            num_blocks, block_size = kv_caches.shape[1], kv_caches.shape[3]
        else:
            shape = kv_format.cache_shape(m.num_layers, kv_caches.shape[1])
            if (kv_format.num_kv_heads, kv_format.head_dim) != (
                m.num_kv_heads,
                m.head_dim,
            ) or m.head_dim > 512:
                raise ValueError(f"kv_format {kv_format} does not match the model (or head_dim > 512)")
            if (
                kv_caches.dtype != torch.uint8
                or tuple(kv_caches.shape) != shape
                or not kv_caches.is_contiguous()
            ):
                raise ValueError(f"kv_caches: expected contiguous uint8 {shape}, got {kv_caches.dtype} "
                                 f"{tuple(kv_caches.shape)}")  # fmt: skip
            num_blocks, block_size = kv_caches.shape[1], kv_format.block_size
        cpu_native.check_step_bounds(positions, slot_mapping, self.max_positions, num_blocks * block_size)
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < num_blocks:
            raise IndexError(f"block_tables: a block id is outside [0, {num_blocks})")
        max_len = tables.shape[1] * block_size
        positions = positions.to(torch.int64).contiguous()
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
        threads = torch.get_num_threads()
        need = self._lib.decode_step_work_floats(ctypes.byref(m), b, max_len, threads)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        logits = torch.empty(b, self.vocab_size, dtype=torch.float32)
        if self.phase_seconds is not None and self.phase_seconds.dtype != torch.float64:
            raise TypeError("phase_seconds must be float64")
        phases = None if self.phase_seconds is None else self.phase_seconds.data_ptr()
        head = (ctypes.byref(m), hidden.data_ptr(), b, positions.data_ptr(), slot_mapping.data_ptr())
        tail = (tables.data_ptr(), tables.stride(0), lens.data_ptr(), max_len, logits.data_ptr(),
                self._work.data_ptr(), threads, phases)  # fmt: skip
        if self.dtype == torch.bfloat16:
            code = self._lib.decode_step_bf16(
                *head, kv_caches.data_ptr(), kv_caches.stride(0), block_size, *tail
            )
        elif kv_format is None:
            code = self._lib.decode_step_f32(
                *head, kv_caches.data_ptr(), kv_caches.stride(0), block_size, *tail
            )
        else:
            code = self._lib.decode_step_kvq8(
                *head, kv_caches.data_ptr(), kv_caches.stride(0), block_size, kv_format.region_bytes,
                int(kv_format.name == "fp8"), *tail,
            )  # fmt: skip
        if code == -3:
            raise RuntimeError("AMX is not usable in this process (amx_usable() is False)")
        if code:
            raise ValueError(f"seq_lens: every length must be in [1, {max_len}]")
        return logits
