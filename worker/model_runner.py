"""Owns the model and its KV cache; turns a scheduler decision into one forward pass + sampling."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable

import torch

from disagg.worker.forward_batch import ForwardBatch
from disagg.worker.request import Request
from disagg.worker.sampler import Sampler, SamplerOutput
from disagg.worker.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# Without an explicit size, a CPU cache takes this share of available memory, up to the cap:
# host memory is shared with everything else on the machine.
CPU_KV_FRACTION = 0.1
CPU_KV_CAP_BYTES = 2 << 30


# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
_MMAP_THRESHOLD_MAX = 32 << 20
_allocator_tuned = False


def keep_freed_cpu_memory() -> bool:
    """Let glibc recycle multi-MiB CPU blocks instead of returning them to the kernel.

    By default glibc serves every allocation above ~128 KiB-32 MiB (a dynamic threshold) with a
    fresh mmap and unmaps it on free, so each activation, KV gather and logits tensor of every
    step page-faults and zero-fills anew: on a 2-core machine this cost more than the copies
    themselves. Raising the mmap and trim thresholds keeps freed memory in the heap for the next
    step; resident memory stays bounded by the peak working set. Process-wide, idempotent;
    returns whether the setting applied (glibc on Linux only).
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "mallopt"):
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, 4 * _MMAP_THRESHOLD_MAX) == 1 and ok
    _allocator_tuned = ok
    return ok


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_num_blocks(
    block_bytes: int,
    device: torch.device,
    *,
    num_gpu_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    useful_blocks: int | None = None,
) -> int:
    """Number of KV blocks: explicit count, else an explicit byte budget, else a share of the
    device's free memory (capped at `useful_blocks`, beyond which blocks could never be used)."""
    if num_gpu_blocks is not None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        return num_gpu_blocks
    if kv_cache_memory is not None:
        if kv_cache_memory < block_bytes:
            raise ValueError(
                f"kv_cache_memory must hold at least one block ({block_bytes} bytes), got {kv_cache_memory}"
            )
        return kv_cache_memory // block_bytes
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_utilization)
    else:
        budget = min(int(_available_host_memory() * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)
    n = budget // block_bytes
    if useful_blocks is not None:
        n = min(n, useful_blocks)
    if n < 1:
        raise ValueError(f"not enough memory for one KV block ({block_bytes} bytes); set num_gpu_blocks")
    return n


class ModelRunner:
    def __init__(
        self,
        model,
        block_size: int,
        num_blocks: int,
        *,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        cuda_graphs: bool | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(model.device)
        if self.device.type == "cpu":
            keep_freed_cpu_memory()
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        self.sampler = Sampler()
        self.graphs = None
        if self.device.type == "cuda" and cuda_graphs is not False:
            from disagg.worker.cuda_graphs import CudaGraphRunner

            max_len = max_model_len or model.max_model_len
            self.graphs = CudaGraphRunner(
                lambda batch, kv: model.forward(batch, kv),
                self.kv_cache,
                max_batch=max_num_seqs,
                max_blocks_per_seq=-(-max_len // block_size),
                device=self.device,
                enabled=cuda_graphs,
            )
            self.graphs.capture()
        log.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB",
            num_blocks,
            block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
        )

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        one_each = not out.is_prefill and all(c.num_tokens == 1 for c in out.chunks)
        batch = self._build_decode(out) if one_each else self._build_packed(out)
        return batch if self.device.type == "cpu" else batch.to(self.device)

    def _build_decode(self, out: SchedulerOutput) -> ForwardBatch:
        """One token per sequence: positions, slots and lengths come straight from the chunk
        starts in Python, each tensor made by one call (a decode step is latency-bound)."""
        bs = self.block_size
        chunks = out.chunks
        starts = [c.start for c in chunks]
        tables = [c.request.block_ids for c in chunks]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) if len(t) < width else t for t in tables]
        return ForwardBatch(
            input_ids=torch.tensor([c.request.token_at(c.start) for c in chunks], dtype=torch.int64),
            positions=torch.tensor(starts, dtype=torch.int64),
            slot_mapping=torch.tensor(
                [t[s // bs] * bs + s % bs for t, s in zip(tables, starts, strict=True)], dtype=torch.int64
            ),
            seq_lens=torch.tensor([s + 1 for s in starts], dtype=torch.int32),
            block_tables=torch.tensor(padded, dtype=torch.int32),
            logits_indices=torch.tensor([b for b, c in enumerate(chunks) if c.samples], dtype=torch.int64),
            is_prefill=False,
        )

    def _build_packed(self, out: SchedulerOutput) -> ForwardBatch:
        bs = self.block_size
        chunks = out.chunks
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        cu = [0]
        logits_rows: list[int] = []
        for c in chunks:
            req = c.request
            if out.is_prefill:
                prompt_len = req.num_prompt_tokens
                if c.end <= prompt_len:
                    ids.extend(req.prompt_token_ids[c.start : c.end])
                else:
                    ids.extend(req.all_token_ids[c.start : c.end])
            else:
                ids.append(req.token_at(c.start))
            starts.append(c.start)
            lens.append(c.num_tokens)
            cu.append(cu[-1] + c.num_tokens)
            if c.samples:
                logits_rows.append(cu[-1] - 1)
        width = max(len(c.request.block_ids) for c in chunks)
        table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for b, c in enumerate(chunks):
            table[b, : len(c.request.block_ids)] = torch.tensor(c.request.block_ids, dtype=torch.int32)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        seq_index = torch.repeat_interleave(torch.arange(len(chunks)), lens_t)
        cu_t = torch.tensor(cu, dtype=torch.int64)
        positions = torch.arange(cu[-1], dtype=torch.int64) - cu_t[:-1][seq_index] + starts_t[seq_index]
        blocks = table[seq_index, positions // bs].to(torch.int64)
        slots = blocks * bs + positions % bs
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=positions,
            slot_mapping=slots,
            seq_lens=(starts_t + lens_t).to(torch.int32),
            block_tables=table,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            is_prefill=out.is_prefill,
            cu_seqlens_q=cu_t.to(torch.int32) if out.is_prefill else None,
        )

    def execute(
        self, out: SchedulerOutput, layer_hook: Callable[[int], None] | None = None
    ) -> tuple[list[Request], SamplerOutput | None]:
        """Run the step; returns the requests that sampled a token and what they sampled."""
        batch = self.build_batch(out)
        if self.graphs is not None and not out.is_prefill and self.graphs.can_run(batch):
            logits = self.graphs.run(batch)  # decode steps replay a captured CUDA graph
        else:
            logits = self.model.forward(batch, self.kv_cache, layer_hook=layer_hook)
        sampling = [c.request for c in out.chunks if c.samples]
        if not sampling:
            return [], None
        return sampling, self.sampler(logits, sampling)
