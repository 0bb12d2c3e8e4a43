"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights live in plain tensors, q/k/v and gate/up fused at load time so each layer runs four
matmuls. Attention, norm, RoPE and activation go through the `disagg.kernels` op table so the
same model runs the torch twins on CPU and Triton kernels on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.kernels import cpu_bf16, cpu_decode_step, cpu_kv_quant, cpu_native, get_ops, torch_ops
from disagg.kernels.kv_quant import KVQuantFormat, QuantizedKVStep
from disagg.kernels.quantized import QuantizedWeight, linear
from disagg.worker.model import kv_memory
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


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Float32 `rms_norm(x, weight, eps, residual)` with the sum accumulated into `residual` in
    place: the same additions (float addition commutes exactly) without a new tensor per layer."""
    residual.add_(x)
    return F.rms_norm(residual, weight.shape, weight, eps)


def rotary_full_width(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From `rotary_cos_sin`'s half-width [T, 1, D/2] angles: cos repeated over both halves and
    sin as (-sin, sin), so that rotating is x * cos + swap_halves(x) * sin (once per step)."""
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate_heads_full_width(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """`torch_ops.rotate_heads` of float32 x [T, H, D] in five ops instead of a dozen; each output
    is the same two products and one addition (x2 * -sin equals -(x2 * sin) exactly)."""
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    x.copy_(x * cos_full + swapped * sin_signed)


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


def single_decode_group(plan: list[torch_ops.DecodeGroup]) -> torch_ops.DecodeGroup | None:
    """The plan's only group when it covers the whole batch with no padding (always so for one
    sequence), else None."""
    if len(plan) == 1 and plan[0].index is None and plan[0].mask is None:
        return plan[0]
    return None


def decode_attention_one_group(
    q: torch.Tensor, kv_cache: torch.Tensor, group: torch_ops.DecodeGroup, scale: float
) -> torch.Tensor:
    """`torch_ops.decode_attention_planned` for float32 q [B, Hq, D] and a plan of one unpadded
    group: the same gather and SDPA call, without the output buffer and the copies into it."""
    b, _, d = q.shape
    flat = kv_cache.view(-1, d)
    kv = flat.index_select(0, group.rows).view(2, b, kv_cache.shape[3], group.length, d)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], scale=scale, enable_gqa=True)
    return o.squeeze(2)


