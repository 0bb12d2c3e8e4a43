"""CUDA graphs for the decode path: one captured forward pass per batch-size bucket.

A decode step launches hundreds of small kernels; replaying a captured graph removes their
launch overhead. A graph replays fixed kernels on fixed addresses, so:
  * a step's batch is padded up to the nearest captured bucket size;
  * its inputs are copied into static buffers the graph was captured on (`DecodeInputBuffers`);
  * padded rows are inert: slot -1 (no KV write), seq_len 1 reading one position of a scratch
    block, logits discarded. Any valid block id works as the scratch block, since padded rows
    only read it; a block the allocator never hands out keeps the read free of live data;
  * every op in the forward pass must stay on the device (no host reads of device values):
    the Triton ops do; the torch twins do not, and capture falls back to eager with a warning.
Prefill stays eager. `DISAGG_CUDA_GRAPHS=0` (or `enabled=False`) turns graphs off.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable

import torch

from disagg.worker.model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

GRAPHS_ENV = "DISAGG_CUDA_GRAPHS"
_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STEP = 8

ForwardFn = Callable[[ForwardBatch, torch.Tensor], torch.Tensor]


def graphs_enabled_from_env() -> bool:
    """False when DISAGG_CUDA_GRAPHS is 0/false/no/off; True when unset or 1/true/yes/on."""
    value = os.environ.get(GRAPHS_ENV, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(f"{GRAPHS_ENV} must be 0 or 1, got {value!r}")


def batch_size_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = [b for b in _SMALL_BUCKETS if b < max_batch]
    buckets += range(2 * _BUCKET_STEP, max_batch, _BUCKET_STEP)
    return [*buckets, max_batch]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding num_seqs sequences (buckets sorted), None if none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


class DecodeInputBuffers:
    """Decode inputs at fixed addresses for up to max_batch sequences; `load` copies a step in
    and pads it to a bucket. Device-agnostic, so the padding is tested on CPU too."""

    def __init__(
        self, max_batch: int, max_blocks_per_seq: int, device: torch.device | str, scratch_block: int = 0
    ):
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        if scratch_block < 0:
            raise ValueError(f"scratch_block must be a valid block id, got {scratch_block}")
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_block = scratch_block
        kw = dict(device=device)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, **kw)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, **kw)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, **kw)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, **kw)
        self.block_tables = torch.full(
            (max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int32, **kw
        )
        # the graph computes logits for every row; the caller's logits_indices pick after replay
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, **kw)

    def check(self, batch: ForwardBatch) -> None:
        """Raise ValueError naming what makes `batch` unfit for these buffers."""
        if batch.is_prefill:
            raise ValueError("batch.is_prefill: only decode steps run from CUDA graphs")
        n = batch.num_seqs
        if batch.num_tokens != n:
            raise ValueError(
                f"batch.input_ids: a decode step has one token per sequence, got {batch.num_tokens} for {n}"
            )
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch.seq_lens: {n} sequences, buffers hold 1..{self.max_batch}")
        width = batch.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(
                f"batch.block_tables: {width} blocks per sequence, buffers hold {self.max_blocks_per_seq}"
            )

    def view(self, bucket: int) -> ForwardBatch:
        """The first `bucket` rows as a decode ForwardBatch (what a graph is captured on)."""
        return ForwardBatch(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            logits_indices=self.logits_indices[:bucket],
            is_prefill=False,
        )

    def load(self, batch: ForwardBatch, bucket: int) -> ForwardBatch:
        """Copy `batch` into rows 0..n-1, make rows n..bucket-1 padding; return `view(bucket)`."""
        self.check(batch)
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        if not n <= bucket <= self.max_batch:
            raise ValueError(f"bucket must be in [{n}, {self.max_batch}], got {bucket}")
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        # columns past `width` keep stale ids: a row reads only the blocks its seq_len covers
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        self.input_ids[n:bucket] = 0
        self.positions[n:bucket] = 0
        self.slot_mapping[n:bucket] = -1
        self.seq_lens[n:bucket] = 1
        self.block_tables[n:bucket, 0] = self.scratch_block
        return self.view(bucket)


class CudaGraphRunner:
    """Captures `forward_fn(batch, kv_caches) -> logits` for decode batches once per bucket
    and replays it. `run` returns the logits of `batch.logits_indices`, like `forward_fn`.

    Use: `runner.capture()` once after the KV cache is allocated (startup), then for each
    decode step `runner.run(batch) if runner.can_run(batch) else forward_fn(batch, kv_caches)`.
    """

    def __init__(
        self,
        forward_fn: ForwardFn,
        kv_caches: torch.Tensor,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device | str,
        *,
        buckets: list[int] | None = None,
        scratch_block: int = 0,
        enabled: bool | None = None,
    ):
        self.forward_fn = forward_fn
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.buckets = sorted(buckets) if buckets else batch_size_buckets(max_batch)
        if self.buckets[0] < 1 or self.buckets[-1] > max_batch:
            raise ValueError(f"buckets must lie in [1, max_batch={max_batch}], got {self.buckets}")
        want = graphs_enabled_from_env() if enabled is None else enabled
        self.enabled = want and self.device.type == "cuda"
        self.buffers = DecodeInputBuffers(max_batch, max_blocks_per_seq, self.device, scratch_block)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._graphs)

    def can_run(self, batch: ForwardBatch) -> bool:
        if not self.enabled:
            return False
        try:
            self.buffers.check(batch)
        except ValueError:
            return False
        return bucket_for(batch.num_seqs, self.buckets) is not None

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool.
        On failure (an op that reads device values on the host, say) graphs are disabled."""
        if not self.enabled:
            return
        try:
            for bucket in reversed(self.buckets):
                self._capture(bucket)
        except RuntimeError as exc:
            log.warning("CUDA graph capture failed, decode runs eagerly: %s", exc)
            self.enabled = False
            self._graphs.clear()
            self._outputs.clear()
            return
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _capture(self, bucket: int) -> None:
        # the buffers hold padding rows only, so neither warm-up nor capture writes the KV cache
        self.buffers.slot_mapping.fill_(-1)
        batch = self.buffers.view(bucket)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles kernels and sets up library workspaces outside capture
                self.forward_fn(batch, self.kv_caches)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.forward_fn(batch, self.kv_caches)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[bucket] = graph
        self._outputs[bucket] = out

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] for a decode step; eager when graphs are off."""
        if not self.enabled:
            return self.forward_fn(batch, self.kv_caches)
        bucket = bucket_for(batch.num_seqs, self.buckets)
        if bucket is None:
            raise ValueError(
                f"batch.seq_lens: {batch.num_seqs} sequences exceed the largest bucket {self.buckets[-1]}"
            )
        if bucket not in self._graphs:
            self._capture(bucket)
        self.buffers.load(batch, bucket)
        self._graphs[bucket].replay()
        # indexing copies, so the result survives the next replay overwriting the output buffer
        return self._outputs[bucket].index_select(0, batch.logits_indices.to(self.device))
