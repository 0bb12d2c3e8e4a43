"""One remote prefill attempt as the decode worker's asyncio side tracks it, and how a remote
prefill fails."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from disagg.proto import worker_pb2 as pb

# Prefill workers a decode worker tries for one prompt: the router's first candidate, then the next.
MAX_ATTEMPTS = 2


class PrefillFailed(Exception):
    """No prefill worker could do it; the request holds nothing of the failed attempts."""


class RequestGone(Exception):
    """The request was aborted while its prefill was in progress."""


class PrefillAborted(PrefillFailed):
    """The request went away during its remote prefill: nothing to prefill locally."""


@dataclass
class Attempt:
    """One remote prefill attempt: its transfer id, the wait for its KV, what its cleanup must know."""

    transfer_id: str
    number: int  # 0: the first attempt (its Prefill call is not fenced by a generation)
    landed: asyncio.Future  # resolves with None once its KV landed, else the failure reason
    # a Prefill call is out and unanswered: P may still be writing into the attempt's blocks
    # (it answers, even with an error, only once its writes settled)
    in_flight: bool = False
    # may the engine loop commit the token P's FINAL notice carries once the KV landed (no
    # logprobs were asked: those come only in P's answer); when it did, the loop's time of it
    commit_on_landing: bool = False
    committed_at: float | None = None
    first_sent: threading.Event | None = None  # the request's first message went out

    @classmethod
    def new(
        cls,
        request_id: str,
        number: int,
        params: pb.SamplingParams,
        first_sent: threading.Event | None = None,
    ) -> Attempt:
        # unique even when a request id comes back: P remembers the transfer ids it refused
        transfer_id = f"{request_id}:{number}:{uuid.uuid4().hex[:8]}"
        commit = not (params.HasField("logprobs") or params.HasField("prompt_logprobs"))
        landed = asyncio.get_running_loop().create_future()
        return cls(transfer_id, number, landed, commit_on_landing=commit, first_sent=first_sent)

    @property
    def on_committed(self) -> Callable[[float], threading.Event | None] | None:
        """What the engine loop calls once it committed the landed prefill (None: it may not)."""
        return self._committed if self.commit_on_landing else None

    def _committed(self, at: float) -> threading.Event | None:
        """Called from the engine-loop thread, before `on_landed`; what to wait on before the
        loop's next step."""
        self.committed_at = at
        return self.first_sent

    def on_landed(self, reason: str | None) -> None:
        """Called from the engine-loop thread."""
        landed = self.landed
        landed.get_loop().call_soon_threadsafe(lambda: landed.done() or landed.set_result(reason))

    @property
    def expect(self) -> tuple:
        """What `KVReceiver.expect` takes after the request id and before the blocks."""
        return self.transfer_id, self.on_landed, self.on_committed
