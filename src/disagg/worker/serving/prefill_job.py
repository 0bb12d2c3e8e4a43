"""A prefill-only request on a prefill worker (P) whose KV goes into a decode worker's (D's)
blocks, and the answer P gives D for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from disagg.worker.engine.outputs import TokenLogprob
from disagg.worker.serving.layer_sends import LayerSends


class JobState(StrEnum):
    PREFILLING = "prefilling"  # in the engine; its blocks are the request's
    SENDING = "sending"  # computed: its blocks pinned until every send is done
    ABORTING = "aborting"  # dropped: waiting for its posted sends to settle
    RELEASED = "released"  # answered; nothing of it is held


@dataclass(frozen=True)
class PrefillResult:
    """P's answer once the prompt's KV reached D: the first token and where the time went."""

    token_id: int
    logprob: TokenLogprob | None
    prompt_logprobs: list[TokenLogprob | None] | None
    cached_tokens: int
    kv_bytes: int
    queue_seconds: float  # until its first prefill step
    compute_seconds: float  # its prefill steps
    transfer_seconds: float  # the KV still moving after the compute


@dataclass(frozen=True)
class PrefillError:
    """P's answer when the prefill failed; given only once nothing more of it will land on D."""

    code: str  # a wire error code: prefill_failed, handshake_required, engine_failed
    message: str


PrefillAnswer = PrefillResult | PrefillError


@dataclass
class PrefillJob:
    engine_id: str  # the transfer id: unique per attempt
    request_id: str  # D's request id (for Abort)
    peer_id: str
    dst_block_ids: list[int]
    skip_blocks: int
    done: Callable[[PrefillAnswer], None]  # called once
    token_id: int = -1
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0
    handles: list = field(default_factory=list)
    sends: LayerSends | None = None  # its per-layer sends, once a layer hook ran
    failed: str = ""
    state: JobState = JobState.PREFILLING
    abort: object = None  # the transport's abort handle while ABORTING
    held: bool = False  # its blocks are held under `hold_key` (aborted mid-prefill)
    started: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # its first prefill step began
    prefilled_at: float | None = None  # its last prompt token was computed

    def result(self, kv_bytes: int, now: float) -> PrefillResult:
        """The answer once every send is done: queue (until the first step), compute, and the KV
        still moving after the compute."""
        scheduled = self.scheduled_at if self.scheduled_at is not None else self.started
        prefilled = self.prefilled_at if self.prefilled_at is not None else now
        return PrefillResult(
            token_id=self.token_id,
            logprob=self.logprob,
            prompt_logprobs=self.prompt_logprobs,
            cached_tokens=self.cached_tokens,
            kv_bytes=kv_bytes,
            queue_seconds=max(scheduled - self.started, 0.0),
            compute_seconds=max(prefilled - scheduled, 0.0),
            transfer_seconds=max(now - prefilled, 0.0),
        )

    @property
    def hold_key(self) -> str:
        return f"abort:{self.engine_id}"
