"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights live in plain tensors, q/k/v and gate/up fused at load time so each layer runs four
matmuls. Attention, norm, RoPE and activation go through the `disagg.kernels` op table so the
same model runs the torch twins on CPU and Triton kernels on CUDA (or the native CPU kernels);
which of them a step takes is chosen once per step (`attention_step`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.kernels import cpu_decode_step, get_ops, native_build
from disagg.kernels.kv_quant import KVQuantFormat
from disagg.kernels.quantized import QuantizedWeight, linear
from disagg.worker.model import kv_memory
from disagg.worker.model.attention_step import NATIVE_KERNELS, attention_step
from disagg.worker.model.attention_step import add_rms_norm_ as add_rms_norm_  # the float32 shortcuts
from disagg.worker.model.attention_step import decode_attention_one_group as decode_attention_one_group
from disagg.worker.model.attention_step import rotary_full_width as rotary_full_width
from disagg.worker.model.attention_step import rotate_heads_full_width as rotate_heads_full_width
from disagg.worker.model.attention_step import single_decode_group as single_decode_group
from disagg.worker.model.config import ModelConfig, RopeConfig
from disagg.worker.model.forward_batch import ForwardBatch
from disagg.worker.model.parallel import TensorParallel


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor | QuantizedWeight  # [(Hq + 2 Hkv) * D, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | QuantizedWeight  # [H, Hq * D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor | QuantizedWeight  # [2 I, H], gate rows first
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | QuantizedWeight  # [H, I]
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [D], one RMSNorm weight every head shares (Qwen3)
    k_norm: torch.Tensor | None = None  # [D]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor | QuantizedWeight  # [V, H]; the embedding itself when tied and not quantized


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies [D/2] in float32, with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        # Long wavelengths (beyond the original context / low_freq_factor) are slowed down by
        # `factor`, short ones (below context / high_freq_factor) kept, the band between blended.
        old_ctx = rope.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        slowed = torch.where(wavelen > old_ctx / rope.low_freq_factor, inv_freq / rope.factor, inv_freq)
        blend = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - blend) * slowed / rope.factor + blend * slowed
        in_band = (wavelen >= old_ctx / rope.high_freq_factor) & (wavelen <= old_ctx / rope.low_freq_factor)
        return torch.where(in_band, blended, slowed)
    return inv_freq


def rope_cos_sin_cache(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, D] float32: cos of every (position, pair) in the first D/2 columns, sin after."""
    inv_freq = rope_inv_freq(rope, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def qk_norm_(qkv: torch.Tensor, layer: LayerWeights, hq: int, hkv: int, d: int, eps: float, rms_norm) -> None:
    """Qwen3's per-head RMSNorm of q and k, in place in the fused qkv rows, before RoPE (and before
    K is cached). `rms_norm`: the op table's, over one row per head."""
    t, q_end = qkv.shape[0], hq * d
    q, k = qkv[:, :q_end], qkv[:, q_end : q_end + hkv * d]
    q.copy_(rms_norm(q.reshape(t * hq, d), layer.q_norm, eps).view(t, q_end))
    k.copy_(rms_norm(k.reshape(t * hkv, d), layer.k_norm, eps).view(t, hkv * d))


def decode_layers(weights: ModelWeights) -> list[cpu_decode_step.DecodeLayer]:
    """The layers as the native whole-step decode takes them (it has no q/k norm: a model with one
    never runs it)."""
    names = [f.name for f in dataclasses.fields(cpu_decode_step.DecodeLayer)]
    return [cpu_decode_step.DecodeLayer(**{n: getattr(layer, n) for n in names}) for layer in weights.layers]


