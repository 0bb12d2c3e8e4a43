"""Faults with real processes: a prefill worker killed mid-transfer, a decode worker killed
mid-stream, Redis restarted under load. Nothing may leak on the survivors or in Redis."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.serving.args import ServingArgs

from ..cluster import Cluster, greedy_body

pytestmark = pytest.mark.timeout(300)

LEASE = 3.0


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    # a small token budget makes a long prompt's prefill span many steps: a window to kill in
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("faults"),
        redis_url=redis_server.url,
        prefill=2,
        decode=3,
        worker_args=(
            *ServingArgs.cli_args(prefill_placement="threshold", disagg_threshold=8, lease_seconds=LEASE),
            *EngineArgs.cli_args(max_num_batched_tokens=64),
        ),
        deployment="faults",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def _idle_everywhere(cluster: Cluster, redis_url: str) -> None:
    cluster.assert_released(redis_url, idle_timeout=LEASE * 4, records_timeout=LEASE * 4)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


def _wait_running(cluster: Cluster, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while cluster.load(name).running < 1:
        assert time.monotonic() < deadline, f"{name} never started the request"
        time.sleep(0.002)


def _complete_in_background(cluster, prompt: str) -> tuple[threading.Thread, dict]:
    """Start a greedy 8-token completion on a thread; its response lands in result["r"]."""
    result: dict = {}
    body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip

    def request():
        result["r"] = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)

    t = threading.Thread(target=request)
    t.start()
    return t, result


def test_prefill_killed_mid_transfer_is_retried_on_another(cluster, reference_llm, redis_server):
    prompt = _prompt(1200, seed=3)
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    retries_before = cluster.metric("decode-0", "disagg_prefill_retries_total")
    t, result = _complete_in_background(cluster, prompt)
    _wait_running(cluster, "prefill-0")  # both prefill workers idle: the router ranks prefill-0 first
    cluster.workers["prefill-0"].kill()
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    cluster.assert_prefilled_on(r, "prefill-1")
    assert cluster.metric("decode-0", "disagg_prefill_retries_total") == retries_before + 1
    _idle_everywhere(cluster, redis_server.url)


def test_decode_killed_mid_transfer_prefill_blocks_come_back_within_the_lease(
    cluster, reference_llm, redis_server
):
    prompt = _prompt(1200, seed=7)
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    t, result = _complete_in_background(cluster, prompt)
    _wait_running(cluster, "prefill-1")
    victim = next(
        n for n in cluster.live_workers() if n.startswith("decode") and cluster.load(n).reserved_blocks
    )
    cluster.workers[victim].kill()
    t.join(120)
    # nothing had reached the client yet: the router replays the request on another decode worker
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.headers["X-Disagg-Decode-Worker"] != victim
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    # P gave the dead worker's prefill blocks back; its transfer record expired and was reaped
    _idle_everywhere(cluster, redis_server.url)


def test_decode_killed_mid_stream_resumes_on_the_other_decode_worker(cluster, redis_server, reference_llm):
    prompt = _prompt(40, seed=4)
    body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        victim = r.headers["X-Disagg-Decode-Worker"]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                cluster.workers[victim].kill()
    assert events[-1] == "[DONE]", events[-2:]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    assert text == reference_llm.generate([prompt], params)[0].outputs[0].text  # nothing lost or repeated
    # the survivors hold nothing: the prefill worker's blocks came back, records are gone
    _idle_everywhere(cluster, redis_server.url)


def test_redis_restart_under_load(cluster, redis_server, reference_llm):
    from disagg.worker.kv_state import KVState

    prompt = _prompt(48, seed=6)
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    body = greedy_body(cluster.model_name, prompt, 6)
    statuses: list[int] = []
    texts: list[str] = []
    stop = threading.Event()

    def load():
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                r = client.post(f"{cluster.url}/v1/completions", json=body)
                statuses.append(r.status_code)
                if r.status_code == 200:
                    texts.append(r.json()["choices"][0]["text"])

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    redis_server.restart()  # every key is gone: registry, records, prefix index
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(60)
    assert statuses and all(s == 200 for s in statuses), statuses
    assert set(texts) == {want.outputs[0].text}
    # the workers re-register and republish: the prompt's blocks are found again
    from disagg.worker.engine.block_hash import block_hashes

    state = KVState(redis_server.url, cluster.deployment, "test-observer")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        live = {w.id for w in state.workers()}
        match = state.match_prefix(block_hashes(prompt, 16))
        if {n for n in cluster.live_workers()} <= live and max(match.values(), default=0) == len(
            prompt
        ) // 16:
            break
        time.sleep(0.2)
    assert set(cluster.live_workers()) <= live
    assert max(match.values(), default=0) == len(prompt) // 16, match
    _idle_everywhere(cluster, redis_server.url)


def test_prestop_drain_then_sigterm_finishes_in_flight_and_deregisters(cluster, redis_server):
    """The pod's preStop hook (GET /drain) stops admission and answers only once the in-flight
    stream has ended; the SIGTERM that follows exits cleanly and leaves the registry."""
    import threading

    from disagg.worker.kv_state import KVState

    body = {"model": cluster.model_name, "prompt": _prompt(20, seed=8), "max_tokens": 150, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    events: list[str] = []
    answer: dict = {}
    worker = None

    def pre_stop():
        answer["body"] = httpx.get(
            worker.health.replace("/health", "/drain"), headers=cluster.internal_headers, timeout=60
        ).json()
        answer["events_seen"] = len(events)

    drainer = threading.Thread(target=pre_stop)
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        last = r.headers["X-Disagg-Decode-Worker"]
        worker = cluster.workers[last]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    drainer.start()
    drainer.join(60)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert answer["body"] == {"drained": True, "streams": 0}
    assert answer["events_seen"] == len(events)  # answered after the stream finished, not before
    health = httpx.get(worker.health, timeout=5)
    assert health.status_code == 503 and health.json()["draining"] is True
    worker.popen.terminate()  # SIGTERM after preStop
    assert worker.popen.wait(30) == 0
    state = KVState(redis_server.url, cluster.deployment, "test-observer")
    assert last not in {w.id for w in state.workers()}
