"""Load-aware prefill placement with real processes: an idle decode worker prefills long prompts
itself; a decoding one sends them to the prefill worker, and the remote prefill reports where its
time went."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request

import httpx
import pytest

from disagg.worker.serving.args import ServingArgs

from ..cluster import Cluster

pytestmark = pytest.mark.timeout(240)

PROMPT_TOKENS = 300  # well above the threshold: only the load decides where it is prefilled


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("placement"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        # the default placement (load); a generous slack, so that rates measured while the machine
        # is busy elsewhere cannot turn "protect the running stream" into "the pool is backlogged"
        worker_args=ServingArgs.cli_args(disagg_threshold=8, disagg_busy_slack=5.0),
        deployment="placement",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def decisions(cluster: Cluster) -> dict[tuple[str, str], float]:
    """(decision, reason) -> count on decode-0."""
    with urllib.request.urlopen(cluster.workers["decode-0"].health.replace("/health", "/metrics")) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("disagg_disaggregation_decisions_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            key = (labels["decision"].strip('"'), labels["reason"].strip('"'))
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


STAGES = ("setup", "queue", "compute", "transfer", "overhead", "commit")


def stage_counts(cluster: Cluster) -> dict[str, float]:
    """Remote prefills timed per stage on decode-0."""
    metric = "disagg_remote_prefill_stage_seconds_count"
    return {stage: cluster.metric("decode-0", metric, stage=stage) for stage in STAGES}


def commits(cluster: Cluster) -> dict[str, float]:
    """Remote prefills committed on decode-0, by what carried the first token."""
    metric = "disagg_remote_prefill_commits_total"
    return {on: cluster.metric("decode-0", metric, on=on) for on in ("landing", "answer")}


def router_view(cluster: Cluster, role: str) -> dict:
    request = urllib.request.Request(f"{cluster.url}/internal/workers", headers=cluster.internal_headers)
    with urllib.request.urlopen(request, timeout=2) as r:
        (worker,) = [w for w in json.load(r)["workers"] if w["role"] == role]
    return worker["load"]


def complete(cluster: Cluster, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_placement_follows_the_load(cluster, reference_llm):
    rng = random.Random(7)
    vocab = reference_llm.engine.config.vocab_size

    def prompt():
        return [rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)]

    # both workers measured their prefill rate while warming up, and the router polled them
    deadline = time.monotonic() + 10
    while router_view(cluster, "prefill")["prefill_tokens_per_s"] <= 0:
        assert time.monotonic() < deadline, "the router never saw the prefill worker's rate"
        time.sleep(0.1)

    # 1. an idle decode worker prefills a long prompt itself: the trip would only add the transfer
    first = complete(cluster, prompt(), 4)
    assert "X-Disagg-Prefill-Worker" not in first.headers
    # (whatever the warm-up measured: an idle D re-measures itself rather than trust that alone)
    assert decisions(cluster) in ({("local", "idle_local_faster"): 1}, {("local", "idle_remeasure"): 1})
    assert set(stage_counts(cluster).values()) == {0.0}

    # 2. while it decodes a long stream, a long prompt goes to the prefill worker instead of
    # stalling that stream's tokens
    streaming = threading.Event()
    done = threading.Event()

    def long_stream():
        body = {"model": cluster.model_name, "prompt": prompt()[:10], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                streaming.set()
        done.set()

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert streaming.wait(30)
        third = complete(cluster, prompt(), 4)
        assert not done.is_set(), "the long stream ended before the probe ran: the test proves nothing"
    finally:
        t.join(120)
    assert "X-Disagg-Prefill-Worker" in third.headers, decisions(cluster)
    assert decisions(cluster)[("remote", "protect_decode")] == 1
    # and the remote prefill said where its time went (from P's answer, which may trail the
    # first token: the decode worker commits as soon as the KV landed)
    want = dict.fromkeys(STAGES, 1)
    deadline = time.monotonic() + 10
    while stage_counts(cluster) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stage_counts(cluster) == want
    # no logprobs asked: the first token came in the transfer's FINAL notice, committed on landing
    assert commits(cluster) == {"landing": 1.0, "answer": 0.0}
    # the router now knows what a decode step of decode-0 costs (it weighs lending with it); the
    # prefill worker, which never decoded, reports none
    deadline = time.monotonic() + 10
    while router_view(cluster, "decode")["decode_step_seconds"] <= 0:
        assert time.monotonic() < deadline, "the router never saw the decode worker's step time"
        time.sleep(0.1)
    assert router_view(cluster, "prefill")["decode_step_seconds"] == 0
    cluster.wait_idle()