class LlamaForCausalLM:
    """Forward passes over packed batches; see `forward`."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
    ):
        self.config = config
        self.tp = tp  # this rank's shard and collectives; None: the whole model here
        self.weights = weights
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        if tp is not None:  # heads on this rank: the weights, the cache and attention are the shard's
            self.num_heads, self.num_kv_heads = tp.plan.num_heads, tp.plan.num_kv_heads
        self.head_dim = config.head_dim
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_model_len
        self.scale = self.head_dim**-0.5
        self.ops = get_ops(self.device)
        self.cos_sin_cache = rope_cos_sin_cache(
            config.rope, self.head_dim, config.max_position_embeddings
        ).to(self.device)
        self._q_size = self.num_heads * self.head_dim
        self._kv_size = self.num_kv_heads * self.head_dim
        self._native_decode_step: cpu_decode_step.NativeDecodeStep | None = None
        first = weights.layers[0].qkv if weights.layers else None
        self.quantization = first.scheme if isinstance(first, QuantizedWeight) else "none"
        # the native whole-step decode takes float32 models (with float32 or 8-bit matmul weights)
        # and bf16 ones
        mats = [getattr(layer, name) for layer in weights.layers for name in cpu_decode_step.MATMULS]
        self._whole_step_native = not config.qk_norm and all(
            cpu_decode_step.supports(t, dtype) for t in (*mats, weights.lm_head)
        )  # the native step has no q/k norm
        self.kv_cache_dtype = "auto"  # the model's dtype; int8 / fp8: `use_kv_cache_dtype`
        self.kv_format: KVQuantFormat | None = None  # set when a quantized cache is allocated

    def use_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Store K/V as `kv_cache_dtype` (auto | int8 | fp8) in caches allocated from now on."""
        if kv_cache_dtype != "auto":
            KVQuantFormat(kv_cache_dtype, 1, self.num_kv_heads, self.head_dim)  # validates
        self.kv_cache_dtype = kv_cache_dtype

    def kv_cache_format(self, block_size: int) -> KVQuantFormat | None:
        """The quantized cache's format at `block_size`; None for a cache in the model's dtype."""
        if self.kv_cache_dtype == "auto":
            return None
        return KVQuantFormat(self.kv_cache_dtype, block_size, self.num_kv_heads, self.head_dim)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the whole model's KV cache: [layers, blocks, 2 (K, V), block_size, Hkv, D];
        a quantized cache is bytes [layers, blocks, region_bytes] (`KVQuantFormat`)."""
        if (fmt := self.kv_cache_format(block_size)) is not None:
            return fmt.cache_shape(self.num_layers, num_blocks)
        return (self.num_layers, num_blocks, 2, block_size, self.num_kv_heads, self.head_dim)

    def kv_cache_block_bytes(self, block_size: int) -> int:
        """Bytes one block takes across all layers (for sizing the cache from a memory budget)."""
        itemsize = 1 if self.kv_cache_dtype != "auto" else self.dtype.itemsize
        return math.prod(self.kv_cache_shape(1, block_size)) * itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """The zeroed cache; in host RAM on huge pages (`kv_memory`: faster KV transfer)."""
        self.kv_format = self.kv_cache_format(block_size)
        dtype = self.dtype if self.kv_format is None else torch.uint8
        return kv_memory.zeros(self.kv_cache_shape(num_blocks, block_size), dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: torch.Tensor,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab].

        Writes every token's K/V into `kv_caches` at `batch.slot_mapping`. `layer_hook(i)` is
        called as soon as layer i's K/V are in the cache, so their transfer can overlap the
        remaining layers. The kernels of rotary, the K/V writes, attention and the residual stream
        are chosen once for the step (`attention_step`); decode steps of a few sequences on CPU run
        whole in one native call (`native_decode_step`).
        """
        if batch.is_prefill and batch.cu_seqlens_q is None:
            raise ValueError("a prefill ForwardBatch needs cu_seqlens_q")
        if self._whole_step_ok(batch, kv_caches, layer_hook):
            return self._forward_whole_step(batch, kv_caches)
        step = attention_step(self, batch, kv_caches)
        w, eps = self.weights, self.config.rms_norm_eps
        num_tokens = batch.input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_end, k_end = self._q_size, self._q_size + self._kv_size

        residual = self._embed(batch.input_ids)  # a fresh tensor: some paths sum into it in place
        hidden = step.norm(residual, w.layers[0].input_norm)
        for i, layer in enumerate(w.layers):
            if i > 0:
                hidden, residual = step.norm_residual(hidden, residual, layer.input_norm)
            qkv = linear(hidden, layer.qkv, layer.qkv_bias)
            if layer.q_norm is not None:
                qk_norm_(qkv, layer, hq, hkv, d, eps, self.ops.rms_norm)
            q = qkv[:, :q_end].view(num_tokens, hq, d)
            k = qkv[:, q_end:k_end].view(num_tokens, hkv, d)
            v = qkv[:, k_end:].view(num_tokens, hkv, d)
            layer_cache = kv_caches[i]
            step.rotate_and_write(qkv, q, k, v, layer_cache)
            if layer_hook is not None:
                layer_hook(i)
            attn = step.attend(q, k, v, layer_cache)
            hidden = self._row_linear(attn.reshape(num_tokens, hq * d), layer.o, layer.o_bias)
            hidden, residual = step.norm_residual(hidden, residual, layer.post_norm)
            gate_up = linear(hidden, layer.gate_up, layer.gate_up_bias)
            hidden = self._row_linear(step.silu_and_mul(gate_up), layer.down, layer.down_bias)

        # Only the wanted rows go through the final norm and the (large) vocabulary projection.
        idx = batch.logits_indices
        if idx.shape[0] != num_tokens or batch.is_prefill:  # (in a decode step every row samples)
            hidden, residual = hidden.index_select(0, idx), residual.index_select(0, idx)
        return self._lm_head(step.final_norm(hidden, residual, w.norm))

    __call__ = forward

    # The three places tensor parallelism changes the math; plain torch calls without it.
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.weights.embed)
        return self.tp.embed(input_ids, self.weights.embed)

    def _row_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, weight, bias) if self.tp is None else self.tp.row_linear(x, weight, bias)

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return linear(x, self.weights.lm_head).float()
        return self.tp.lm_head(x, self.weights.lm_head).float()

    def _native_ok(self, kv_caches: torch.Tensor) -> bool:
        """float32 or bfloat16 on CPU with the plain-torch op table: the native kernels can take the
        step. A quantized cache (float32 models): prefill chunks' attention reads the step's blocks
        dequantized in torch (no native prefill attention reads 8-bit K/V yet); the rest is native."""
        return (
            self.ops.backend == "torch"
            and self.dtype in NATIVE_KERNELS
            and (self.kv_format is None or self.dtype == torch.float32)
            and kv_caches.dtype == (self.dtype if self.kv_format is None else torch.uint8)
            and kv_caches.device.type == "cpu"
            and kv_caches.is_contiguous()
            and native_build.available()
        )

    def native_decode_step(self) -> cpu_decode_step.NativeDecodeStep:
        """The whole-step native decode of small batches, bound to this model's weights once."""
        if self._native_decode_step is None:
            w = self.weights
            self._native_decode_step = cpu_decode_step.NativeDecodeStep(
                decode_layers(w), w.norm, w.lm_head, self.cos_sin_cache, num_q_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, eps=self.config.rms_norm_eps, scale=self.scale,
            )  # fmt: skip
        return self._native_decode_step

    def _whole_step_ok(
        self, batch: ForwardBatch, kv_caches: torch.Tensor, layer_hook: Callable[[int], None] | None
    ) -> bool:
        """A decode step of at most `cpu_decode_step.max_batch` sequences (no layer hook, no
        collectives: the native whole-step decode runs every layer in one call)."""
        return (
            not batch.is_prefill
            and self.tp is None
            and layer_hook is None
            and self._whole_step_native
            and self._native_ok(kv_caches)
            and batch.input_ids.shape[0] <= cpu_decode_step.max_batch(self.weights.layers[0].qkv)
        )

    def _forward_whole_step(self, batch: ForwardBatch, kv_caches: torch.Tensor) -> torch.Tensor:
        logits = self.native_decode_step()(
            F.embedding(batch.input_ids, self.weights.embed), batch.positions, batch.slot_mapping, kv_caches,
            batch.block_tables, batch.seq_lens, self.kv_format,
        )  # fmt: skip
        idx = batch.logits_indices
        return logits if idx.shape[0] == batch.input_ids.shape[0] else logits.index_select(0, idx)
