"""Ranks that rank 0 did not start: `LLMEngine(..., tensor_parallel_local_ranks=1)` waits for rank 1,
which `disagg tp-ranks` starts as another process (as on another host, here over loopback); the group
generates what one rank does, a lost follower fails the next step, and nothing joins without the key."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from disagg.worker.cli.flags import TpRanks
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.model.tp_executor import RankFailedError, RankProcesses
from disagg.worker.model.tp_join import authkey_from_token

from .test_tensor_parallel import GREEDY, SETTINGS, _assert_same, _prompts, _run

pytestmark = pytest.mark.slow  # each group starts processes (torch import, model load)

TOKEN = "tp-remote-test-credential"


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the control port and the rendezvous store)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def start_follower(port: int, *extra: str, token: str = TOKEN, first_rank: int = 1, count: int = 1):
    env = {**os.environ, "DISAGG_INTERNAL_TOKEN": token}
    cmd = [sys.executable, "-m", "disagg.worker.cli", "tp-ranks", TpRanks.LEADER, f"127.0.0.1:{port}",
           TpRanks.FIRST_RANK, str(first_rank), TpRanks.COUNT, str(count), TpRanks.THREADS, "1",
           TpRanks.CONNECT_TIMEOUT, "60", *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)


def remote_engine(model_dir, port: int, **extra) -> LLMEngine:
    return LLMEngine(model_dir, load_tokenizer=False, tensor_parallel_size=2, tensor_parallel_local_ranks=1,
                     tensor_parallel_port=port, tensor_parallel_join_timeout=60,
                     rank_authkey=authkey_from_token(TOKEN), **SETTINGS, **extra)  # fmt: skip


def test_a_rank_from_another_process_generates_what_one_rank_does(tiny_llama_dir, one_torch_thread):
    prompts = _prompts()
    want = _run(LLMEngine(tiny_llama_dir, load_tokenizer=False, **SETTINGS), prompts)
    port = free_port_pair()
    follower = start_follower(port)
    try:
        engine = remote_engine(tiny_llama_dir, port)
        try:
            assert engine.ranks.procs == []  # rank 0 started no child
            assert engine.ranks.host_of(1) == "127.0.0.1"
            _assert_same(_run(engine, prompts), want)
        finally:
            engine.close()
        assert follower.wait(20) == 0  # rank 0 stopped it: a clean exit
    finally:
        follower.kill()


def test_a_lost_follower_fails_the_next_step(tiny_llama_dir, one_torch_thread):
    port = free_port_pair()
    follower = start_follower(port)
    try:
        engine = remote_engine(tiny_llama_dir, port)
        try:
            engine.add_request("a", _prompts((20,))[0], GREEDY)
            engine.step()
            follower.send_signal(signal.SIGKILL)  # its rank dies with it (parent-death signal)
            follower.wait(10)
            with pytest.raises(RankFailedError, match="rank 1 \\(on 127.0.0.1\\)") as failed:
                while engine.has_unfinished():
                    engine.step()
            assert "within" not in str(failed.value)  # its connection closed: no timeout waited for
        finally:
            engine.close()
    finally:
        follower.kill()


def test_a_follower_exits_non_zero_when_rank_0_is_gone(tiny_llama_dir, one_torch_thread):
    """Rank 0 closes the connection without stopping the rank (as when its process dies)."""
    port = free_port_pair()
    follower = start_follower(port)
    try:
        engine = remote_engine(tiny_llama_dir, port)
        for conn in engine.ranks.conns:
            conn.close()  # what the kernel does for a killed rank 0
        assert follower.wait(30) != 0
        assert "rank 0 closed the connection" in follower.stderr.read()
        engine.ranks._closed = True  # its connections are gone already
    finally:
        follower.kill()


def test_a_rank_with_the_wrong_credential_is_not_let_in(tiny_llama_dir):
    port = free_port_pair()
    intruder = start_follower(port, TpRanks.CONNECT_TIMEOUT, "5", token="not-the-credential")
    try:
        with pytest.raises(RankFailedError, match=r"ranks \[1\] did not join from other hosts"):
            RankProcesses(tiny_llama_dir, "float32", _cpu(), 2, threads=1, local_ranks=1, port=port,
                          authkey=authkey_from_token(TOKEN), join_timeout=_seconds(8))  # fmt: skip
        assert intruder.wait(30) != 0
    finally:
        intruder.kill()


def test_a_silent_connection_does_not_hold_up_the_ranks(tiny_llama_dir):
    """A peer that connects first and never answers the challenge is dropped after the join's
    per-connection bound; the real rank behind it joins."""
    import threading

    port = free_port_pair()
    made: list = []
    build = threading.Thread(target=lambda: made.append(RankProcesses(
        tiny_llama_dir, "float32", _cpu(), 2, threads=1, local_ranks=1, port=port,
        authkey=authkey_from_token(TOKEN), join_timeout=_seconds(60))))  # fmt: skip
    build.start()
    silent = _connect_when_listening(port)
    follower = start_follower(port)
    try:
        build.join(60)
        (ranks,) = made
        try:
            assert ranks.host_of(1) == "127.0.0.1"
        finally:
            ranks.close()  # before any runner: the rank exits (non-zero, it never ran)
        follower.wait(20)
    finally:
        silent.close()
        follower.kill()


def _connect_when_listening(port: int) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)


def test_ranks_from_other_hosts_need_the_credential(tiny_llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_local_ranks is 1 of 2: .*DISAGG_INTERNAL_TOKEN"):
        LLMEngine(tiny_llama_dir, load_tokenizer=False, tensor_parallel_size=2, tensor_parallel_local_ranks=1,
                  **SETTINGS)  # fmt: skip


def test_local_ranks_may_not_exceed_the_group():
    from disagg.worker.engine.args import EngineArgs

    with pytest.raises(ValueError, match="tensor_parallel_local_ranks must be <= tensor_parallel_size"):
        EngineArgs(model="m", tensor_parallel_size=2, tensor_parallel_local_ranks=3)


def _cpu():
    import torch

    return torch.device("cpu")


def _seconds(n: float):
    from datetime import timedelta

    return timedelta(seconds=n)
