"""One request's remote prefill on the decode worker, as a record that moves through its stages:
placed (and its blocks reserved), a prefill worker asked, its KV received, committed; or, when no
prefill worker could do it, failed over to a local prefill. `RemotePrefill` moves it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.llm_engine import Reservation
from disagg.worker.engine.resume import Resumption, with_outputs
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.serving.attempt import Attempt
from disagg.worker.serving.core import Sink
from disagg.worker.serving.transfer_record import TransferRecord

# What P samples with for a resumed request: its first token is discarded (D goes on from the
# stream's own outputs), so none of the stream's sampling (grammar, penalties, logprobs) is needed
RESUMED_PREFILL_PARAMS = pb.SamplingParams(top_k=-1)


def prefill_params(request: pb.GenerateRequest, resume: Resumption | None) -> pb.SamplingParams:
    return request.params if resume is None else RESUMED_PREFILL_PARAMS


class Stage(enum.Enum):
    """Where a request's remote prefill stands."""

    # pricing both sites, and a remote decision reserves blocks in the same visit (a pull of a
    # handed-off stream only reserves)
    PLACING = "placing"
    QUEUED_HERE = "queued_here"  # placed here, or no room to reserve: a local prefill, nothing remote
    RESERVED = "reserved"  # blocks held and the engine loop awaiting their KV; no Prefill out yet
    ASKED = "asked"  # the current attempt's Prefill call is out: its KV may land any time
    RECEIVING = "receiving"  # P answered; the rest of its KV is still landing
    COMMITTED = "committed"  # KV in place, first token committed: the request decodes here
    ABORTED = "aborted"  # the request went away meanwhile: its abort owns the blocks
    FAILED = "failed"  # no prefill worker could do it: the caller prefills it here instead


@dataclass(eq=False)
class RemotePrefillRequest:
    """One request's remote prefill on the decode worker: what it was asked for, and what its
    attempts have so far (the blocks, the current attempt, the Redis record, the failures)."""

    rid: str
    prompt: list[int]
    request: pb.GenerateRequest
    params: SamplingParams  # the stream's own sampling, here
    sink: Sink
    resume: Resumption | None  # a moved stream's outputs, prefilled with the prompt
    targets: list[pb.PrefillTarget]  # the prefill workers to try, in order
    attempt: Attempt  # the current one: `attempt.number` indexes `targets`
    arrival: float = 0.0  # when the request arrived (a local prefill queues with it)
    began: float = field(default_factory=time.monotonic)
    stage: Stage = Stage.PLACING
    dst: Reservation | None = None  # the blocks the current attempt writes
    record: TransferRecord | None = None
    failures: list[str] = field(default_factory=list)  # "worker: why", an entry per failed attempt
    sent: float = 0.0  # when the committed attempt's Prefill went out
    setup: float = 0.0  # D's time before that: decision, reservation (a retry: + Redis)
    tokens: list[int] = field(init=False)  # what is prefilled: the prompt, then resumed outputs

    def __post_init__(self) -> None:
        self.tokens = with_outputs(self.prompt, self.resume)

    @property
    def target(self) -> pb.PrefillTarget:
        return self.targets[self.attempt.number]

    @property
    def prefill_params(self) -> pb.SamplingParams:
        return prefill_params(self.request, self.resume)

    @property
    def handoff_of(self) -> str:
        return self.request.resume.handoff_of if self.resume is not None else ""

    def next_attempt(self) -> None:
        """A retry on the next target, under a new transfer id."""
        self.attempt = Attempt.new(
            self.rid, self.attempt.number + 1, self.prefill_params, self.attempt.first_sent
        )
