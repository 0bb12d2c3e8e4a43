"""The quantized KV cache: 8-bit K/V with one float32 scale per token and KV head, and its torch twin.

A quantized cache is one byte tensor [layers, blocks, region_bytes]. Each (layer, block) region
holds the 8-bit values [2 (K, V), block_size, Hkv, D] followed by their float32 scales
[2, block_size, Hkv], padded to a multiple of 64 bytes. The scales live inside the region, so
everything that moves or shares whole (layer, block) regions (KV transfer, prefix caching, block
accounting) works on a quantized cache unchanged.

Scales are per token and KV head, symmetric: scale = amax / 127 (int8) or amax / 448 (fp8 e4m3),
amax over the head's D values. A token's K/V are quantized once, when written: decode steps that
append tokens never requantize earlier ones, and a block's bytes do not depend on which step (or
which worker) wrote them.

The torch twin reads a step's blocks by dequantizing the blocks its block tables name into a
small cache of the model's dtype and running the ordinary attention ops over it (`QuantizedKVStep`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagg.kernels import torch_ops

REGION_ALIGN = 64  # bytes: regions start on cache lines
# How each 8-bit kind is stored. The kinds themselves are named in worker/model/precisions.py
# (KV_CACHE_DTYPES), a layer above the kernels; a test checks this table covers exactly those.
_VALUE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
KV_CACHE_DTYPES = tuple(_VALUE_DTYPES)
_QMAX = {"int8": 127.0, "fp8": 448.0}
_MIN_AMAX = 1e-30  # an all-zero row gets a tiny scale instead of a division by zero


def region_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one (layer, block) region of a quantized cache: values, scales, padding."""
    values = 2 * block_size * num_kv_heads * head_dim
    scales = 2 * block_size * num_kv_heads * 4
    return -(-(values + scales) // REGION_ALIGN) * REGION_ALIGN


@dataclass(frozen=True)
class KVQuantFormat:
    """How K/V of one model are stored in a quantized cache (`name`: int8 or fp8)."""

    name: str
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.name not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.name!r}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: a quantized KV cache needs an even head_dim, got {self.head_dim}")

    @property
    def value_dtype(self) -> torch.dtype:
        return _VALUE_DTYPES[self.name]

    @property
    def qmax(self) -> float:
        return _QMAX[self.name]

    @property
    def values_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def region_bytes(self) -> int:
        return region_bytes(self.block_size, self.num_kv_heads, self.head_dim)

    def cache_shape(self, num_layers: int, num_blocks: int) -> tuple[int, int, int]:
        return (num_layers, num_blocks, self.region_bytes)

    def allocate(self, num_layers: int, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(self.cache_shape(num_layers, num_blocks), dtype=torch.uint8, device=device)

    # ---- views of a cache (any leading dims before the region bytes) ----------------------
    def _check(self, cache: torch.Tensor) -> None:
        if cache.dtype != torch.uint8 or cache.shape[-1] != self.region_bytes or cache.stride(-1) != 1:
            raise ValueError(
                f"kv_cache: expected uint8 [..., {self.region_bytes}] regions with unit stride, "
                f"got {cache.dtype} {tuple(cache.shape)}"
            )

    def values(self, cache: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[..., 2, block_size, Hkv, D] 8-bit values of `cache` [..., region_bytes] (a view;
        `dtype` torch.uint8 gives the raw bytes, for writing)."""
        self._check(cache)
        v = cache.view(dtype or self.value_dtype)
        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        return v.as_strided(
            (*cache.shape[:-1], 2, bs, h, d), (*v.stride()[:-1], bs * h * d, h * d, d, 1), v.storage_offset()
        )

    def scales(self, cache: torch.Tensor) -> torch.Tensor:
        """[..., 2, block_size, Hkv] float32 scales of `cache` [..., region_bytes] (a view)."""
        self._check(cache)
        if cache.storage_offset() % 4:
            raise ValueError("kv_cache: a region view must start on a 4-byte boundary")
        f = cache.view(torch.float32)
        bs, h = self.block_size, self.num_kv_heads
        return f.as_strided(
            (*cache.shape[:-1], 2, bs, h),
            (*f.stride()[:-1], bs * h, h, 1),
            f.storage_offset() + self.values_bytes // 4,
        )

    # ---- the torch twin --------------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hkv, D] -> (8-bit values [T, Hkv, D], float32 scales [T, Hkv])."""
        xf = x.float()
        scale = xf.abs().amax(-1).clamp_min(_MIN_AMAX) / self.qmax
        y = xf / scale.unsqueeze(-1)
        if self.name == "int8":
            return y.round_().clamp_(-127, 127).to(torch.int8), scale
        return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale

    @staticmethod
    def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """values [..., D] times scales [...], in `dtype`."""
        return (values.float() * scales.unsqueeze(-1)).to(dtype)

    def write(
        self, key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor
    ):
        """Quantize key/value [T, Hkv, D] into their slots of one layer's cache [blocks, region_bytes]
        (negative slots skipped). Returns key and value as the cache now holds them, in their dtype."""
        qk, sk = self.quantize(key)
        qv, sv = self.quantize(value)
        valid = slot_mapping >= 0
        slots = slot_mapping.long()
        if not bool(valid.all()):
            slots, wqk, wsk, wqv, wsv = slots[valid], qk[valid], sk[valid], qv[valid], sv[valid]
        else:
            wqk, wsk, wqv, wsv = qk, sk, qv, sv
        blocks, offsets = slots // self.block_size, slots % self.block_size
        raw, scales = self.values(layer_cache, torch.uint8), self.scales(layer_cache)
        raw[blocks, 0, offsets] = wqk.view(torch.uint8)
        raw[blocks, 1, offsets] = wqv.view(torch.uint8)
        scales[blocks, 0, offsets] = wsk
        scales[blocks, 1, offsets] = wsv
        return self.dequantize(qk, sk, key.dtype), self.dequantize(qv, sv, value.dtype)

    def read_rows(self, layer_cache: torch.Tensor, slot_mapping: torch.Tensor, dtype: torch.dtype):
        """K and V [T, Hkv, D] of the slots, as one layer's cache holds them (negative slots read
        slot 0: rows that were not written)."""
        slots = slot_mapping.long().clamp_min(0)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        held = self.dequantize(
            self.values(layer_cache)[blocks, :, offsets], self.scales(layer_cache)[blocks, :, offsets], dtype
        )
        return held[:, 0], held[:, 1]

    def dequantize_blocks(self, layer_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype):
        """Blocks `block_ids` of one layer's cache as an ordinary cache [n, 2, block_size, Hkv, D]."""
        regions = layer_cache.index_select(0, block_ids)
        return self.dequantize(self.values(regions), self.scales(regions), dtype)


class QuantizedKVStep:
    """One forward step over a quantized cache, on the ordinary attention ops: the blocks the
    step's block tables name (found once per step) are dequantized per layer into a small cache,
    and the step's tables renumbered into it (`tables`)."""

    def __init__(
        self, fmt: KVQuantFormat, block_tables: torch.Tensor, seq_lens: torch.Tensor, dtype: torch.dtype
    ):
        self.fmt, self.dtype = fmt, dtype
        bs = fmt.block_size
        used = (seq_lens.long() + bs - 1) // bs
        cols = torch.arange(block_tables.shape[1], device=block_tables.device)
        # entries past a sequence's blocks may hold any id: read block 0 there (always allocated)
        tables = torch.where(cols[None, :] < used[:, None], block_tables.long(), 0)
        self.block_ids, inverse = torch.unique(tables, return_inverse=True)
        self.tables = inverse.view(tables.shape).to(block_tables.dtype)

    def layer_cache(self, layer_cache: torch.Tensor) -> torch.Tensor:
        """The step's blocks of one layer as a cache [n, 2, block_size, Hkv, D] for `self.tables`."""
        return self.fmt.dequantize_blocks(layer_cache, self.block_ids, self.dtype)


# ---- the op-table entries (`disagg.kernels.get_ops`); Triton: `triton_kv_quant` --------------
def write_kv_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: KVQuantFormat,
) -> None:
    """key/value [T, Hkv, D] quantized into their slots of one layer's cache (negative: skipped)."""
    fmt.write(key, value, layer_cache, slot_mapping)


def decode_attention_quantized(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    fmt: KVQuantFormat,
) -> torch.Tensor:
    """`torch_ops.decode_attention` over one layer of a quantized cache [blocks, region_bytes]."""
    step = QuantizedKVStep(fmt, block_tables, seq_lens, q.dtype)
    return torch_ops.decode_attention(q, step.layer_cache(layer_cache), step.tables, seq_lens, scale)
