"""Prefill overflow with real processes: once the decode worker is busier than the prefill worker
by more than the router's margin, the prefill worker serves whole requests (prefilling them
itself) while it keeps prefilling for the decode worker; every output equals the colocated
engine's, and the blocks all come back."""

from __future__ import annotations

import json
import random
import threading
import urllib.request

import httpx
import pytest

from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.router.args import RouterArgs

from ..cluster import Cluster, threshold_placement

pytestmark = pytest.mark.timeout(240)

STREAMS = 5
OUTPUT_TOKENS = 1500  # long enough that every stream overlaps the first


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("overflow"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        # every prompt of 4+ tokens that the decode worker serves is prefilled on the prefill worker
        worker_args=threshold_placement(4),
        router_args=RouterArgs.cli_args(prefill_overflow=1.5),
        deployment="overflow",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def routed(cluster: Cluster) -> dict[str, float]:
    """The router's generations by the serving worker's role."""
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        line.split('worker_role="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("disagg_router_routed_generations_total{")
    }


def test_a_busy_decode_worker_lends_requests_to_the_prefill_worker(cluster, reference_llm):
    rng = random.Random(11)
    vocab = reference_llm.engine.config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(24)] for _ in range(STREAMS)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]

    served: list[tuple[str, str | None]] = [("", None)] * STREAMS
    texts = [""] * STREAMS
    started = [threading.Event() for _ in range(STREAMS)]
    finished = [threading.Event() for _ in range(STREAMS)]

    def stream(i: int) -> None:
        body = {"model": cluster.model_name, "prompt": prompts[i], "max_tokens": OUTPUT_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                served[i] = (r.headers["X-Disagg-Decode-Worker"], r.headers.get("X-Disagg-Prefill-Worker"))
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        texts[i] += json.loads(line[6:])["choices"][0]["text"]
                        started[i].set()
        finally:
            started[i].set()
            finished[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for i, t in enumerate(threads):  # each one joins while the earlier ones stream
        t.start()
        assert started[i].wait(60)
    assert not finished[0].is_set(), "the first stream ended before the last began: the test proves nothing"
    for t in threads:
        t.join(120)

    assert texts == expected
    lent = [i for i, (decode, _p) in enumerate(served) if decode == "prefill-0"]
    kept = [i for i, (decode, _p) in enumerate(served) if decode == "decode-0"]
    assert lent and kept, served
    # a lent request is prefilled where it runs; the decode worker's still go to the prefill worker,
    # including those that arrived while the prefill worker was decoding a lent one
    assert all(served[i][1] is None for i in lent), served
    assert all(served[i][1] == "prefill-0" for i in kept), served
    assert any(i > lent[0] for i in kept), served
    counts = routed(cluster)
    assert counts.get("prefill") == len(lent) and counts.get("decode") == len(kept), counts
    cluster.assert_released(cluster.redis_url)
