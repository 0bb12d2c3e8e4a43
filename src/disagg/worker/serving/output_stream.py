"""One Generate call's stream: the engine's outputs for a request, as the messages the caller
reads, with the request's latency and token metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

from disagg.proto import worker_pb2 as pb
from disagg.worker.serving.convert import error, logprob_to_proto, prompt_logprobs_to_proto
from disagg.worker.serving.metrics import ServingMetrics

HAND_OFF = object()  # queued by `hand_off`


class OutputStream:
    """`sink` is what the engine loop hands outputs to (from its thread); `messages` yields them.
    `finished`: the request ended (its last message is out or on its way), so nothing is left to
    abort. `first_sent` is set once the first message is written: an engine loop that committed a
    landed remote prefill waits for it before its next step (see `KVReceiver._commit_on_landing`)."""

    def __init__(self, prompt_len: int, metrics: ServingMetrics, block_size: int, interval: int = 1):
        self.prompt_len = prompt_len
        self.interval = max(1, interval)  # tokens gathered per message (GenerateRequest.stream_interval)
        self.metrics = metrics
        self.block_size = block_size
        self.arrival = time.monotonic()
        self.finished = False
        self.first_sent = threading.Event()
        self._aio = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def sink(self, out) -> None:
        """Called from the engine-loop thread: an output, None (aborted there) or an exception
        (the engine failed for good)."""
        queue = self._queue  # the queue of now, not of when the call reaches the asyncio thread
        self._aio.call_soon_threadsafe(queue.put_nowait, out)

    def hand_off(self) -> None:
        """End the stream for the router to move it (a draining worker): the messages already
        queued go out first, then an error `migrate`; the request is aborted here."""
        self._aio.call_soon_threadsafe(self._queue.put_nowait, HAND_OFF)

    def restart(self) -> None:
        """Forget what the request's failed remote attempts put in (their abort's end of stream)."""
        self._queue = asyncio.Queue()

    async def messages(self, served: pb.ServedBy) -> AsyncIterator[pb.GenerateResponse]:
        first = True
        last_token_at = None
        held: pb.GenerateResponse | None = None  # tokens gathered, not sent yet (`interval`)
        while True:
            out = await self._queue.get()
            if held is not None and (out is HAND_OFF or out is None or isinstance(out, BaseException)):
                yield held  # what was gathered goes out before the end: a moved stream resumes after it
                held = None
            if out is HAND_OFF:  # not finished: Generate's caller aborts the request here
                yield pb.GenerateResponse(
                    error=error("migrate", "this worker is draining: the stream moves on")
                )
                self.metrics.request_finished("handed_off")
                return
            if isinstance(out, BaseException):  # the engine failed for good
                self.finished = True
                yield pb.GenerateResponse(error=error("engine_failed", str(out)))
                self.metrics.request_finished("error")
                return
            if out is None:  # aborted on the engine thread (Abort RPC, lease reclaim)
                self.finished = True
                yield pb.GenerateResponse(
                    finish_reason="abort", usage=pb.Usage(prompt_tokens=self.prompt_len)
                )
                self.metrics.request_finished("abort")
                return
            msg = held if held is not None else pb.GenerateResponse()
            msg.token_ids.extend(out.new_token_ids)
            msg.text += out.new_text
            if out.new_logprobs:
                msg.logprobs.extend(logprob_to_proto(lp) for lp in out.new_logprobs)
            if not (first or out.finished) and len(msg.token_ids) < self.interval:
                held = msg
                continue
            held = None
            now = time.monotonic()
            if msg.token_ids:
                if last_token_at is None:
                    self.metrics.ttft.observe(now - self.arrival)
                else:
                    self.metrics.itl.observe((now - last_token_at) / len(msg.token_ids))
                last_token_at = now
                self.metrics.generation_tokens.inc(len(msg.token_ids))
            if first:
                msg.served_by.CopyFrom(served)
                if out.prompt_logprobs is not None:
                    msg.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
                first = False
            if out.finished:
                self.finished = True
                self._finish(msg, out, now)
            yield msg
            self.first_sent.set()
            if self.finished:
                return

    def _finish(self, msg: pb.GenerateResponse, out, now: float) -> None:
        msg.finish_reason = out.finish_reason or "stop"
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=self.prompt_len,
                completion_tokens=len(out.outputs[0].token_ids),
                cached_tokens=out.num_cached_tokens,
            )
        )
        self.metrics.prompt_tokens.inc(self.prompt_len)
        count_prefix(self.metrics, self.block_size, self.prompt_len, out.num_cached_tokens)
        self.metrics.e2e.observe(now - self.arrival)
        self.metrics.request_finished(msg.finish_reason)


def count_prefix(metrics: ServingMetrics, block_size: int, prompt_tokens: int, cached_tokens: int) -> None:
    """Prefix-cache hit ratio of this worker, in full blocks of the prompt."""
    metrics.prefix_lookup(prompt_tokens // block_size, cached_tokens // block_size)
