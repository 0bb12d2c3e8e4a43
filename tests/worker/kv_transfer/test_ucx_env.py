"""A transport UCX_TLS asks for that this machine cannot open stops the worker, by name."""

from __future__ import annotations

import pytest

from disagg.worker.kv_transfer.ucx_env import Machine, check_ucx_env, problems, requested, this_machine

CPU_NODE = Machine(rdma_devices=(), cuda=False, gdrcopy=False)
GPU_RDMA_NODE = Machine(rdma_devices=("mlx5_0",), cuda=True, gdrcopy=True)


def test_listed_transports():
    assert requested(None) == requested("") == requested("^cma") == []
    assert requested("rc, cuda_copy,tcp") == ["rc", "cuda_copy", "tcp"]


def test_a_cpu_node_refuses_rdma_and_cuda_transports_by_name():
    found = problems("rc,cuda_ipc,gdr_copy,tcp", CPU_NODE)
    assert len(found) == 3
    assert "rc" in found[0] and "no RDMA device" in found[0]
    assert "cuda_ipc" in found[1] and "gdr_copy" in found[2]
    assert problems("rc,cuda_copy,cuda_ipc,gdr_copy,tcp", GPU_RDMA_NODE) == []


def test_tcp_alone_aliases_and_exclusions_pass():
    for tls in (None, "", "tcp", "^rc", "ib,tcp", "cma,tcp"):
        assert problems(tls, CPU_NODE) == [], tls


def test_nixl_needs_tcp():
    assert "lacks tcp" in problems("rc", GPU_RDMA_NODE)[0]


def test_the_check_reads_this_machine(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    check_ucx_env(cuda=False)
    machine = this_machine(cuda=False)
    if not machine.rdma_devices:
        monkeypatch.setenv("UCX_TLS", "rc,tcp")
        with pytest.raises(RuntimeError, match="UCX_TLS lists rc"):
            check_ucx_env(cuda=False)
