"""Where each (layer, block) region of a KV cache tensor lives, and when two caches can exchange blocks.

The cache is one tensor [num_layers, num_blocks, 2, block_size, kv_heads, head_dim], so region
(layer, block) is the contiguous byte range starting at (layer * num_blocks + block) * block_bytes.
A quantized cache is bytes [num_layers, num_blocks, block_bytes] whose regions hold the 8-bit
values and their scales (`disagg.kernels.kv_quant`): moving whole regions moves both.
Peers may have different num_blocks; everything else must match, which the compatibility hash checks.
That includes how the values are stored (`kv_cache_dtype`: "auto", the cache's dtype itself;
"int8" / "fp8" name 8-bit values with scales) and the weights' quantization that computed them:
blocks from a peer with other weights would decode into an output neither engine produces alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from disagg.kernels.kv_quant import region_bytes
from disagg.worker.model import precisions

PROTOCOL_VERSION = 2  # 2: kv_cache_dtype and weight_quantization in the layout

_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
KV_CACHE_DTYPES = ("auto", *precisions.KV_CACHE_DTYPES)  # auto: the model's dtype
WEIGHT_QUANTIZATIONS = ("none", *precisions.QUANTIZATIONS)


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # in this cache: one rank's share when tp_size > 1
    head_dim: int
    tp_size: int = 1  # ranks the worker splits the model over
    model_kv_heads: int | None = None  # the model's KV heads; None: num_kv_heads (one rank)
    kv_cache_dtype: str = "auto"
    weight_quantization: str = "none"

    def __post_init__(self):
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype: unsupported KV dtype {self.dtype!r} (known: {sorted(_ITEMSIZE)})")
        if self.model_kv_heads is None:
            object.__setattr__(self, "model_kv_heads", self.num_kv_heads)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.weight_quantization not in WEIGHT_QUANTIZATIONS:
            raise ValueError(
                f"weight_quantization: must be one of {', '.join(WEIGHT_QUANTIZATIONS)}, got {self.weight_quantization!r}"
            )
        for field in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "tp_size",
                      "model_kv_heads"):  # fmt: skip
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field}: must be a positive integer, got {value!r}")

    @classmethod
    def from_tensor(
        cls,
        kv_cache: torch.Tensor,
        model_id: str,
        tp_size: int = 1,
        model_kv_heads: int | None = None,
        kv_cache_dtype: str = "auto",
        weight_quantization: str = "none",
        quantized_geometry: tuple[str, int, int, int] | None = None,
    ) -> KVLayout:
        """The layout of `kv_cache`; with tensor parallelism, `kv_cache` is one rank's part and
        `model_kv_heads` the model's total. A quantized cache (`kv_cache_dtype` int8 / fp8) is
        bytes, so `quantized_geometry` says what its regions hold: (the model's dtype, which
        computed the values, block_size, kv_heads, head_dim)."""
        if kv_cache_dtype != "auto":
            return cls._from_quantized(kv_cache, model_id, tp_size, model_kv_heads, kv_cache_dtype,
                                       weight_quantization, quantized_geometry)  # fmt: skip
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "kv_cache: expected shape [num_layers, num_blocks, 2, block_size, kv_heads, head_dim], "
                f"got {tuple(kv_cache.shape)}"
            )
        layers, blocks, _, block_size, heads, head_dim = kv_cache.shape
        return cls(
            model_id=model_id,
            dtype=str(kv_cache.dtype).removeprefix("torch."),
            num_layers=layers,
            num_blocks=blocks,
            block_size=block_size,
            num_kv_heads=heads,
            head_dim=head_dim,
            tp_size=tp_size,
            model_kv_heads=model_kv_heads,
            kv_cache_dtype=kv_cache_dtype,
            weight_quantization=weight_quantization,
        )

    @classmethod
    def _from_quantized(cls, kv_cache, model_id, tp_size, model_kv_heads, kv_cache_dtype, weight_quantization,
                        geometry) -> KVLayout:  # fmt: skip
        if geometry is None:
            raise ValueError(
                f"quantized_geometry: a {kv_cache_dtype} KV cache needs (dtype, block_size, kv_heads, head_dim)"
            )
        dtype, block_size, heads, head_dim = geometry
        expected = region_bytes(block_size, heads, head_dim)
        if kv_cache.dim() != 3 or kv_cache.dtype != torch.uint8 or kv_cache.shape[2] != expected:
            raise ValueError(
                f"kv_cache: a {kv_cache_dtype} KV cache is uint8 [num_layers, num_blocks, {expected}], "
                f"got {kv_cache.dtype} {tuple(kv_cache.shape)}"
            )
        return cls(
            model_id=model_id, dtype=dtype, num_layers=kv_cache.shape[0], num_blocks=kv_cache.shape[1],
            block_size=block_size, num_kv_heads=heads, head_dim=head_dim, tp_size=tp_size,
            model_kv_heads=model_kv_heads, kv_cache_dtype=kv_cache_dtype, weight_quantization=weight_quantization,
        )  # fmt: skip

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def tp_key(self) -> tuple[int, int]:
        """(ranks, KV heads of the model): two workers' caches split the same way when equal."""
        return self.tp_size, self.model_kv_heads

    @property
    def itemsize(self) -> int:
        """Bytes of one stored K/V value (1 in a quantized cache; `dtype` is then what computed it)."""
        return 1 if self.quantized else _ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one (layer, block) region: K and V of block_size tokens (and their scales)."""
        if self.quantized:
            return region_bytes(self.block_size, self.num_kv_heads, self.head_dim)
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def num_regions(self) -> int:
        return self.num_layers * self.num_blocks

    def compat_hash(self) -> str:
        """Equal for caches whose blocks are interchangeable (num_blocks excluded: pools differ)."""
        key = "|".join(
            str(v)
            for v in (
                PROTOCOL_VERSION, self.model_id, self.dtype, self.num_layers,
                self.num_kv_heads, self.head_dim, self.block_size, self.kv_cache_dtype, self.weight_quantization,
            )
        )  # fmt: skip
        if self.tp_size > 1:  # one rank's hash is what it was before tensor parallelism
            key += f"|tp{self.tp_size}/{self.model_kv_heads}"
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    def check_tensor(self, kv_cache: torch.Tensor) -> None:
        """The tensor a transport registers must be exactly this layout, contiguous."""
        actual = KVLayout.from_tensor(
            kv_cache, self.model_id, self.tp_size, self.model_kv_heads, self.kv_cache_dtype,
            self.weight_quantization, (self.dtype, self.block_size, self.num_kv_heads, self.head_dim),
        )  # fmt: skip
        if actual != self:
            raise ValueError(f"kv_cache: tensor layout {actual} does not match the given layout {self}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache: the tensor must be contiguous (it is registered as one region)")

    def region_indices(self, layers: range | list[int], blocks: list[int]):
        """Flat region indices (layer-major) for every layer x block, validated against this layout."""
        for layer in layers:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"layers: layer {layer} out of range [0, {self.num_layers})")
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block ids: block {block} out of range [0, {self.num_blocks})")
        return [layer * self.num_blocks + block for layer in layers for block in blocks]
