"""A remote prefill's per-request record: what it prefills, which target each attempt asks, what a
resumed stream's prefill samples with."""

from __future__ import annotations

import asyncio

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.resume import Resumption
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.serving.attempt import Attempt
from disagg.worker.serving.remote_prefill_request import RESUMED_PREFILL_PARAMS, RemotePrefillRequest, Stage


def _job(resume: Resumption | None = None) -> RemotePrefillRequest:
    targets = [pb.PrefillTarget(worker_id="p0"), pb.PrefillTarget(worker_id="p1")]
    request = pb.GenerateRequest(request_id="r", params=pb.SamplingParams(max_tokens=4, logprobs=1))
    attempt = Attempt.new("r", 0, request.params)
    return RemotePrefillRequest(
        "r", [1, 2, 3], request, SamplingParams(), lambda out: None, resume, targets, attempt
    )


def test_a_retry_asks_the_next_target_under_a_new_transfer_id():
    async def run():
        job = _job()
        assert job.stage == Stage.PLACING and job.target.worker_id == "p0" and job.tokens == [1, 2, 3]
        first = job.attempt
        job.next_attempt()
        assert job.attempt.number == 1 and job.target.worker_id == "p1"
        assert job.attempt.transfer_id != first.transfer_id
        # logprobs asked: only P's answer carries them, so neither attempt commits on landing
        assert not first.commit_on_landing and not job.attempt.commit_on_landing

    asyncio.run(run())


def test_a_resumed_stream_prefills_its_outputs_and_samples_nothing_of_its_own():
    async def run():
        job = _job(Resumption((7, 8)))
        assert job.tokens == [1, 2, 3, 7, 8] and job.prefill_params == RESUMED_PREFILL_PARAMS
        assert _job().prefill_params == job.request.params

    asyncio.run(run())
