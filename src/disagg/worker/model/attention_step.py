"""The attention path of one forward step, chosen once per step from the batch and the cache.

Every layer of a step rotates q/k, writes K/V and attends the same way: which kernels do it
depends only on the model's device and dtype, the cache (contiguous, quantized) and the batch.
`attention_step(model, batch, kv_caches)` picks one of the classes below at the start of
`LlamaForCausalLM.forward` and builds it with what every layer would otherwise recompute (the
rotary angles of the positions, the cache rows of the K/V writes, the decode gather plan or the
native per-step attention plan, the dequantized blocks of a quantized cache). The layer loop then
calls its methods and has no choice of its own:

    `rotate_and_write(qkv, q, k, v, layer_cache)`  rotary of q and k (in place), K/V into the cache
    `attend(q, k, v, layer_cache)`                 attention output [T, Hq, D]
    `norm(x, w)`, `norm_residual(x, residual, w)`, `final_norm(x, residual, w)`, `silu_and_mul(x)`:
                                                   the residual stream's kernels that go with the path

The paths: `NativeStep` / `NativeQuantizedCacheStep` (CPU, float32 or bf16: the native per-op
kernels), `Float32TorchStep` (plain torch, float32, contiguous cache: the short forms below),
`PlannedTorchStep` (plain torch, contiguous cache), `QuantizedCacheStep` (8-bit cache through the
op table) and `OpTableStep` (the op table as is: Triton on CUDA, a strided cache on CPU).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from disagg.kernels import cpu_bf16, cpu_kv_quant, cpu_native, torch_ops
from disagg.kernels.kv_quant import QuantizedKVStep
from disagg.worker.model.forward_batch import ForwardBatch


class StepModel(Protocol):
    """What a step reads of its model (`LlamaForCausalLM`, which builds the step, so the model
    module imports this one and not the other way)."""

    ops: Any
    config: Any
    weights: Any
    dtype: torch.dtype
    scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos_sin_cache: torch.Tensor
    kv_format: Any

    def _native_ok(self, kv_caches: torch.Tensor) -> bool: ...


# The per-op native kernels of each dtype they take (same calls; bf16 keeps bf16 activations and KV).
NATIVE_KERNELS = {torch.float32: cpu_native, torch.bfloat16: cpu_bf16}


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


class AttentionStep(abc.ABC):
    """What every path shares: the step's fields, the attention of prompt chunks and the residual
    stream's kernels through the op table. A path defines `rotate_and_write` and
    `decode_attention`, and overrides the rest where it has its own kernels."""

    def __init__(self, model: StepModel, batch: ForwardBatch):
        self.ops, self.batch, self.scale = model.ops, batch, model.scale
        self.eps = model.config.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = model.num_heads, model.num_kv_heads, model.head_dim
        self.cos_sin_cache = model.cos_sin_cache
        # the step's attention, bound once: the prompt chunks' kernel or the decode one
        self.attend: Callable[..., torch.Tensor] = (
            self.prefill_attention if batch.is_prefill else self.decode_attention
        )

    # ---- per layer: rotary + K/V write, attention -------------------------------------------
    @abc.abstractmethod
    def rotate_and_write(
        self, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor
    ) -> None:
        """Rotate q and k in place (views of the fused `qkv`), write k and v into the layer's cache."""

    @abc.abstractmethod
    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor
    ) -> torch.Tensor:
        """Attention of a decode step (one token per sequence, its K/V already in the cache)."""

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor
    ) -> torch.Tensor:
        """Attention of a prefill (or mixed) step."""
        return prefill_step_attention(self.ops, q, k, v, layer_cache, self.batch, self.scale)

    def _qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k, adjacent in the fused projection output, as one [T, Hq + Hkv, D] view."""
        h, d = self.num_heads + self.num_kv_heads, self.head_dim
        return qkv[:, : h * d].view(qkv.shape[0], h, d)

    # ---- the residual stream ------------------------------------------------------------------
    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The first layer's input norm (the embeddings are the residual)."""
        return self.ops.rms_norm(x, weight, self.eps)

    def norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of x + residual, the new residual)."""
        return self.ops.rms_norm(x, weight, self.eps, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's last norm of x + residual (rows the logits are wanted of)."""
        return self.ops.rms_norm(x + residual, weight, self.eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class OpTableStep(AttentionStep):
    """The op table as is: Triton kernels on CUDA; on CPU the torch twins over a strided cache."""

    def rotate_and_write(self, qkv, q, k, v, layer_cache) -> None:
        self.ops.rotary_embedding(self.batch.positions, q, k, self.cos_sin_cache)
        self.ops.write_kv_cache(k, v, layer_cache, self.batch.slot_mapping)

    def decode_attention(self, q, k, v, layer_cache) -> torch.Tensor:
        b = self.batch
        return self.ops.decode_attention(q, layer_cache, b.block_tables, b.seq_lens, self.scale)


class QuantizedCacheStep(AttentionStep):
    """An 8-bit cache through the op table: quantizing writes, decode attention over 8-bit K/V.
    Prompt chunks attend to their own K/V as the cache holds them, as later steps will: a token's
    output does not depend on how its prompt was chunked, cached or where it was prefilled. They
    attend over the step's blocks dequantized (no 8-bit prefill kernel yet)."""

    def __init__(self, model: StepModel, batch: ForwardBatch):
        super().__init__(model, batch)
        self.fmt = model.kv_format
        nd = batch.num_decodes if batch.is_prefill else batch.input_ids.shape[0]
        self._decode = functools.partial(
            self.ops.decode_attention_quantized, block_tables=batch.block_tables[:nd],
            seq_lens=batch.seq_lens[:nd], scale=self.scale, fmt=self.fmt,
        )  # fmt: skip
        if batch.is_prefill:
            self._dequantized = QuantizedKVStep(self.fmt, batch.block_tables, batch.seq_lens, model.dtype)
            self._chunks = dataclasses.replace(batch, block_tables=self._dequantized.tables)

    def rotate_and_write(self, qkv, q, k, v, layer_cache) -> None:
        self.ops.rotary_embedding(self.batch.positions, q, k, self.cos_sin_cache)
        self.ops.write_kv_quantized(k, v, layer_cache, self.batch.slot_mapping, self.fmt)

    def prefill_attention(self, q, k, v, layer_cache) -> torch.Tensor:
        k, v = self.fmt.read_rows(layer_cache, self.batch.slot_mapping, q.dtype)  # as stored
        decode = functools.partial(self._decode, layer_cache=layer_cache) if self.batch.num_decodes else None
        return prefill_step_attention(
            self.ops, q, k, v, self._dequantized.layer_cache(layer_cache), self._chunks, self.scale, decode
        )

    def decode_attention(self, q, k, v, layer_cache) -> torch.Tensor:
        return self._decode(q, layer_cache=layer_cache)


class PlannedTorchStep(AttentionStep):
    """The plain-torch op table over a contiguous cache, with once per step what every layer would
    otherwise redo: the cos/sin rows of the positions, the cache rows of the K/V writes, the
    decode gather plan."""

    def __init__(self, model: StepModel, batch: ForwardBatch, kv_caches: torch.Tensor):
        super().__init__(model, batch)
        self.block_size = kv_caches.shape[3]
        self.cos, self.sin = torch_ops.rotary_cos_sin(batch.positions, self.cos_sin_cache)
        self.keep, self.k_rows = torch_ops.kv_write_rows(batch.slot_mapping, self.block_size)
        if not batch.is_prefill:
            self.decode_plan = torch_ops.plan_decode(
                batch.block_tables, batch.seq_lens, self.block_size, self.num_kv_heads
            )

    def rotate_and_write(self, qkv, q, k, v, layer_cache) -> None:
        torch_ops.rotate_heads(self._qk(qkv), self.cos, self.sin)
        torch_ops.write_kv_rows(k, v, layer_cache, self.keep, self.k_rows)

    def decode_attention(self, q, k, v, layer_cache) -> torch.Tensor:
        return torch_ops.decode_attention_planned(q, layer_cache, self.decode_plan, self.scale)


class Float32TorchStep(PlannedTorchStep):
    """`PlannedTorchStep` of a float32 model: the residual sum accumulated in place (no new tensor
    per add), rotary in its five-op form, the K/V writes with the V rows computed once per step,
    and decode attention of one unpadded group without the general plan's copies."""

    def __init__(self, model: StepModel, batch: ForwardBatch, kv_caches: torch.Tensor):
        super().__init__(model, batch, kv_caches)
        self.cos_full, self.sin_signed = rotary_full_width(self.cos, self.sin)
        self.v_rows = self.k_rows + self.block_size
        if not batch.is_prefill and (single := single_decode_group(self.decode_plan)) is not None:
            self.single = single
            self.attend = self.decode_attention_one_group

    def rotate_and_write(self, qkv, q, k, v, layer_cache) -> None:
        rotate_heads_full_width(self._qk(qkv), self.cos_full, self.sin_signed)
        if self.keep is None:  # `torch_ops.write_kv_rows` with the V rows of the step
            flat_kv = layer_cache.view(-1, self.num_kv_heads, self.head_dim)
            flat_kv.index_copy_(0, self.k_rows, k)
            flat_kv.index_copy_(0, self.v_rows, v)
        else:
            torch_ops.write_kv_rows(k, v, layer_cache, self.keep, self.k_rows)

    def decode_attention_one_group(self, q, k, v, layer_cache) -> torch.Tensor:
        return decode_attention_one_group(q, layer_cache, self.single, self.scale)

    def norm_residual(self, x, residual, weight) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm_(residual, x, weight, self.eps), residual


class NativeStep(AttentionStep):
    """The native CPU kernels (float32 or bf16, `NATIVE_KERNELS`): rotary + K/V write in one call,
    decode attention planned once per step (`PagedDecodeAttention`), the fused add + norm and the
    activation; prompt chunks attend through the op table (torch)."""

    def __init__(self, model: StepModel, batch: ForwardBatch, kv_caches: torch.Tensor):
        super().__init__(model, batch)
        self.kernels = NATIVE_KERNELS[model.dtype]
        self.fmt = model.kv_format  # None: a cache in the model's dtype
        num_blocks = kv_caches.shape[1]
        block_size = kv_caches.shape[3] if self.fmt is None else self.fmt.block_size
        cpu_native.check_step_bounds(
            batch.positions, batch.slot_mapping, self.cos_sin_cache.shape[0], num_blocks * block_size
        )
        self._decode = None
        nd = batch.input_ids.shape[0] if not batch.is_prefill else batch.num_decodes  # one token each
        if nd:  # lengths and tables are the same in every layer of the step
            plan = (
                batch.block_tables[:nd],
                batch.seq_lens[:nd],
                self.num_heads,
                self.num_kv_heads,
                num_blocks,
            )
            self._decode = self._decode_attention_of(plan)

    def _decode_attention_of(self, plan: tuple) -> cpu_native.PagedDecodeAttention:
        return self.kernels.PagedDecodeAttention(*plan)

    def _decode_rows(self, layer_cache: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A mixed step's decode rows' attention in this layer (None: no decode rows)."""
        return self._decode and functools.partial(self._decode, kv_cache=layer_cache, scale=self.scale)

    def rotate_and_write(self, qkv, q, k, v, layer_cache) -> None:
        b = self.batch
        self.kernels.rotary_write_kv(
            qkv,
            self.cos_sin_cache,
            b.positions,
            layer_cache,
            b.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
        )

    def prefill_attention(self, q, k, v, layer_cache) -> torch.Tensor:
        return prefill_step_attention(
            self.ops, q, k, v, layer_cache, self.batch, self.scale, self._decode_rows(layer_cache)
        )

    def decode_attention(self, q, k, v, layer_cache) -> torch.Tensor:
        return self._decode(q, layer_cache, self.scale)

    def norm(self, x, weight) -> torch.Tensor:
        return self.kernels.add_rms_norm(x, weight, self.eps)

    def norm_residual(self, x, residual, weight) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_rms_norm(x, weight, self.eps, residual), residual  # residual += x

    def final_norm(self, x, residual, weight) -> torch.Tensor:
        return self.kernels.add_rms_norm(x, weight, self.eps, residual)

    def silu_and_mul(self, x) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)


class NativeQuantizedCacheStep(NativeStep):
    """`NativeStep` over an 8-bit cache (float32 models): quantizing rotary + write and decode
    attention over 8-bit K/V natively; prompt chunks attend in torch over the step's blocks
    dequantized, to their own K/V as stored."""

    def __init__(self, model: StepModel, batch: ForwardBatch, kv_caches: torch.Tensor):
        super().__init__(model, batch, kv_caches)
        if batch.is_prefill:
            self._dequantized = QuantizedKVStep(self.fmt, batch.block_tables, batch.seq_lens, torch.float32)
            self._chunks = dataclasses.replace(batch, block_tables=self._dequantized.tables)

    def _decode_attention_of(self, plan: tuple) -> cpu_native.PagedDecodeAttention:
        return cpu_kv_quant.QuantizedPagedDecodeAttention(self.fmt, *plan)

    def rotate_and_write(self, qkv, q, k, v, layer_cache) -> None:
        b = self.batch
        cpu_kv_quant.rotary_write_kv(
            qkv, self.cos_sin_cache, b.positions, layer_cache, b.slot_mapping, self.num_heads,
            self.num_kv_heads, self.fmt,
        )  # fmt: skip

    def prefill_attention(self, q, k, v, layer_cache) -> torch.Tensor:
        k, v = self.fmt.read_rows(layer_cache, self.batch.slot_mapping, torch.float32)  # as stored
        return prefill_step_attention(
            self.ops, q, k, v, self._dequantized.layer_cache(layer_cache), self._chunks, self.scale,
            self._decode_rows(layer_cache),
        )  # fmt: skip


def attention_step(model: StepModel, batch: ForwardBatch, kv_caches: torch.Tensor) -> AttentionStep:
    """The path of this step (see the module text), built with its per-step data."""
    if model._native_ok(kv_caches):
        return (NativeStep if model.kv_format is None else NativeQuantizedCacheStep)(model, batch, kv_caches)
    if kv_caches.dtype == torch.uint8:
        if model.kv_format is None:
            raise ValueError("kv_caches: a byte (quantized) cache needs the model's kv_cache_dtype set")
        return QuantizedCacheStep(model, batch)
    if model.ops.backend != "torch" or not kv_caches.is_contiguous():
        return OpTableStep(model, batch)
    w = model.weights
    if w.norm.dtype == torch.float32 and w.embed.dtype == torch.float32:  # float32 activations
        return Float32TorchStep(model, batch, kv_caches)
    return PlannedTorchStep(model, batch, kv_caches)
