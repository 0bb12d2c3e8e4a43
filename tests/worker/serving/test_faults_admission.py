"""Faults found in review, with real processes: every request gets an answer (a frozen decode
worker, a draining one, the lone prefill worker killed), admission holds under a burst, and a huge
prompt neither stalls the router nor reaches the tokenizer. Accounting goes back to zero after each."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from disagg.worker.router.args import RouterArgs
from disagg.worker.serving.args import ServingArgs

from ..cluster import Cluster

pytestmark = pytest.mark.timeout(300)

LEASE = 3.0
MAX_QUEUE = 32


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("faults-admission"),
        redis_url=redis_server.url,
        prefill=1,
        decode=2,
        worker_args=ServingArgs.cli_args(
            prefill_placement="threshold", disagg_threshold=8, lease_seconds=LEASE
        ),
        router_args=RouterArgs.cli_args(max_queue=MAX_QUEUE),
        deployment="faults-admission",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def _released(cluster: Cluster, redis_url: str) -> None:
    cluster.assert_released(redis_url, idle_timeout=LEASE * 4, records_timeout=LEASE * 4)


def _body(cluster: Cluster, prompt, max_tokens: int, **extra) -> dict:
    return {"model": cluster.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip


def test_burst_beyond_max_queue_is_answered_429(cluster, redis_server):
    """Many requests arriving at once: the router admits at most --max-queue of them."""

    async def burst(n: int) -> list[int]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            bodies = [_body(cluster, f"burst {i} " * 6, 24) for i in range(n)]
            rs = await asyncio.gather(*(client.post(f"{cluster.url}/v1/completions", json=b) for b in bodies))
        return [r.status_code for r in rs]

    statuses = asyncio.run(burst(10 * MAX_QUEUE))
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= MAX_QUEUE // 2, statuses
    _released(cluster, redis_server.url)


def test_huge_prompts_are_refused_without_stalling_health_or_small_requests(cluster, redis_server):
    big = {"model": cluster.model_name, "prompt": "lorem ipsum " * 900_000, "max_tokens": 2}  # ~10 MB
    results: list[httpx.Response] = []

    def send_big():
        results.append(httpx.post(f"{cluster.url}/v1/completions", json=big, timeout=120))

    threads = [threading.Thread(target=send_big) for _ in range(4)]
    for t in threads:
        t.start()
    health_times, small = [], []
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(f"{cluster.url}/health", timeout=30).status_code == 200
        health_times.append(time.monotonic() - t0)
        t0 = time.monotonic()
        r = httpx.post(f"{cluster.url}/v1/completions", json=_body(cluster, "hi there", 2), timeout=60)
        small.append((r.status_code, time.monotonic() - t0))
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [400] * 4
    assert all(r.json()["error"]["code"] == "prompt_too_large" for r in results)
    # they were refused before any work (test_router_prompt_bound counts the tokenizer calls:
    # none), so health and small requests went on being served meanwhile
    assert health_times and all(status == 200 for status, _took in small), small
    _released(cluster, redis_server.url)


def _stream(cluster: Cluster, prompt, max_tokens: int, out: dict) -> None:
    """One streamed completion; out: status, decode worker, data events, whether it ended."""
    try:
        with httpx.stream("POST", f"{cluster.url}/v1/completions",
                          json=_body(cluster, prompt, max_tokens, stream=True), timeout=120) as r:  # fmt: skip
            out["status"], out["decode"] = r.status_code, r.headers.get("X-Disagg-Decode-Worker")
            out.setdefault("events", [])
            if r.status_code != 200:
                out["body"] = r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
    except httpx.HTTPError as e:
        out["exception"] = repr(e)
    out["ended_at"] = time.monotonic()


def test_frozen_decode_worker_loses_no_request(cluster, redis_server):
    """SIGSTOP a decode worker mid-stream: each of its streams moves to the other decode worker
    once the connection is found dead (seconds, not some far-off timeout) and completes there."""
    outs = [{} for _ in range(6)]
    threads = [threading.Thread(target=_stream, args=(cluster, f"frozen {i} " * 5, 1500, o)) for i, o in enumerate(outs)]  # fmt: skip
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(len(o.get("events", ())) >= 2 for o in outs):
        assert time.monotonic() < deadline, outs
        time.sleep(0.01)
    victim = outs[0]["decode"]
    proc = cluster.workers[victim].popen
    proc.send_signal(signal.SIGSTOP)
    try:
        for t in threads:
            t.join(120)  # the dead connection is found within seconds; the rest is generating
        on_victim = [o for o in outs if o["decode"] == victim]
        assert on_victim and all("ended_at" in o for o in on_victim), on_victim
        for o in on_victim:
            assert o["events"][-1] == "[DONE]", o["events"][-2:]
            tokens = sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in o["events"][:-1])
            assert tokens > 2
    finally:
        proc.send_signal(signal.SIGCONT)
    for t in threads:
        t.join(120)
    others = [o for o in outs if o["decode"] != victim]
    assert all(o["events"][-1] == "[DONE]" for o in others)
    # back from the freeze: it lets go of what it held for the failed requests
    cluster.wait_ready([victim])
    _released(cluster, redis_server.url)


def test_worker_that_starts_draining_is_routed_around(cluster, redis_server):
    """A decode worker draining (preStop) before the router's next poll answers "draining"; the
    router retries the request on another decode worker instead of answering 503."""
    hold: dict = {}
    holder = threading.Thread(target=_stream, args=(cluster, "hold the worker " * 3, 400, hold))
    holder.start()
    while len(hold.get("events", ())) < 2:
        assert holder.is_alive(), hold
        time.sleep(0.01)
    drained = hold["decode"]
    url = cluster.workers[drained].health.replace("/health", "/drain")
    drainer = threading.Thread(target=lambda: httpx.get(url, headers=cluster.internal_headers, timeout=120))
    drainer.start()
    while httpx.get(cluster.workers[drained].health, timeout=5).status_code != 503:
        time.sleep(0.005)
    # inside the window before the router polls the worker again
    with httpx.Client(timeout=60) as client:
        rs = [
            client.post(f"{cluster.url}/v1/completions", json=_body(cluster, f"race {i}", 2))
            for i in range(12)
        ]
    assert [r.status_code for r in rs] == [200] * 12, [r.text for r in rs if r.status_code != 200]
    assert {r.headers["X-Disagg-Decode-Worker"] for r in rs} == set(cluster.workers) - {drained, "prefill-0"}
    holder.join(120)
    drainer.join(120)
    assert hold["events"][-1] == "[DONE]"
    _released(cluster, redis_server.url)


def test_lone_prefill_worker_killed_requests_still_succeed(cluster, redis_server):
    """The only prefill worker dies: decode workers prefill locally instead of failing requests."""
    cluster.workers["prefill-0"].kill()
    with httpx.Client(timeout=120) as client:
        rs = [client.post(f"{cluster.url}/v1/completions", json=_body(cluster, list(range(5, 45 + i)), 4))
              for i in range(8)]  # fmt: skip
    assert [r.status_code for r in rs] == [200] * 8, [r.text for r in rs if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in rs)
    _released(cluster, redis_server.url)
