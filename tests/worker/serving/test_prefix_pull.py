"""A colocated worker pulls a prefix another worker holds, with real processes: offered a holder of
most of its prompt (as the router offers it from the prefix index), it has the holder compute
only the rest and send the blocks over NIXL, and answers exactly as computing it all itself
would; a holder of only a short prefix is not worth the trip, and the worker computes it."""

from __future__ import annotations

import random

import pytest

from disagg.proto import worker_pb2 as pb
from disagg.worker import SamplingParams

from ..cluster import Cluster

pytestmark = pytest.mark.timeout(240)

HELD = 480  # tokens of the prompt the holder computed before


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(tiny_model, tmp_path_factory.mktemp("prefix-pull"), redis_url=redis_server.url, prefill=0,
                both=2, deployment="prefix-pull")  # fmt: skip
    try:
        yield c.start()
    finally:
        c.stop()


def _tokens(
    cluster: Cluster, worker: str, rid: str, prompt: list[int], holder: str | None = None, held: int = 0
):
    targets = []
    if holder is not None:
        load = cluster.load(holder)
        targets = [pb.PrefillTarget(worker_id=holder, address=cluster.workers[holder].grpc_address,
                                    queued_prefill_tokens=load.queued_prefill_tokens,
                                    prefill_tokens_per_s=load.prefill_tokens_per_s, cached_tokens=held)]  # fmt: skip
    request = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, prefill_targets=targets,
                                 params=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # fmt: skip
    out = list(cluster.stub(worker).Generate(request, timeout=60))
    assert not any(m.error.code for m in out), out
    return [t for m in out for t in m.token_ids], out[0].served_by


def _decisions(cluster: Cluster, worker: str, decision: str) -> float:
    return cluster.metric(worker, "disagg_disaggregation_decisions_total", decision=decision)


def test_a_held_prefix_is_pulled_and_a_short_one_recomputed(cluster, reference_llm, redis_server):
    rng = random.Random(11)
    history = [rng.randrange(5, 500) for _ in range(HELD)]
    _tokens(cluster, "both-0", "turn-1", history + [rng.randrange(5, 500)])  # both-0 now holds it
    # both-1 serves a prompt of its own first: an idle worker trusts only a rate measured by served
    # work (the warm-up's is provisional), and remeasures itself before pricing a trip against it
    _tokens(cluster, "both-1", "own", [rng.randrange(5, 500) for _ in range(HELD)])

    prompt = history + [rng.randrange(5, 500) for _ in range(16)]
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    remote_before = _decisions(cluster, "both-1", "remote")
    got, served = _tokens(cluster, "both-1", "turn-2", prompt, holder="both-0", held=HELD)
    assert got == list(want[0].outputs[0].token_ids)
    assert served.disaggregated and served.prefill_worker == "both-0", served
    assert _decisions(cluster, "both-1", "remote") == remote_before + 1

    # a holder of 32 tokens saves less than the trip costs: both-1 computes the prompt itself
    short = history[:32] + [rng.randrange(5, 500) for _ in range(300)]
    local_before = _decisions(cluster, "both-1", "local")
    got, served = _tokens(cluster, "both-1", "other", short, holder="both-0", held=32)
    want = reference_llm.generate([short], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert got == list(want[0].outputs[0].token_ids)
    assert not served.disaggregated
    assert _decisions(cluster, "both-1", "local") == local_before + 1
    cluster.assert_released(redis_server.url)
