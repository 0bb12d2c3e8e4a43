"""`disagg worker --tensor-parallel-size 2`: the worker starts its second rank, serves what the
single-rank engine serves, frees every block, and exits non-zero (for its pod to restart) when the
rank dies; prefill and decode roles refuse TP over the gRPC KV transport (NIXL only)."""

from __future__ import annotations

import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.worker.engine.sampling_params import SamplingParams

from ..cluster import Cluster, child_pids, complete

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def tp_cluster(tiny_model, tmp_path_factory):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("tp"),
        redis_url=None,
        prefill=0,
        decode=0,
        both=1,
        worker_args=("--tensor-parallel-size", "2"),
        deployment="tp",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def test_two_rank_worker_serves_the_single_rank_outputs(tp_cluster, reference_llm):
    rng = random.Random(0)
    vocab = reference_llm.engine.config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]
    bodies = [
        {"model": tp_cluster.model_name, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: complete(tp_cluster.url, b), bodies))
    for r, want in zip(responses, expected, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    load = tp_cluster.wait_idle()["both-0"]
    assert load.used_blocks == 0 and load.free_blocks == load.total_blocks


def test_a_killed_rank_fails_the_request_and_the_worker_exits(tp_cluster):
    worker = tp_cluster.workers["both-0"]
    (rank1,) = child_pids(worker.popen.pid)
    subprocess.run(["kill", "-9", str(rank1)], check=True)
    body = {"model": tp_cluster.model_name, "prompt": list(range(10, 30)), "max_tokens": 8, "temperature": 0}
    r = complete(tp_cluster.url, body)
    assert r.status_code >= 500, r.text
    assert worker.popen.wait(60) != 0
    assert "tensor-parallel rank 1 exited" in worker.log.read_text()


def test_prefill_role_refuses_tensor_parallelism_over_the_grpc_transport(tiny_model):
    cmd = [sys.executable, "-P", "-m", "disagg.worker.cli", "worker", "--role", "prefill", "--model",
           str(tiny_model), "--tensor-parallel-size", "2", "--kv-transfer", "grpc"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--tensor-parallel-size 2 with --role prefill needs --kv-transfer nixl" in out.stderr
    assert "rank" not in out.stderr.split("needs --kv-transfer nixl", 1)[1]  # refused before any rank started