def prefill_step_attention(
    ops,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    decode_attention: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of a prefill step. In a mixed step the leading `batch.num_decodes` rows are one
    decode token each: they take the decode kernel (`decode_attention(q_rows)` when given, the op
    table's otherwise), the prompt chunks after them the prefill kernel."""
    nd = batch.num_decodes
    if nd == 0:
        return ops.prefill_attention(
            q, k, v, kv_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, scale
        )
    out = torch.empty_like(q)
    if decode_attention is not None:
        out[:nd] = decode_attention(q[:nd])
    else:
        out[:nd] = ops.decode_attention(q[:nd], kv_cache, batch.block_tables[:nd], batch.seq_lens[:nd], scale)
    out[nd:] = ops.prefill_attention(
        q[nd:],
        k[nd:],
        v[nd:],
        kv_cache,
        batch.block_tables[nd:],
        batch.cu_seqlens_q[nd:] - nd,
        batch.seq_lens[nd:],
        scale,
    )
    return out


# The per-op native kernels of each dtype they take (same calls; bf16 keeps bf16 activations and KV).
NATIVE_KERNELS = {torch.float32: cpu_native, torch.bfloat16: cpu_bf16}


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
        remaining layers.
        """
        if batch.is_prefill and batch.cu_seqlens_q is None:
            raise ValueError("a prefill ForwardBatch needs cu_seqlens_q")
        if self._native_ok(kv_caches):
            return self._forward_native(batch, kv_caches, layer_hook)
        ops, w, eps = self.ops, self.weights, self.config.rms_norm_eps
        quantized = None  # a quantized cache: the op table's 8-bit writes and decode attention
        if kv_caches.dtype == torch.uint8:
            if self.kv_format is None:
                raise ValueError("kv_caches: a byte (quantized) cache needs the model's kv_cache_dtype set")
            quantized = self.kv_format
            # prompt chunks attend over the step's blocks dequantized (no 8-bit prefill kernel yet)
            prefill = (
                QuantizedKVStep(quantized, batch.block_tables, batch.seq_lens, self.dtype)
                if batch.is_prefill
                else None
            )
        num_tokens = batch.input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_end, k_end = self._q_size, self._q_size + self._kv_size

        # The plain-torch path does once per step what every layer would otherwise redo: the
        # cos/sin rows of the positions, the cache rows of the K/V writes, the decode gather plan.
        planned = quantized is None and self.ops.backend == "torch" and kv_caches.is_contiguous()
        if planned:
            block_size = kv_caches.shape[3]
            cos, sin = torch_ops.rotary_cos_sin(batch.positions, self.cos_sin_cache)
            keep, k_rows = torch_ops.kv_write_rows(batch.slot_mapping, block_size)
            if not batch.is_prefill:
                decode_plan = torch_ops.plan_decode(batch.block_tables, batch.seq_lens, block_size, hkv)

        hidden = self._embed(batch.input_ids)
        # float32 on the torch path: the residual sum is accumulated in place (no new tensor per
        # add), rotary and single-group decode attention take their short forms below.
        fast = planned and w.norm.dtype == torch.float32 and hidden.dtype == torch.float32
        if fast:
            cos_full, sin_signed = rotary_full_width(cos, sin)
            v_rows = k_rows + block_size
            single = None if batch.is_prefill else single_decode_group(decode_plan)
        residual = None
        for i, layer in enumerate(w.layers):
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, layer.input_norm, eps)
            elif fast:
                hidden = add_rms_norm_(residual, hidden, layer.input_norm, eps)
            else:
                hidden, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
            qkv = linear(hidden, layer.qkv, layer.qkv_bias)
            if layer.q_norm is not None:
                qk_norm_(qkv, layer, hq, hkv, d, eps, ops.rms_norm)
            q = qkv[:, :q_end].view(num_tokens, hq, d)
            k = qkv[:, q_end:k_end].view(num_tokens, hkv, d)
            v = qkv[:, k_end:].view(num_tokens, hkv, d)
            kv_cache = kv_caches[i]
            if fast:
                rotate_heads_full_width(qkv[:, :k_end].view(num_tokens, hq + hkv, d), cos_full, sin_signed)
                if keep is None:  # `torch_ops.write_kv_rows` with the V rows computed once per step
                    flat_kv = kv_cache.view(-1, hkv, d)
                    flat_kv.index_copy_(0, k_rows, k)
                    flat_kv.index_copy_(0, v_rows, v)
                else:
                    torch_ops.write_kv_rows(k, v, kv_cache, keep, k_rows)
            elif planned:
                torch_ops.rotate_heads(qkv[:, :k_end].view(num_tokens, hq + hkv, d), cos, sin)
                torch_ops.write_kv_rows(k, v, kv_cache, keep, k_rows)
            else:
                ops.rotary_embedding(batch.positions, q, k, self.cos_sin_cache)
                if quantized is None:
                    ops.write_kv_cache(k, v, kv_cache, batch.slot_mapping)
                else:
                    ops.write_kv_quantized(k, v, kv_cache, batch.slot_mapping, quantized)
            if layer_hook is not None:
                layer_hook(i)
            if quantized is not None:
                attn = self._attention_quantized(q, kv_cache, batch, prefill)
            elif batch.is_prefill:
                attn = prefill_step_attention(ops, q, k, v, kv_cache, batch, self.scale)
            elif fast and single is not None:
                attn = decode_attention_one_group(q, kv_cache, single, self.scale)
            elif planned:
                attn = torch_ops.decode_attention_planned(q, kv_cache, decode_plan, self.scale)
            else:
                attn = ops.decode_attention(q, kv_cache, batch.block_tables, batch.seq_lens, self.scale)
            hidden = self._row_linear(attn.reshape(num_tokens, hq * d), layer.o, layer.o_bias)
            if fast:
                hidden = add_rms_norm_(residual, hidden, layer.post_norm, eps)
            else:
                hidden, residual = ops.rms_norm(hidden, layer.post_norm, eps, residual)
            gate_up = linear(hidden, layer.gate_up, layer.gate_up_bias)
            hidden = self._row_linear(ops.silu_and_mul(gate_up), layer.down, layer.down_bias)

        # Only the wanted rows go through the final norm and the (large) vocabulary projection.
        idx = batch.logits_indices
        if idx.shape[0] == num_tokens and not batch.is_prefill:  # decode: every row samples
            last = hidden + residual
        else:
            last = hidden.index_select(0, idx) + residual.index_select(0, idx)
        last = ops.rms_norm(last, w.norm, eps)
        return self._lm_head(last)

    __call__ = forward

    def _attention_quantized(
        self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, prefill: QuantizedKVStep | None
    ) -> torch.Tensor:
        """Attention of one layer over a quantized cache (already holding this step's K/V). Prompt
        chunks attend to their own K/V as the cache holds them, as later steps will: a token's
        output does not depend on how its prompt was chunked, cached or where it was prefilled."""
        ops, fmt, nd = self.ops, self.kv_format, batch.num_decodes if batch.is_prefill else q.shape[0]
        decode = functools.partial(
            ops.decode_attention_quantized, layer_cache=kv_cache, block_tables=batch.block_tables[:nd],
            seq_lens=batch.seq_lens[:nd], scale=self.scale, fmt=fmt,
        )  # fmt: skip
        if not batch.is_prefill:
            return decode(q)
        k, v = fmt.read_rows(kv_cache, batch.slot_mapping, q.dtype)
        chunks = dataclasses.replace(batch, block_tables=prefill.tables)
        return prefill_step_attention(
            ops, q, k, v, prefill.layer_cache(kv_cache), chunks, self.scale, decode if nd else None
        )

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
            and cpu_native.available()
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

    def _forward_native(
        self, batch: ForwardBatch, kv_caches: torch.Tensor, layer_hook: Callable[[int], None] | None
    ) -> torch.Tensor:
        """`forward` with the small per-layer ops (add + norm, rotary + cache write, activation,
        decode attention) in the native CPU kernels; matmuls and prefill attention stay in torch.
        Decode steps of a few sequences run whole in one native call (`native_decode_step`)."""
        w, eps, kernels = self.weights, self.config.rms_norm_eps, NATIVE_KERNELS[self.dtype]
        num_tokens = batch.input_ids.shape[0]
        quantized = self.kv_format  # None: a float32 cache
        whole_step = (
            self.tp is None and layer_hook is None and self._whole_step_native
        )  # no collectives there
        if not batch.is_prefill and whole_step and num_tokens <= cpu_decode_step.MAX_BATCH:
            logits = self.native_decode_step()(
                F.embedding(batch.input_ids, w.embed), batch.positions, batch.slot_mapping, kv_caches,
                batch.block_tables, batch.seq_lens, quantized,
            )  # fmt: skip
            idx = batch.logits_indices
            return logits if idx.shape[0] == num_tokens else logits.index_select(0, idx)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_end, k_end = self._q_size, self._q_size + self._kv_size
        num_blocks = kv_caches.shape[1]
        block_size = kv_caches.shape[3] if quantized is None else quantized.block_size
        cpu_native.check_step_bounds(
            batch.positions, batch.slot_mapping, self.cos_sin_cache.shape[0], num_blocks * block_size
        )
        decode_attention = None
        nd = num_tokens if not batch.is_prefill else batch.num_decodes  # rows of one decode token each
        if nd:  # lengths and tables are the same in every layer of the step
            plan = (batch.block_tables[:nd], batch.seq_lens[:nd], hq, hkv, num_blocks)
            if quantized is None:
                decode_attention = kernels.PagedDecodeAttention(*plan)
            else:
                decode_attention = cpu_kv_quant.QuantizedPagedDecodeAttention(quantized, *plan)
        if quantized is not None and batch.is_prefill:
            dequantized = QuantizedKVStep(quantized, batch.block_tables, batch.seq_lens, torch.float32)
            attn_batch = dataclasses.replace(batch, block_tables=dequantized.tables)
        residual = self._embed(batch.input_ids)  # a fresh tensor: the sum accumulates in it
        hidden = kernels.add_rms_norm(residual, w.layers[0].input_norm, eps)
        for i, layer in enumerate(w.layers):
            if i > 0:
                hidden = kernels.add_rms_norm(hidden, layer.input_norm, eps, residual)
            qkv = linear(hidden, layer.qkv, layer.qkv_bias)
            if layer.q_norm is not None:
                qk_norm_(qkv, layer, hq, hkv, d, eps, self.ops.rms_norm)
            kv_cache = kv_caches[i]
            if quantized is None:
                kernels.rotary_write_kv(
                    qkv, self.cos_sin_cache, batch.positions, kv_cache, batch.slot_mapping, hq, hkv
                )
            else:
                cpu_kv_quant.rotary_write_kv(
                    qkv, self.cos_sin_cache, batch.positions, kv_cache, batch.slot_mapping, hq, hkv, quantized
                )
            if layer_hook is not None:
                layer_hook(i)
            q = qkv[:, :q_end].view(num_tokens, hq, d)
            if not batch.is_prefill:
                attn = decode_attention(q, kv_cache, self.scale)
            elif quantized is not None:  # every K/V written natively, the chunks attend in torch
                k, v = quantized.read_rows(kv_cache, batch.slot_mapping, torch.float32)  # as stored
                attn = prefill_step_attention(
                    self.ops, q, k, v, dequantized.layer_cache(kv_cache), attn_batch, self.scale,
                    decode_attention and functools.partial(decode_attention, kv_cache=kv_cache, scale=self.scale),
                )  # fmt: skip
            else:
                k = qkv[:, q_end:k_end].view(num_tokens, hkv, d)
                v = qkv[:, k_end:].view(num_tokens, hkv, d)
                attn = prefill_step_attention(
                    self.ops, q, k, v, kv_cache, batch, self.scale,
                    decode_attention and functools.partial(decode_attention, kv_cache=kv_cache, scale=self.scale),
                )  # fmt: skip
            hidden = self._row_linear(attn.reshape(num_tokens, hq * d), layer.o, layer.o_bias)
            hidden = kernels.add_rms_norm(hidden, layer.post_norm, eps, residual)
            gate_up = linear(hidden, layer.gate_up, layer.gate_up_bias)
            hidden = self._row_linear(kernels.silu_and_mul(gate_up), layer.down, layer.down_bias)

        idx = batch.logits_indices
        if idx.shape[0] == num_tokens and not batch.is_prefill:  # decode: every row samples
            last = kernels.add_rms_norm(hidden, w.norm, eps, residual)
        else:
            rows = hidden.index_select(0, idx)
            last = kernels.add_rms_norm(rows, w.norm, eps, residual.index_select(0, idx))
        return self._lm_head(last)
