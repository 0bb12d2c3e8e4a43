"""Prefill and decode workers with tensor parallelism: every rank moves its own KV heads to the
ranks of the other worker that own them (real processes, NIXL over CPU, gloo). Outputs equal
the colocated single-rank engine's, every block comes back on both workers, and a rank killed
while a request is in flight fails that request and ends its worker."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.serving.args import ServingArgs

from ..cluster import Cluster, child_pids, complete, greedy_body, threshold_placement

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

THRESHOLD = 8  # prompts of 8+ uncached tokens are prefilled on the prefill worker
LENGTHS = [3, 15, 17, 33, 47]  # local and remote prefills, around block boundaries (block size 16)


@pytest.fixture(scope="module")
def tp_pd(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("tp-pd"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        # a small token budget makes a long prompt's prefill span many steps: a window to kill in
        worker_args=(
            *threshold_placement(THRESHOLD),
            *EngineArgs.cli_args(tensor_parallel_size=2, max_num_batched_tokens=64),
        ),
        deployment="tp-pd",
    )
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(
    scope="module", params=[(2, 1), (1, 2), (4, 1), (2, 4)], ids=lambda p: f"prefill-tp{p[0]}-decode-tp{p[1]}"
)
def mixed_pd(request, tiny_model, tmp_path_factory, redis_server):
    prefill_tp, decode_tp = request.param
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("tp-mixed"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=threshold_placement(THRESHOLD),
        role_args={
            "prefill": EngineArgs.cli_args(tensor_parallel_size=prefill_tp),
            "decode": EngineArgs.cli_args(tensor_parallel_size=decode_tp),
        },
        deployment=f"tp-mixed-{prefill_tp}-{decode_tp}",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def test_outputs_equal_the_colocated_engine_and_blocks_come_back(tp_pd, reference_llm, redis_server):
    _serve_and_compare(tp_pd, reference_llm, redis_server)


def test_kv_moves_between_different_degrees(mixed_pd, reference_llm, redis_server):
    """Fan-in (each prefill rank writes its heads into the one decode rank), fan-out (the
    prefill rank writes each decode rank's heads into it), and the tiny model's 2 KV heads
    replicated over 4 ranks: on the prefill side (one holder of each head sends it, the other
    ranks send nothing) and on the decode side (every rank holding a head gets its copy)."""
    _serve_and_compare(mixed_pd, reference_llm, redis_server)


def _serve_and_compare(tp_pd: Cluster, reference_llm, redis_server) -> None:
    rng = random.Random(0)
    vocab = reference_llm.engine.config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]
    bodies = [
        {"model": tp_pd.model_name, "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:  # concurrently: the workers batch them
        responses = list(pool.map(lambda b: complete(tp_pd.url, b), bodies))
    for n, r, want in zip(LENGTHS, responses, expected, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want, f"prompt of {n} tokens"
        assert ("X-Disagg-Prefill-Worker" in r.headers) == (n >= THRESHOLD), (n, dict(r.headers))
    assert tp_pd.metric("prefill-0", "disagg_kv_transfer_bytes_total") > 0
    # the block manager is shared by the ranks: zero here is zero on every rank
    tp_pd.assert_released(redis_server.url)


def _wait_running(cluster: Cluster, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while cluster.load(name).running < 1:
        assert time.monotonic() < deadline, f"{name} never started the request"
        time.sleep(0.002)


def _exits_naming_rank_1(worker) -> None:
    assert worker.popen.wait(60) != 0
    assert "tensor-parallel rank 1 exited" in worker.log.read_text()


def test_a_prefill_rank_killed_mid_prefill_fails_it_and_the_worker_exits(tp_pd, reference_llm):
    """The decode worker is told the prefill failed, frees its reservation and prefills the
    prompt itself: the client still gets the colocated engine's text."""
    rng = random.Random(3)
    prompt = [rng.randrange(5, 1000) for _ in range(1200)]
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    result: dict = {}
    body = greedy_body(tp_pd.model_name, prompt, 6)
    t = threading.Thread(target=lambda: result.update(r=complete(tp_pd.url, body)))
    t.start()
    _wait_running(tp_pd, "prefill-0")
    worker = tp_pd.workers["prefill-0"]
    (rank1,) = child_pids(worker.popen.pid)
    subprocess.run(["kill", "-9", str(rank1)], check=True)
    t.join(120)
    _exits_naming_rank_1(worker)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
    assert "X-Disagg-Prefill-Worker" not in r.headers
    load = tp_pd.wait_idle()["decode-0"]
    assert load.used_blocks == 0 and load.reserved_blocks == 0 and load.free_blocks == load.total_blocks


def test_a_decode_rank_killed_mid_stream_ends_it_with_an_error_and_the_worker_exits(tp_pd):
    # shorter than the threshold: prefilled on the decode worker (the prefill worker is gone)
    body = {"model": tp_pd.model_name, "prompt": [11, 12, 13], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    worker = tp_pd.workers["decode-0"]
    (rank1,) = child_pids(worker.popen.pid)
    events = []
    with httpx.stream("POST", f"{tp_pd.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    subprocess.run(["kill", "-9", str(rank1)], check=True)
    assert events[-1] != "[DONE]" and "error" in json.loads(events[-1]), events[-1]
    assert len(events) < 400
    _exits_naming_rank_1(worker)


@pytest.fixture(scope="module")
def fan_in(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("tp-fan-in"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=(
            *threshold_placement(THRESHOLD),
            *ServingArgs.cli_args(lease_seconds=3.0),
            *EngineArgs.cli_args(max_num_batched_tokens=64),
        ),
        role_args={"prefill": EngineArgs.cli_args(tensor_parallel_size=2)},
        deployment="tp-fan-in",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def test_decode_worker_killed_mid_transfer_every_prefill_rank_lets_go(fan_in, redis_server):
    """Both prefill ranks were to write into the dead worker: the prefill is given up (its
    transfer's lease expires, or a send fails), its blocks are freed once, its Redis record is
    reaped, and the prefill worker and its second rank keep running."""
    rng = random.Random(5)
    body = {"model": fan_in.model_name, "prompt": [rng.randrange(5, 1000) for _ in range(1200)],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    t = threading.Thread(target=lambda: complete(fan_in.url, body))
    t.start()
    _wait_running(fan_in, "prefill-0")
    fan_in.workers["decode-0"].kill()
    t.join(120)
    fan_in.assert_released(redis_server.url, idle_timeout=12, records_timeout=12)
    assert fan_in.workers["prefill-0"].alive()
    assert len(child_pids(fan_in.workers["prefill-0"].popen.pid)) == 1  # its rank lives on
