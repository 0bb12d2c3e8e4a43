"""`disagg worker --tensor-parallel-size 2 --tensor-parallel-local-ranks 1` with its rank 1 from
`disagg tp-ranks` (another host's command, here a separate process over loopback): served outputs
equal the single-rank engine's; losing the follower fails the request and the worker exits non-zero,
and the follower exits non-zero when the worker is gone. Prefill and decode workers whose rank 1
is remote move KV rank by rank as when all ranks are local (the remote ranks' NIXL agents on
their own host's interface)."""

from __future__ import annotations

import random
import socket
import sys

import pytest

from disagg.worker.engine.sampling_params import SamplingParams

from ..cluster import Cluster, Proc, complete
from .test_tensor_parallel_pd import THRESHOLD, _serve_and_compare

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the worker's rank control port and rendezvous store)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def _follower(cluster: Cluster, port: int, tmp, name: str = "tp-ranks") -> Proc:
    cmd = [sys.executable, "-m", "disagg.worker.cli", "tp-ranks", "--leader", f"127.0.0.1:{port}",
           "--first-rank", "1", "--count", "1", "--threads", "1", "--host", "127.0.0.1"]  # fmt: skip
    return Proc(name, cmd, tmp / f"{name}.log", "", env=cluster.env)


@pytest.fixture
def remote_tp_cluster(tiny_model, tmp_path):
    port = free_port_pair()
    c = Cluster(
        tiny_model,
        tmp_path,
        redis_url=None,
        prefill=0,
        decode=0,
        both=1,
        worker_args=(
            "--tensor-parallel-size",
            "2",
            "--tensor-parallel-local-ranks",
            "1",
            "--tensor-parallel-port",
            str(port),
        ),  # fmt: skip
        deployment="tp-remote",
    )
    follower = _follower(c, port, tmp_path)
    follower.start()
    try:
        c.start()
        yield c, follower
    finally:
        c.stop()
        follower.kill()


def test_remote_rank_serves_the_single_rank_outputs_then_loses_the_worker(remote_tp_cluster, reference_llm):
    cluster, follower = remote_tp_cluster
    rng = random.Random(0)
    vocab = reference_llm.engine.config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]
    for prompt, want in zip(prompts, expected, strict=True):
        body = {
            "model": cluster.model_name,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = complete(cluster.url, body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    load = cluster.wait_idle()["both-0"]
    assert load.used_blocks == 0 and load.free_blocks == load.total_blocks
    cluster.workers["both-0"].kill()  # rank 0's host is gone: the follower must not linger
    assert follower.popen.wait(60) != 0
    assert "rank 0 closed the connection" in follower.log.read_text()


def test_a_lost_follower_fails_the_request_and_the_worker_exits(remote_tp_cluster):
    cluster, follower = remote_tp_cluster
    worker = cluster.workers["both-0"]
    follower.kill()  # its rank dies with it
    body = {"model": cluster.model_name, "prompt": list(range(10, 30)), "max_tokens": 8, "temperature": 0}
    r = complete(cluster.url, body)
    assert r.status_code >= 500, r.text
    assert worker.popen.wait(60) != 0
    assert "tensor-parallel rank 1 (on 127.0.0.1) exited" in worker.log.read_text()


def _remote_rank_args(port: int) -> tuple[str, ...]:
    return (
        "--tensor-parallel-size",
        "2",
        "--tensor-parallel-local-ranks",
        "1",
        "--tensor-parallel-port",
        str(port),
    )


def test_prefill_and_decode_with_remote_ranks_move_kv_and_serve_the_single_rank_outputs(
    tiny_model, tmp_path, reference_llm, redis_server
):
    ports = {"prefill": free_port_pair(), "decode": free_port_pair()}
    while ports["decode"] in (ports["prefill"], ports["prefill"] + 1, ports["prefill"] - 1):
        ports["decode"] = free_port_pair()
    c = Cluster(
        tiny_model,
        tmp_path,
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=("--prefill-placement", "threshold", "--disagg-threshold", str(THRESHOLD)),
        role_args={role: _remote_rank_args(port) for role, port in ports.items()},
        deployment="tp-remote-pd",
    )
    followers = [_follower(c, port, tmp_path, f"tp-ranks-{role}") for role, port in ports.items()]
    for f in followers:
        f.start()
    try:
        c.start()
        _serve_and_compare(c, reference_llm, redis_server)
    finally:
        c.stop()
        for f in followers:
            f.kill()
