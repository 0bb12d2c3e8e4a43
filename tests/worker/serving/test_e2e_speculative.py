"""Disaggregated serving with a speculating decode worker: router -> decode worker -> prefill
worker, KV over real NIXL. The decode worker computes its draft's prompt K/V itself (the prefill
worker sends only the target's); greedy outputs equal the colocated engine's without speculation."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.sampling_params import SamplingParams

from ..cluster import Cluster, threshold_placement

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

THRESHOLD = 8
LENGTHS = [3, 12, 17, 33, 40]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    # the target as its own draft: most proposals are accepted, so long acceptances are exercised
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("e2e-spec"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=threshold_placement(THRESHOLD),
        role_args={
            "decode": EngineArgs.cli_args(
                speculative_method="draft",
                speculative_draft_model=str(tiny_model),
                speculative_adaptive=False,
            )
        },
        deployment="e2e-spec",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def test_pd_with_speculative_decode_matches_colocated(cluster, reference_llm, redis_server):
    rng = random.Random(7)
    vocab = reference_llm.engine.config.vocab_size
    phrase = [rng.randrange(5, vocab) for _ in range(6)]
    prompts = [(phrase * 8)[:n] for n in LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]
    bodies = [
        {"model": cluster.model_name, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(
            pool.map(lambda b: httpx.post(f"{cluster.url}/v1/completions", json=b, timeout=120), bodies)
        )
    for n, r, want in zip(LENGTHS, responses, expected, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want, f"prompt of {n} tokens"
        assert r.json()["usage"]["completion_tokens"] == 24
        assert ("X-Disagg-Prefill-Worker" in r.headers) == (n >= THRESHOLD)
    assert cluster.metric("decode-0", "disagg_spec_decode_accepted_tokens_total") > 0
    assert cluster.metric("decode-0", "disagg_spec_decode_verify_steps_total") > 0
    assert cluster.metric("prefill-0", "disagg_spec_decode_verify_steps_total") == 0
    cluster.assert_released(redis_server.url)
