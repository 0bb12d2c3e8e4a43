"""Live streams survive their decode worker, with real processes: SIGKILL, SIGSTOP and a drain of
a decode worker serving many streams (greedy, seeded sampling, json_schema, a forced tool call,
n=2, logprobs); every stream completes, each one equal to the same request on the undisturbed
deployment, with the same usage; so do whole responses, which reach the router in chunks. With no other decode worker a broken stream ends with a clean
error event. Nothing leaks afterwards."""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import httpx
import pytest

from disagg.worker.serving.args import ServingArgs

from ..cluster import Cluster

pytestmark = pytest.mark.timeout(300)

LEASE = 3.0
STREAMS = 32
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def _requests(model: str) -> list[tuple[str, dict]]:
    """(path, body) of STREAMS streamed requests of every kind, long enough to be cut mid-way."""
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    kinds = [
        lambda i: (
            "/v1/completions",
            {"prompt": _prompt(12 + i, i), "max_tokens": 160, "temperature": 0, "ignore_eos": True},
        ),  # fmt: skip
        lambda i: (
            "/v1/completions",
            {"prompt": _prompt(20, i), "max_tokens": 160, "temperature": 0.9, "seed": i, "ignore_eos": True},
        ),  # fmt: skip
        lambda i: (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": f"json {i}"}],
                "max_tokens": 120,
                "temperature": 1.0,
                "seed": i,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
            },
        ),  # fmt: skip
        lambda i: (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": f"weather {i}"}],
                "max_tokens": 120,
                "temperature": 0.8,
                "seed": i,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
        ),  # fmt: skip
        lambda i: (
            "/v1/completions",
            {
                "prompt": _prompt(16, i),
                "max_tokens": 120,
                "temperature": 0.7,
                "seed": i,
                "n": 2,
                "ignore_eos": True,
            },
        ),  # fmt: skip
        lambda i: (
            "/v1/completions",
            {
                "prompt": _prompt(24, i),
                "max_tokens": 120,
                "temperature": 0,
                "logprobs": 2,
                "ignore_eos": True,
            },
        ),  # fmt: skip
    ]
    out = []
    for i in range(STREAMS):
        path, body = kinds[i % len(kinds)](i)
        out.append((path, {"model": model, **body, **usage}))
    return out


