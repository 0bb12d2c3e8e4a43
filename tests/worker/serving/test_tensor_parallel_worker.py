"""`disagg worker --tensor-parallel-size 2`, its rank 1 either started by the worker itself (local)
or by `disagg tp-ranks` (another host's command, here a separate process over loopback: remote).
Either way the worker serves what the single-rank engine serves and frees every block, and losing
rank 1 fails the request and ends the worker non-zero (for its pod to restart). A remote follower
exits non-zero when its worker is gone; prefill and decode workers whose rank 1 is remote move KV
rank by rank as when all ranks are local; prefill and decode roles refuse TP over the gRPC KV
transport (NIXL only)."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from disagg.worker.cli.flags import TpRanks
from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.process_args import WorkerProcessArgs

from ..cluster import Cluster, Proc, child_pids, complete, threshold_placement
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


def _remote_rank_args(port: int) -> list[str]:
    return EngineArgs.cli_args(
        tensor_parallel_size=2, tensor_parallel_local_ranks=1, tensor_parallel_port=port
    )


def _follower(cluster: Cluster, port: int, tmp, name: str = "tp-ranks") -> Proc:
    cmd = [sys.executable, "-m", "disagg.worker.cli", "tp-ranks", TpRanks.LEADER, f"127.0.0.1:{port}",
           TpRanks.FIRST_RANK, "1", TpRanks.COUNT, "1", TpRanks.THREADS, "1", TpRanks.HOST, "127.0.0.1"]  # fmt: skip
    return Proc(name, cmd, tmp / f"{name}.log", "", env=cluster.env)


@dataclass
class TPWorker:
    cluster: Cluster
    follower: Proc | None  # rank 1's process when remote; None: the worker's own child
    lost_rank_message: str  # what the worker logs when rank 1 is gone

    def kill_rank1(self) -> None:
        if self.follower is not None:
            self.follower.kill()  # its rank dies with it
        else:
            (rank1,) = child_pids(self.cluster.workers["both-0"].popen.pid)
            subprocess.run(["kill", "-9", str(rank1)], check=True)


def _start(tiny_model, tmp, ranks: str) -> TPWorker:
    port = free_port_pair()
    args = EngineArgs.cli_args(tensor_parallel_size=2) if ranks == "local" else _remote_rank_args(port)
    c = Cluster(
        tiny_model,
        tmp,
        redis_url=None,
        prefill=0,
        decode=0,
        both=1,
        worker_args=args,
        deployment=f"tp-{ranks}",
    )
    follower = _follower(c, port, tmp) if ranks == "remote" else None
    message = (
        "tensor-parallel rank 1 exited"
        if follower is None
        else "tensor-parallel rank 1 (on 127.0.0.1) exited"
    )
    if follower is not None:
        follower.start()
    try:
        c.start()
    except BaseException:
        _stop(TPWorker(c, follower, message))
        raise
    return TPWorker(c, follower, message)


def _stop(w: TPWorker) -> None:
    w.cluster.stop()
    if w.follower is not None:
        w.follower.kill()


@pytest.fixture(scope="module", params=["local", "remote"], ids=lambda r: f"rank1-{r}")
def tp_worker(request, tiny_model, tmp_path_factory):
    w = _start(tiny_model, tmp_path_factory.mktemp(f"tp-{request.param}"), request.param)
    try:
        yield w
    finally:
        _stop(w)


def test_two_rank_worker_serves_the_single_rank_outputs(tp_worker, reference_llm):
    cluster = tp_worker.cluster
    rng = random.Random(0)
    vocab = reference_llm.engine.config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]
    bodies = [
        {"model": cluster.model_name, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: complete(cluster.url, b), bodies))
    for r, want in zip(responses, expected, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    load = cluster.wait_idle()["both-0"]
    assert load.used_blocks == 0 and load.free_blocks == load.total_blocks


def test_a_lost_rank_fails_the_request_and_the_worker_exits(tp_worker):
    cluster, worker = tp_worker.cluster, tp_worker.cluster.workers["both-0"]
    tp_worker.kill_rank1()
    body = {"model": cluster.model_name, "prompt": list(range(10, 30)), "max_tokens": 8, "temperature": 0}
    r = complete(cluster.url, body)
    assert r.status_code >= 500, r.text
    assert worker.popen.wait(60) != 0
    assert tp_worker.lost_rank_message in worker.log.read_text()


def test_a_remote_follower_exits_when_its_worker_is_gone(tiny_model, tmp_path):
    w = _start(tiny_model, tmp_path, "remote")
    try:
        w.cluster.workers["both-0"].kill()  # rank 0's host is gone: the follower must not linger
        assert w.follower.popen.wait(60) != 0
        assert "rank 0 closed the connection" in w.follower.log.read_text()
    finally:
        _stop(w)


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
        worker_args=threshold_placement(THRESHOLD),
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


def test_prefill_role_refuses_tensor_parallelism_over_the_grpc_transport(tiny_model):
    cmd = [sys.executable, "-m", "disagg.worker.cli", "worker", *WorkerProcessArgs.cli_args(role="prefill"),
           *EngineArgs.cli_args(model=str(tiny_model), tensor_parallel_size=2),
           *ServingArgs.cli_args(kv_transfer="grpc")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--tensor-parallel-size 2 with --role prefill needs --kv-transfer nixl" in out.stderr
    assert "rank" not in out.stderr.split("needs --kv-transfer nixl", 1)[1]  # refused before any rank started
