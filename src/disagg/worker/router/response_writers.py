"""The response to a generation request, written from its generations' events: one JSON body once
every generation ended (`whole`), or SSE chunks as their tokens arrive (`stream`), interleaved
across choices. Either runs the generations concurrently; when it returns or fails, those still
running are cancelled (each aborts on its worker): a client that goes away, or one generation that
fails, ends the rest.

Each generation frees its admission slot and its workers' in-flight counts as soon as it ends on
its worker, before its output is written: what a slow client holds after that is only its unsent
bytes, and every write is bounded by `--client-write-timeout` (`client_writes.py`); a client
disconnected for not reading ends the response like one that went away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from disagg.worker.router import generation_metrics
from disagg.worker.router.admission import Slots
from disagg.worker.router.client_writes import BoundedWrites, SlowClient
from disagg.worker.router.errors import APIError
from disagg.worker.router.fanout import total_usage
from disagg.worker.router.generation import Generation
from disagg.worker.router.openai_format import ResponseBuilder, usage_body
from disagg.worker.router.validation import GenerationSpec
from disagg.worker.router.worker_errors import message_error
from disagg.worker.serving.metrics import ServingMetrics


def _failure(item) -> APIError | None:
    """The error an event carries, if it is one: (generation, APIError | error message)."""
    if isinstance(item, APIError):
        return item
    if item is not None and item.HasField("error"):
        return message_error(item)
    return None


def _served_headers(generations: list[Generation]) -> dict[str, str]:
    """The workers that served the request (comma-separated, in choice order, when several)."""
    decode = dict.fromkeys(g.decode.worker_id for g in generations)
    prefill = dict.fromkeys(g.state.prefill_worker for g in generations if g.state.prefill_worker)
    h = {"X-Disagg-Decode-Worker": ",".join(decode)}
    if prefill:
        h["X-Disagg-Prefill-Worker"] = ",".join(prefill)
    return h


class ResponseWriter:
    def __init__(self, metrics: ServingMetrics, clock: Callable[[], float], write_timeout: float):
        self.metrics = metrics
        self.clock = clock
        self.write_timeout = write_timeout

    @staticmethod
    def _run(generations: list[Generation], events: asyncio.Queue, slots: Slots) -> list[asyncio.Task]:
        """Start the generations; each one's slot is freed when it ends on its worker."""

        def ended(generation: Generation) -> Callable[[asyncio.Task], None]:
            def free(_task: asyncio.Task) -> None:
                generation.release()
                slots.free()

            return free

        tasks = []
        for g in generations:
            t = asyncio.create_task(g.run(events))
            t.add_done_callback(ended(g))
            tasks.append(t)
        return tasks

    def _writes(self, request: web.Request, response: web.StreamResponse) -> BoundedWrites:
        return BoundedWrites(request, response, self.write_timeout, self.metrics.slow_client)

    async def _stop(self, tasks: list[asyncio.Task]) -> None:
        """Cancel the generations still running (each aborts on its worker) and count them."""
        live = [t for t in tasks if not t.done()]
        for t in live:
            t.cancel()
        await asyncio.gather(*live, return_exceptions=True)
        for _ in live:
            self.metrics.request_finished("abort")

    async def whole(
        self,
        request: web.Request,
        generations: list[Generation],
        builder: ResponseBuilder,
        prompt_lengths: list[int],
        arrival: float,
        slots: Slots,
    ) -> web.Response:
        events: asyncio.Queue = asyncio.Queue()
        tasks = self._run(generations, events, slots)
        try:
            pending = len(generations)
            while pending:
                g, item = await events.get()
                err = _failure(item)
                if err is not None:
                    raise err
                if item is None:
                    pending -= 1
                else:
                    g.state.add(item, self.clock())
        finally:
            await self._stop(tasks)
        states = [g.state for g in generations]
        body = builder.response(
            [
                builder.choice(
                    s.plan.index, s.response_text(), s.response_logprobs(), s.finish_reason or "stop"
                )
                for s in states
            ],
            total_usage(states, prompt_lengths),
        )
        resp = web.json_response(body, headers=_served_headers(generations))
        writes = self._writes(request, resp)
        try:
            await writes.prepare()
            await writes.write_eof()
        except SlowClient:
            return resp
        end = self.clock()
        for s in states:
            # a whole body has no first byte before its last: TTFT here is when the first token
            # reached the router, so that prefill scales on prefill time whatever the client asked
            generation_metrics.record(
                self.metrics, arrival, s, s.finish_reason or "stop", s.first_token_at, end
            )
        return resp

    async def stream(
        self,
        request: web.Request,
        spec: GenerationSpec,
        generations: list[Generation],
        builder: ResponseBuilder,
        arrival: float,
        slots: Slots,
    ) -> web.StreamResponse:
        events: asyncio.Queue = asyncio.Queue()
        tasks = self._run(generations, events, slots)
        try:
            # Answer once every generation sent its first message, so that errors found before any
            # token (bad parameters on the worker, no prefill worker) still get a proper HTTP status.
            held: list = []
            started: set[int] = set()
            while len(started) < len(generations):
                g, item = await events.get()
                err = _failure(item)
                if err is not None:
                    raise err
                started.add(g.state.plan.index)
                held.append((g, item))
            for g, item in held:
                if item is not None and item.HasField("served_by"):
                    g.state.prefill_worker = item.served_by.prefill_worker
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    **_served_headers(generations),
                }  # fmt: skip
            )
            writes = self._writes(request, resp)
            await writes.prepare()
            if start := builder.stream_start():
                await writes.write(start)
            pending = len(generations)
            error = None
            first_written: dict[int, float] = {}  # choice index -> when its first chunk was written
            while pending:
                g, item = held.pop(0) if held else await events.get()
                error = _failure(item)
                if error is not None:
                    first = first_written.get(g.state.plan.index)
                    generation_metrics.record(self.metrics, arrival, g.state, "error", first, self.clock())
                    break
                if item is None:
                    pending -= 1
                    continue
                delta = g.state.add(item, self.clock())
                # tokens whose text is held back (an incomplete UTF-8 character, a possible stop
                # string) produce no chunk unless their logprobs were asked for
                if delta.text or delta.finish_reason or (delta.logprobs and builder.want_logprobs):
                    usage = None
                    if spec.continuous_usage:  # this choice's usage so far, as vLLM sends it
                        s = g.state
                        usage = usage_body(s.prompt_tokens or len(g.req.prompt_token_ids), s.output_tokens,
                                           s.cached_tokens)  # fmt: skip
                    chunk = builder.stream_chunk(
                        delta.text, delta.logprobs, delta.finish_reason or None, spec.include_usage,
                        g.state.plan.index, usage,
                    )  # fmt: skip
                    await writes.write(chunk)
                    first_written.setdefault(g.state.plan.index, self.clock())
            if error is not None:
                await writes.write(builder.stream_error(error))
            else:
                usage = None
                if spec.include_usage:
                    lengths = [0] * spec.num_prompts
                    for g in generations:
                        lengths[g.state.plan.prompt_index] = len(g.req.prompt_token_ids)
                    usage = total_usage([g.state for g in generations], lengths)
                await writes.write(builder.stream_end(usage))
            await writes.write_eof()
            if error is None:
                end = self.clock()  # the last byte written: every generation's end, as the client saw it
                for g in generations:
                    s = g.state
                    first = first_written.get(s.plan.index)
                    generation_metrics.record(self.metrics, arrival, s, s.finish_reason or "stop", first, end)
            return resp
        except SlowClient as gone:
            return gone.response  # disconnected: the generations still running are aborted below
        finally:
            await self._stop(tasks)