def _collect(events: list[dict]) -> dict:
    """What a client assembles from a stream: per choice its text, tool-call arguments, logprob
    tokens and finish reason; and the usage."""
    choices: dict[int, dict] = {}
    usage = None
    for e in events:
        if e.get("usage"):  # the counts; cached_tokens depend on what each worker had cached
            usage = {k: e["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for ch in e.get("choices", []):
            c = choices.setdefault(ch["index"], {"text": "", "args": "", "tokens": [], "finish": None})
            delta = ch.get("delta")
            if delta is not None:
                c["text"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    c["args"] += (call.get("function") or {}).get("arguments") or ""
            else:
                c["text"] += ch.get("text") or ""
                if ch.get("logprobs"):
                    c["tokens"] += ch["logprobs"]["tokens"]
            c["finish"] = ch.get("finish_reason") or c["finish"]
    return {"choices": choices, "usage": usage}


def _run(url: str, path: str, body: dict, out: dict) -> None:
    out["events"] = []
    try:
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
            out["status"], out["decode"] = r.status_code, r.headers.get("X-Disagg-Decode-Worker")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
    except httpx.HTTPError as e:
        out["exception"] = repr(e)


def _parsed(out: dict) -> list[dict]:
    assert out.get("status") == 200 and "exception" not in out, out
    assert out["events"][-1] == "[DONE]", out["events"][-3:]
    events = [json.loads(e) for e in out["events"][:-1]]
    errors = [e for e in events if "error" in e]
    assert not errors, errors
    return events


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("migration"),
        redis_url=redis_server.url,
        prefill=1,
        decode=3,
        # drain_handoff 0, at once: a window would race the streams' own end on a fast host
        worker_args=ServingArgs.cli_args(
            prefill_placement="threshold", disagg_threshold=8, lease_seconds=LEASE, drain_handoff=0.0
        ),
        deployment="migration",
    )
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def undisturbed(cluster) -> list[dict]:
    """Each request once, alone, with nothing failing: what every disturbed run must equal."""
    results = []
    for path, body in _requests(cluster.model_name):
        out: dict = {}
        _run(cluster.url, path, body, out)
        results.append(_collect(_parsed(out)))
    return results


def _disturbed(cluster: Cluster, fault, requests: list | None = None) -> tuple[list[dict], str]:
    """Every request (default: `_requests`) at once; `fault(victim, outs)` hits the decode worker
    serving the most of them once each stream has sent a few events (or ended). Returns the
    results and the victim."""
    requests = requests or _requests(cluster.model_name)
    outs = [{} for _ in requests]
    threads = [
        threading.Thread(target=_run, args=(cluster.url, p, b, o))
        for (p, b), o in zip(requests, outs, strict=True)
    ]
    for t in threads:
        t.start()
    while not all(
        len(o.get("events", ())) >= 3 or not t.is_alive() for o, t in zip(outs, threads, strict=True)
    ):
        time.sleep(0.005)
    serving = [o["decode"] for o in outs if o.get("decode")]
    victim = max(set(serving), key=serving.count)
    fault(victim, outs)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    return [_collect(_parsed(o)) for o in outs], victim


def _running(outs: list[dict]) -> int:
    """Streams that have not ended yet."""
    return sum(1 for o in outs if not o.get("events") or o["events"][-1] != "[DONE]")


def _moved(cluster: Cluster, reason: str) -> float:
    return cluster.metric("router", "disagg_router_migrations_total", reason=reason, outcome="resumed")


def _resumed(cluster: Cluster, how: str, but: str = "") -> float:
    """Moved streams the decode workers (but `but`) started: `handoff_pull`, their K/V pulled from
    the worker that handed them off; `local`, recomputed there; `remote`, prefilled on a prefill
    worker."""
    labels = {"handoff_pull": ("remote", "handoff_pull"), "local": ("local", "resumed"),
              "remote": ("remote", "resumed")}[how]  # fmt: skip
    return sum(
        cluster.metric(w, "disagg_disaggregation_decisions_total", decision=labels[0], reason=labels[1])
        for w in cluster.workers
        if w.startswith("decode") and w != but
    )


def _kv_sent(cluster: Cluster, worker: str) -> float:
    return cluster.metric(worker, "disagg_kv_transfer_bytes_total", direction="send")


def test_streams_of_a_killed_decode_worker_resume_exactly_elsewhere(cluster, undisturbed, redis_server):
    before = _moved(cluster, "unavailable")
    decode = [w for w in cluster.workers if w.startswith("decode")]
    local = {w: _resumed(cluster, "local", but=w) for w in decode}
    remote = {w: _resumed(cluster, "remote", but=w) for w in decode}
    results, victim = _disturbed(cluster, lambda v, _outs: cluster.workers[v].kill())
    assert results == undisturbed
    moved = _moved(cluster, "unavailable") - before
    assert moved > 0  # streams really moved
    # prompt and outputs prefilled as a new prompt is: on the prefill worker where the placement
    # says so (--disagg-threshold 8 uncached tokens), the moved stream going on from there exactly
    on_prefill = _resumed(cluster, "remote", but=victim) - remote[victim]
    assert on_prefill > 0
    assert _resumed(cluster, "local", but=victim) - local[victim] + on_prefill == moved
    cluster.assert_released(redis_server.url, idle_timeout=LEASE * 4, records_timeout=LEASE * 4)
    cluster.workers[victim].start()
    cluster.wait_ready([victim])


def _whole(body: dict) -> dict:
    """The same request with the whole response in one body."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


def _answer(path: str, body: dict, url: str) -> dict:
    """What a client reads from a whole response: per choice its text (or message and tool-call
    arguments), logprob tokens and finish reason; and the token counts."""
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    choices = {}
    for ch in data["choices"]:
        msg = ch.get("message") or {}
        calls = [c["function"]["arguments"] for c in msg.get("tool_calls") or []]
        tokens = (ch.get("logprobs") or {}).get("tokens", [])
        choices[ch["index"]] = (ch.get("text", msg.get("content")), calls, tokens, ch["finish_reason"])
    usage = {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"choices": choices, "usage": usage}


def test_whole_responses_of_a_killed_decode_worker_resume_exactly_elsewhere(cluster, redis_server):
    """A response that does not stream reaches the router --nonstreaming-interval (16) tokens at a
    time: a killed worker's unsent tokens are generated again where the request resumes (greedy and
    seeded alike), and every whole response equals the same request's on the undisturbed deployment."""
    requests = [(path, _whole(body)) for path, body in _requests(cluster.model_name)]
    alone = [_answer(path, body, cluster.url) for path, body in requests]
    decode = [w for w in cluster.workers if w.startswith("decode")]
    before = _moved(cluster, "unavailable")
    sent = {w: cluster.metric(w, "disagg_generation_tokens_total") for w in decode}
    results: list = [None] * len(requests)

    def run(i: int) -> None:
        results[i] = _answer(*requests[i], cluster.url)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    # a few messages of 16 tokens are out, and most of each response is still to come
    while sum(cluster.metric(w, "disagg_generation_tokens_total") - sent[w] for w in decode) < 4 * 16:
        time.sleep(0.02)
    victim = max(decode, key=lambda w: cluster.metric(w, "disagg_num_requests_running"))
    cluster.workers[victim].kill()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert results == alone
    assert _moved(cluster, "unavailable") - before > 0  # requests really moved
    cluster.assert_released(redis_server.url, idle_timeout=LEASE * 4, records_timeout=LEASE * 4)
    cluster.workers[victim].start()
    cluster.wait_ready([victim])


def test_streams_of_a_frozen_decode_worker_resume_exactly_elsewhere(cluster, undisturbed, redis_server):
    frozen: list[str] = []

    def freeze(victim: str, _outs) -> None:
        cluster.workers[victim].popen.send_signal(signal.SIGSTOP)
        frozen.append(victim)

    try:
        results, victim = _disturbed(cluster, freeze)
    finally:
        for v in frozen:
            cluster.workers[v].popen.send_signal(signal.SIGCONT)
    assert results == undisturbed
    cluster.wait_ready(frozen)
    # back from the freeze: it lets go of what it held for the streams that moved away
    cluster.assert_released(redis_server.url, idle_timeout=LEASE * 4, records_timeout=LEASE * 4)


def test_a_drain_hands_streams_off_instead_of_waiting_for_them(cluster, undisturbed, redis_server):
    took: dict = {}

    def drain(victim: str, outs: list[dict]) -> None:
        def call():
            url = cluster.workers[victim].health.replace("/health", "/drain")
            took["body"] = httpx.get(url, headers=cluster.internal_headers, timeout=60).json()
            took["running"] = _running(outs)  # streams still going when the drain answered

        took["thread"] = threading.Thread(target=call)
        took["thread"].start()

    before = _moved(cluster, "draining")
    pulled, recomputed = _resumed(cluster, "handoff_pull"), _resumed(cluster, "local")
    sent = {w: _kv_sent(cluster, w) for w in cluster.workers if w.startswith("decode")}
    results, victim = _disturbed(cluster, drain)
    took["thread"].join(60)
    assert results == undisturbed
    assert took["body"] == {"drained": True, "streams": 0}
    moved = _moved(cluster, "draining") - before
    assert moved > 0
    # the drained worker's K/V went to the new workers, which recomputed none of the moved streams
    assert _resumed(cluster, "handoff_pull") - pulled == moved
    assert _resumed(cluster, "local") == recomputed
    assert _kv_sent(cluster, victim) > sent[victim]
    # the drain ended once its streams were handed off (--drain-handoff) and their K/V pulled, not
    # when the longest ended
    assert took["running"] > 0, took
    cluster.workers[victim].stop()
    cluster.assert_released(redis_server.url, idle_timeout=LEASE * 4, records_timeout=LEASE * 4)
    cluster.workers[victim].start()
    cluster.wait_ready([victim])


def test_handed_off_streams_whose_kv_cannot_be_pulled_are_recomputed_exactly(
    tiny_model, tmp_path, redis_server
):
    """A draining worker that keeps no K/V for its handed-off streams (--handoff-pull-window 0)
    refuses their pulls: the new worker recomputes each stream and it still continues exactly."""
    c = Cluster(
        tiny_model, tmp_path, redis_url=redis_server.url, prefill=0, decode=2, deployment="migration-replay",
        worker_args=ServingArgs.cli_args(drain_handoff=0.0, handoff_pull_window=0.0),
    )  # fmt: skip
    c.start()
    try:
        # greedy, and long enough to be running still when the drain (at once) hands them off
        requests = [
            (p, {**b, "max_tokens": 400}) for p, b in _requests(c.model_name) if b.get("temperature") == 0
        ][:4]
        alone = []
        for path, body in requests:
            out: dict = {}
            _run(c.url, path, body, out)
            alone.append(_collect(_parsed(out)))
        pulled, recomputed = _resumed(c, "handoff_pull"), _resumed(c, "local")
        drained: dict = {}

        def drain(victim: str, _outs) -> None:
            url = c.workers[victim].health.replace("/health", "/drain")
            drained["body"] = httpx.get(url, headers=c.internal_headers, timeout=60).json()

        results, _victim = _disturbed(c, drain, requests)
        assert results == alone
        assert drained["body"] == {"drained": True, "streams": 0}
        assert _resumed(c, "local") > recomputed
        assert _resumed(c, "handoff_pull") == pulled
    finally:
        c.stop()


def test_with_no_other_decode_worker_a_broken_stream_ends_with_a_clean_error(
    tiny_model, tmp_path, redis_server
):
    c = Cluster(
        tiny_model, tmp_path, redis_url=redis_server.url, prefill=0, decode=1, deployment="migration-alone"
    )
    c.start()
    try:
        body = {"model": c.model_name, "prompt": _prompt(30, 1), "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        events = []
        with httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        c.workers["decode-0"].kill()
        last = json.loads(events[-1])
        assert last["error"]["code"] == "worker_unavailable", last
        assert c.metric("router", "disagg_router_migrations_total", outcome="failed") >= 1
    finally:
        c.stop()
