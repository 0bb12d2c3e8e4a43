"""Memory for a KV cache in host RAM: zeroed, on transparent huge pages where the kernel offers them.

A disaggregated pair moves KV between two processes' caches; on CPU, NIXL's shared-memory path
(UCX CMA: process_vm_writev) pins and walks the pages of both sides for every send. With 4 KiB
pages a 256 MiB send touches 65536 of them; with 2 MiB pages, 128. Measured with
bench/kv_transfer.py (256 MiB, one send, 2 threads): 2.95-3.03 GiB/s on 4 KiB pages, 4.10-4.50
on huge pages (torch's THP_MEM_ALLOC_ENABLE=1, which this does for the cache alone). Decode
attention reads the cache too and gains the same TLB reach.

The cache is an anonymous mapping of its own, 2 MiB-aligned, advised MADV_HUGEPAGE (honoured
when /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`; a no-op under
`never`). Anonymous pages are zero-filled, as torch.zeros would give. Elsewhere (no madvise, or
a GPU cache) torch.zeros.

The pages are made resident at allocation (MADV_POPULATE_WRITE, Linux 5.14; before it, writing
the zeros): left to the first write, each new page's fault lands inside a request's prefill step,
and requests keep reaching blocks never written before until the whole cache has been used once
(the allocator hands out unused blocks before it evicts cached prefixes), costly most of all in
a VM whose memory the host backs lazily.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

HUGE_PAGE = 2 << 20
# Below this a cache gains little and would round up to a whole huge page.
MIN_BYTES = HUGE_PAGE
MADV_POPULATE_WRITE = 23  # <linux/mman.h>: fault every page in, writable, without writing it


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype, device=device)`; on CPU, on huge pages where possible."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # Over-allocate one huge page so that the tensor can start on a 2 MiB boundary.
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(area, dtype=torch.uint8, count=1).data_ptr()
    start = -base % HUGE_PAGE
    # EINVAL where the kernel has no THP: the cache keeps plain pages, still zeroed.
    with contextlib.suppress(OSError):
        area.madvise(mmap.MADV_HUGEPAGE, start, size - start)
    # frombuffer keeps `area` alive for as long as the tensor (or a view of it) lives.
    flat = torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=start)
    try:
        area.madvise(MADV_POPULATE_WRITE, start, size - start)
    except OSError:  # an older kernel: the zeros written fault the pages in
        flat.zero_()
    return flat.view(dtype).view(shape)
