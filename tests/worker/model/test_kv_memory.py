"""A host KV cache's memory: zeroed like torch.zeros, 2 MiB-aligned and advised for transparent
huge pages (what makes NIXL's CPU transfers faster: bench/kv_transfer.py --pages), for the
model's caches of every KV dtype."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from disagg.worker.model import kv_memory
from disagg.worker.model.loader import load_model
from disagg.worker.tools.make_model import make_model

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address `ptr`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            if inside:
                break
            inside = int(m[1], 16) <= ptr < int(m[2], 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def _thp_offered() -> bool:
    return THP_MODE.exists() and "[never]" not in THP_MODE.read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_zeros_is_torch_zeros_on_an_aligned_huge_page_mapping(dtype):
    shape = (3, 700, 2, 16, 4, 64)  # 3-11 MiB: several huge pages, not a multiple of one
    cache = kv_memory.zeros(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert torch.equal(cache, torch.zeros(shape, dtype=dtype))
    assert cache.data_ptr() % kv_memory.HUGE_PAGE == 0
    cache.view(torch.uint8).fill_(0xAB)  # writable to its last byte
    assert int(cache.view(torch.uint8)[-1, -1, -1, -1, -1, -1]) == 0xAB
    if not Path("/proc/self/smaps").exists() or not _thp_offered():
        pytest.skip("no transparent huge pages on this kernel: the advice is a no-op")
    assert _mapping_of(cache.data_ptr()).get("THPeligible") == "1"


@pytest.mark.parametrize("kernel", ["populate", "older"])
def test_the_pages_are_resident_before_the_first_write(kernel, monkeypatch):
    """No page of a new cache is left to fault in inside a step: its mapping's resident size is
    the whole cache before anything is written to it, also where the kernel refuses the advice."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps")
    if kernel == "older":
        monkeypatch.setattr(kv_memory, "MADV_POPULATE_WRITE", 4242)  # EINVAL, as before Linux 5.14
    cache = kv_memory.zeros((40 << 20,), torch.uint8)  # 40 MiB, never written here
    rss_kib = int(_mapping_of(cache.data_ptr())["Rss"].split()[0])
    assert rss_kib * 1024 >= cache.numel(), rss_kib


def test_small_caches_and_views_keep_their_memory_alive():
    small = kv_memory.zeros((4, 5), torch.float32)  # under a huge page: torch's own allocation
    assert torch.equal(small, torch.zeros(4, 5))
    layer = kv_memory.zeros((2, 1 << 20), torch.float32)[1]  # the whole cache goes out of scope
    layer.fill_(2.0)
    assert float(layer.sum()) == 2.0 * (1 << 20)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "m", preset="tiny", seed=0)


def test_the_models_cpu_cache_is_on_huge_pages_for_every_kv_dtype(tiny_dir):
    model, _ = load_model(tiny_dir)
    for kv_dtype in ("auto", "int8"):
        model.use_kv_cache_dtype(kv_dtype)
        cache = model.allocate_kv_cache(num_blocks=1024, block_size=16)
        assert cache.shape == model.kv_cache_shape(1024, 16) and not cache.any()
        assert cache.data_ptr() % kv_memory.HUGE_PAGE == 0, kv_dtype
