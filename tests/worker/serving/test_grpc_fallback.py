"""The same disaggregated path with the KV blocks streamed over gRPC instead of NIXL."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from disagg.worker.engine.sampling_params import SamplingParams

from ..cluster import Cluster, threshold_placement

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("grpc_kv"),
        redis_url=redis_server.url,
        kv_transfer="grpc",
        worker_args=threshold_placement(8),
        deployment="grpc-kv",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def test_greedy_matches_colocated_over_grpc_kv_transfer(cluster, reference_llm, redis_server):
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (12, 16, 17, 40, 100)]
    want = reference_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    bodies = [{"model": cluster.model_name, "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
              for p in prompts]  # fmt: skip
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(
            pool.map(lambda b: httpx.post(f"{cluster.url}/v1/completions", json=b, timeout=120), bodies)
        )
    for r, w in zip(responses, want, strict=True):
        assert r.status_code == 200, r.text
        cluster.assert_prefilled_on(r, "prefill-0")
        assert r.json()["choices"][0]["text"] == w.outputs[0].text
    assert cluster.metric("prefill-0", "disagg_kv_transfer_bytes_total") > 0
    cluster.assert_released(redis_server.url)
