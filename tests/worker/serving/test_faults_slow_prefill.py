"""A prefill worker that is slow, not dead (SIGSTOP mid-prefill, then SIGCONT), with real
processes: the decode worker gives up on it within its prefill timeout and retries on the other
prefill worker into fresh blocks, holding the first attempt's blocks apart until the slow worker's
abort notice says nothing more will land. Outputs equal the colocated engine's; every block comes
back on both sides."""

from __future__ import annotations

import random
import signal
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
PREFILL_TIMEOUT = 5.0
PROMPT_TOKENS = 1200
BLOCK = 16  # the worker's default block size


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    # a small token budget makes a long prompt's prefill span many steps: a window to freeze in
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("slow-prefill"),
        redis_url=redis_server.url,
        prefill=2,
        decode=1,
        worker_args=(
            *ServingArgs.cli_args(
                prefill_placement="threshold",
                disagg_threshold=8,
                lease_seconds=LEASE,
                prefill_timeout=PREFILL_TIMEOUT,
            ),
            *EngineArgs.cli_args(max_num_batched_tokens=64),
        ),  # fmt: skip
        deployment="slow-prefill",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


def _complete(cluster: Cluster, prompt: list[int], result: dict) -> None:
    body = greedy_body(cluster.model_name, prompt, 8)
    result["r"] = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)


def _text(reference_llm, prompt: list[int]) -> str:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return reference_llm.generate([prompt], params)[0].outputs[0].text


def test_frozen_prefill_worker_is_retried_elsewhere_and_its_late_kv_lands_nowhere_in_use(
    cluster, reference_llm, redis_server
):
    prompt, later = _prompt(PROMPT_TOKENS, seed=11), _prompt(PROMPT_TOKENS, seed=12)
    want, want_later = _text(reference_llm, prompt), _text(reference_llm, later)
    quarantined = cluster.metric("decode-0", "disagg_kv_quarantined_transfers_total")
    result: dict = {}
    t = threading.Thread(target=_complete, args=(cluster, prompt, result))
    t.start()
    deadline = time.monotonic() + 30
    while cluster.load("prefill-0").running < 1:  # both idle: the router ranks prefill-0 first
        assert time.monotonic() < deadline, "prefill-0 never started the prompt"
        time.sleep(0.002)
    slow = cluster.workers["prefill-0"].popen
    slow.send_signal(signal.SIGSTOP)
    try:
        t.join(120)
        r = result["r"]
        assert r.status_code == 200, r.text
        cluster.assert_prefilled_on(r, "prefill-1")
        assert r.json()["choices"][0]["text"] == want
        # the frozen worker may still write into the first attempt's blocks: D holds them apart
        # from the request (which has finished) until that worker says it is done
        load = cluster.load("decode-0")
        assert load.reserved_blocks == -(-(PROMPT_TOKENS) // BLOCK), load
        assert cluster.metric("decode-0", "disagg_kv_quarantined_transfers_total") == quarantined + 1
    finally:
        slow.send_signal(signal.SIGCONT)
    # back from the freeze, it drops the prompt D gave up on; its abort notice frees D's blocks
    # before the quarantine's deadline would
    thawed = time.monotonic()
    deadline = thawed + PREFILL_TIMEOUT + LEASE
    while cluster.load("decode-0").reserved_blocks:
        assert time.monotonic() < deadline, cluster.load("decode-0")
        time.sleep(0.05)
    cluster.wait_ready(["prefill-0"])
    result = {}
    _complete(cluster, later, result)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"][0]["text"] == want_later
    cluster.assert_released(redis_server.url, idle_timeout=LEASE * 4, records_timeout=LEASE * 4)
