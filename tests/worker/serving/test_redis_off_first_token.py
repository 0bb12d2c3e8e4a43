"""Redis is off the first token's path of a disaggregated request, with real processes and a real
Redis: the decode worker writes the transfer record while the Prefill call is out and finishes it
after the first token, and the prefill worker does not check a first attempt's generation. A Redis
that stalls every write then delays neither the first token nor the output, and the record still
ends once Redis resumes."""

from __future__ import annotations

import random

import pytest
import redis

from disagg.proto import worker_pb2 as pb

from ..cluster import Cluster, threshold_placement

pytestmark = pytest.mark.timeout(180)

# Redis holds every write this long: less than the state link's 2 s call timeout, so the record's
# write and finish complete once it resumes (a timed-out write would leave its record to the lease)
PAUSE_MS = 120_000  # longer than the Generate call's deadline: only an unpause ends it


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("redis-off-path"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=threshold_placement(8),
        deployment="redis-off-path",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def _generate(cluster: Cluster, request_id: str, prompt: list[int]):
    target = pb.PrefillTarget(worker_id="prefill-0", address=cluster.workers["prefill-0"].grpc_address)
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        prefill_targets=[target],
    )
    return cluster.stub("decode-0").Generate(request, timeout=60)


def test_first_token_does_not_wait_for_redis_writes(cluster, redis_server):
    prompt = [random.Random(7).randrange(5, 1000) for _ in range(200)]
    # the same prompt with Redis answering: the reference output, and the KV handshake done
    reference = list(_generate(cluster, "warm", prompt))
    assert reference[0].served_by.disaggregated, reference[0]
    cluster.wait_idle()

    client = redis.Redis.from_url(redis_server.url)
    client.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
    try:
        stream = _generate(cluster, "stalled", prompt)
        first = next(stream)  # while Redis still refuses writes: it comes only if it waits for none
        rest = list(stream)
    finally:
        client.execute_command("CLIENT", "UNPAUSE")

    assert not first.error.code, first.error
    assert first.served_by.disaggregated and first.served_by.prefill_worker == "prefill-0", first
    # A record written before the Prefill call would hold the first token until Redis resumed,
    # after the Generate call's deadline: the stream would have ended with an error instead.
    tokens = [t for m in [first, *rest] for t in m.token_ids]
    assert tokens == [t for m in reference for t in m.token_ids]
    # the record was written and finished once Redis resumed: none is left, nor any block
    cluster.assert_released(redis_server.url)
