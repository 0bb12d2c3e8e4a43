"""CPU KV cache sizing follows the container's cgroup memory limit, not the node's memory."""

from __future__ import annotations

import torch

from disagg.worker.model import runner


def _cgroup(tmp_path, limit: str, usage: int | None = None):
    (tmp_path / "memory.max").write_text(limit + "\n")
    if usage is not None:
        (tmp_path / "memory.current").write_text(f"{usage}\n")
    return str(tmp_path)


def test_a_cgroup_limit_below_the_node_memory_bounds_the_kv_cache(tmp_path, monkeypatch):
    node = runner._available_host_memory(str(tmp_path / "none"))
    limit = 512 << 20
    assert limit < node  # the machine running this has more than half a GiB available
    monkeypatch.setattr(runner, "CGROUP_ROOT", _cgroup(tmp_path, str(limit), usage=128 << 20))
    assert runner._available_host_memory() == limit - (128 << 20)
    block_bytes = 1 << 20
    n = runner.plan_num_blocks(block_bytes, torch.device("cpu"))
    assert n == int((limit - (128 << 20)) * runner.CPU_KV_FRACTION) // block_bytes


def test_no_cgroup_limit_keeps_the_node_memory(tmp_path, monkeypatch):
    node = runner._available_host_memory(str(tmp_path / "none"))
    monkeypatch.setattr(runner, "CGROUP_ROOT", _cgroup(tmp_path, "max"))
    # MemAvailable moves a little between two reads
    assert abs(runner._available_host_memory() - node) < node * 0.05
