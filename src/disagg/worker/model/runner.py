"""Owns the model and its KV cache (and CUDA graphs): one `ForwardBatch` in, logits out."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable

import torch

from disagg.worker.model.forward_batch import ForwardBatch

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


CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_available(root: str) -> int | None:
    """Memory this process's cgroup (v2, or v1) may still use: its limit minus its usage; None
    without a limit. In a pod the limit is the container's, usually far below the node's memory."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            with open(os.path.join(root, limit_file)) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        limit = int(raw)
        try:
            with open(os.path.join(root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            usage = 0
        return max(limit - usage, 0)
    return None


def _available_host_memory(cgroup_root: str | None = None) -> int:
    node = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    node = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if node is None:
        node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    cgroup = _cgroup_available(cgroup_root or CGROUP_ROOT)
    return node if cgroup is None else min(node, cgroup)


def plan_num_blocks(
    block_bytes: int,
    device: torch.device,
    *,
    num_gpu_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    useful_blocks: int | None = None,
    host_reserved: int = 0,
) -> int:
    """Number of KV blocks: explicit count, else an explicit byte budget, else a share of the
    device's free memory (capped at `useful_blocks`, beyond which blocks could never be used).
    `host_reserved`: host memory promised elsewhere (the KV host tier), not available to a CPU cache."""
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
        budget = min(
            int(max(_available_host_memory() - host_reserved, 0) * CPU_KV_FRACTION), CPU_KV_CAP_BYTES
        )
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
        self.graphs = None
        # a quantized cache's attention finds the step's blocks with a data-dependent size: no graphs
        if self.device.type == "cuda" and cuda_graphs is not False and model.kv_format is None:
            from disagg.worker.model.cuda_graphs import CudaGraphRunner

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

    def forward(self, batch: ForwardBatch, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits for the batch's sampling rows; decode steps replay a captured CUDA graph when
        one fits, and only prefill steps call `layer_hook` (after each layer's KV is written)."""
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        if self.graphs is not None and not batch.is_prefill and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model.forward(batch, self.kv_cache, layer_hook=layer_hook if batch.is_prefill else None)
