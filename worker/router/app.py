"""The router's aiohttp application: OpenAI endpoints in front of the worker pool.

Per request: authenticate, validate, tokenize (chat template), compute the prompt's block
hashes, look them up in the Redis prefix index (skipped, and counted, when Redis is down),
pick a decode worker and ranked prefill candidates, then relay the worker's `Generate`
stream as SSE or as one JSON body. A client that goes away cancels the stream, which aborts
the request on the worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from disagg.proto import worker_pb2
from disagg.worker.block_hash import block_hashes
from disagg.worker.metrics import CONTENT_TYPE, ServingMetrics
from disagg.worker.router.errors import APIError, invalid
from disagg.worker.router.openai_format import SSE_DONE, Logprob, ResponseBuilder, sse, usage_body
from disagg.worker.router.policy import choose_decode, rank_prefill
from disagg.worker.router.validation import GenerationSpec, fit_to_context, parse_chat, parse_completion
from disagg.worker.router.workers import WorkerPool

log = logging.getLogger("disagg.router")


@dataclass
class RouterConfig:
    model_name: str
    max_model_len: int
    block_size: int = 16
    api_keys: frozenset[str] = field(default_factory=frozenset)
    max_queue: int = 256  # requests in flight in this router before 429
    prefill_candidates: int = 2  # the first is tried, the next one on failure
    request_timeout: float = 600.0


class Router:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer,
        pool: WorkerPool,
        prefix_lookup: Callable[[list[int]], dict[str, int]] | None = None,
        metrics: ServingMetrics | None = None,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.prefix_lookup = prefix_lookup
        self.metrics = metrics or ServingMetrics("router", config.model_name)
        self.inflight = 0
        self._prefix_warned = False
        self._token_text_cache: dict[int, str] = {}

    # ---- app ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_middleware], client_max_size=32 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app) -> None:
        await self.pool.start()

    async def _on_cleanup(self, _app) -> None:
        await self.pool.stop()

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as e:
            self.metrics.rejected(e.status)
            return web.json_response(e.body(), status=e.status, headers=e.headers())
        except web.HTTPException as e:
            if e.status >= 400:
                err = APIError(e.status, e.reason or "error")
                return web.json_response(err.body(), status=e.status)
            raise

    # ---- small endpoints ----------------------------------------------------------------------
    def _check_key(self, request: web.Request) -> None:
        if not self.config.api_keys:
            return
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if token not in self.config.api_keys:
            msg = (
                "Incorrect API key provided."
                if token
                else "Missing API key: send 'Authorization: Bearer <key>'."
            )
            raise APIError(401, msg, code="invalid_api_key")

    async def models(self, request: web.Request) -> web.Response:
        self._check_key(request)
        card = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "disagg"}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, _request: web.Request) -> web.Response:
        views = self.pool.views()
        decode = [v for v in views if v.role in ("decode", "both")]
        body = {
            "status": "ok" if decode else "no_workers",
            "workers": [
                {
                    "id": v.worker_id if v else None,
                    "address": addr,
                    "role": v.role if v else None,
                    "ready": ready,
                }
                for v, ready, addr in self.pool.all_views()
            ],
            "registry": self.pool.registry_ok,
        }
        return web.json_response(body, status=200 if decode else 503)

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    # ---- generation -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def _body(self, request: web.Request):
        try:
            raw = await request.read()
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid(None, f"the request body is not valid JSON: {e}", code="invalid_json") from e

    def _tokenize(self, spec: GenerationSpec) -> list[int]:
        if spec.kind == "chat":
            try:
                text = self.tokenizer.apply_chat_template(spec.messages, add_generation_prompt=True)
            except Exception as e:  # template errors (raise_exception in the template) are the caller's
                raise invalid("messages", f"the chat template rejected the messages: {e}") from e
            return self.tokenizer.encode(text, add_special_tokens=False)
        if spec.prompt_token_ids is not None:
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in spec.prompt_token_ids if t >= vocab), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is out of the vocabulary (size {vocab})")
            return list(spec.prompt_token_ids)
        return self.tokenizer.encode(spec.prompt_text)

    async def _prefix_match(self, hashes: list[int]) -> dict[str, int]:
        if not hashes or self.prefix_lookup is None:
            return {}
        try:
            match = await asyncio.wait_for(asyncio.to_thread(self.prefix_lookup, hashes), timeout=0.5)
        except Exception as e:
            self.metrics.prefix_routing_unavailable.inc()
            if not self._prefix_warned:
                log.warning("prefix index unavailable (%s): routing without prefix awareness", e)
                self._prefix_warned = True
            return {}
        if self._prefix_warned:
            log.info("prefix index available again")
            self._prefix_warned = False
        best = max(match.values(), default=0)
        self.metrics.prefix_lookup(len(hashes), best)
        return match

    def _params(self, spec: GenerationSpec, max_tokens: int) -> worker_pb2.SamplingParams:
        s = spec.sampling
        p = worker_pb2.SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=s.min_tokens,
            stop=s.stop,
            stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos,
            skip_special_tokens=s.skip_special_tokens,
        )
        if s.seed is not None:
            p.seed = s.seed
        if s.logprobs is not None:
            p.logprobs = s.logprobs
        return p

    def token_text(self, token_id: int) -> str:
        t = self._token_text_cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = t
        return t

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        arrival = time.monotonic()
        self._check_key(request)
        spec = parse(await self._body(request))
        if spec.model != self.config.model_name:
            raise APIError(
                404, f"The model '{spec.model}' does not exist.", param="model", code="model_not_found"
            )
        if self.inflight >= self.config.max_queue:
            raise APIError(429, "The server is at capacity; retry shortly.", code="queue_full", retry_after=1)
        prompt_ids = self._tokenize(spec)
        max_tokens = fit_to_context(spec.sampling, len(prompt_ids), self.config.max_model_len, spec.kind)
        hashes = block_hashes(prompt_ids, self.config.block_size)
        match = await self._prefix_match(hashes)
        views = self.pool.views()
        decode = choose_decode(views, match, len(hashes))
        if decode is None:
            raise APIError(503, "No decode worker is ready; retry shortly.", code="no_workers", retry_after=2)
        targets = [
            worker_pb2.PrefillTarget(worker_id=p.worker_id, address=p.address)
            for p in rank_prefill(views, match, self.config.prefill_candidates)
        ]
        req = worker_pb2.GenerateRequest(
            request_id=request.headers.get("X-Request-Id") or uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            params=self._params(spec, max_tokens),
            prefill_targets=targets,
        )
        builder = ResponseBuilder(spec.kind, spec.model, self.token_text, spec.sampling.logprobs is not None)
        self.inflight += 1
        used = [decode]
        self.pool.begin(decode.worker_id)
        try:
            decode, call, first_msg = await self._start(req, decode, match, len(hashes), used)
            if spec.stream:
                return await self._stream(request, spec, req, decode, call, first_msg, builder, arrival)
            return await self._unary(req, decode, call, first_msg, builder, arrival)
        finally:
            self.inflight -= 1
            for d in used:
                self.pool.end(d.worker_id)

    async def _start(self, req, decode, match, prompt_blocks: int, used: list):
        """Open the worker's stream and wait for its first message. A decode worker that turns out
        unreachable before answering anything is replaced by another one, once: nothing was sent
        to the client yet, and whatever the dead worker held is reclaimed by its leases."""
        for attempt in range(2):
            call = self.pool.stub(decode.address).Generate(req, timeout=self.config.request_timeout)
            try:
                return decode, call, await call.__aiter__().__anext__()
            except StopAsyncIteration:
                raise APIError(
                    500, "the worker closed the stream without output", code="worker_error"
                ) from None
            except grpc.aio.AioRpcError as e:
                err = self._worker_error(decode, e)
                taken = {u.worker_id for u in used}
                alt = choose_decode(
                    [v for v in self.pool.views() if v.worker_id not in taken], match, prompt_blocks
                )
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt or alt is None:
                    raise err from e
                log.warning("decode worker %s unavailable (%s); retrying on %s", decode.worker_id, e.details(),
                            alt.worker_id)  # fmt: skip
                decode = alt
                used.append(alt)
                self.pool.begin(alt.worker_id)
            except asyncio.CancelledError:
                call.cancel()
                asyncio.ensure_future(self._abort(decode, req.request_id))
                raise
        raise AssertionError("unreachable")

    async def _abort(self, decode, request_id: str) -> None:
        try:
            await self.pool.stub(decode.address).Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=2.0
            )
        except grpc.aio.AioRpcError:
            pass

    def _worker_error(self, decode, e: grpc.aio.AioRpcError) -> APIError:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            self.pool.mark_failed(decode.worker_id)
            return APIError(503, f"worker {decode.worker_id} is unavailable: {e.details()}", code="worker_unavailable",
                            retry_after=1)  # fmt: skip
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return APIError(504, "the request timed out", code="timeout")
        return APIError(500, f"worker {decode.worker_id} failed: {e.details()}", code="worker_error")

    @staticmethod
    def _msg_error(msg) -> APIError:
        code = msg.error.code or "internal"
        status = {"invalid_request": 400, "unavailable": 503, "draining": 503, "prefill_failed": 503}.get(
            code, 500
        )
        return APIError(status, msg.error.message, code=code, retry_after=1 if status == 503 else None)

    def _record(self, arrival: float, first: float | None, last: float, n: int, finish: str) -> None:
        if first is not None:
            self.metrics.ttft.observe(first - arrival)
            if n > 1:
                self.metrics.itl.observe((last - first) / (n - 1))
        self.metrics.e2e.observe(last - arrival)
        self.metrics.request_finished(finish)

    async def _unary(
        self, req, decode, call, first_msg, builder: ResponseBuilder, arrival: float
    ) -> web.Response:
        text, lps, finish, usage, served = [], [], "", None, None
        first = None
        ntok = 0
        it = call.__aiter__()
        msg = first_msg
        try:
            while msg is not None:
                if msg.HasField("error"):
                    raise self._msg_error(msg)
                if msg.HasField("served_by"):
                    served = msg.served_by
                if msg.token_ids and first is None:
                    first = time.monotonic()
                ntok += len(msg.token_ids)
                text.append(msg.text)
                lps.extend(
                    Logprob(x.token_id, x.logprob, [(t.token_id, t.logprob) for t in x.top])
                    for x in msg.logprobs
                )
                if msg.finish_reason:
                    finish = msg.finish_reason
                if msg.HasField("usage"):
                    usage = msg.usage
                msg = await anext(it, None)
        except grpc.aio.AioRpcError as e:
            raise self._worker_error(decode, e) from e
        except asyncio.CancelledError:
            call.cancel()
            asyncio.ensure_future(self._abort(decode, req.request_id))
            raise
        self._record(arrival, first, time.monotonic(), ntok, finish)
        u = usage_body(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if usage else usage_body(
            len(req.prompt_token_ids), ntok)  # fmt: skip
        body = builder.full("".join(text), lps, finish or "stop", u)
        return web.json_response(body, headers=self._served_headers(served, decode))

    @staticmethod
    def _served_headers(served, decode) -> dict[str, str]:
        h = {"X-Disagg-Decode-Worker": decode.worker_id}
        if served is not None and served.prefill_worker:
            h["X-Disagg-Prefill-Worker"] = served.prefill_worker
        return h

    async def _stream(
        self, request, spec, req, decode, call, first_msg, builder: ResponseBuilder, arrival: float
    ):
        # The first message came before answering, so that errors found before any token (bad
        # parameters on the worker, no prefill worker) still get a proper HTTP status.
        it = call.__aiter__()
        if first_msg.HasField("error"):
            raise self._msg_error(first_msg)
        served = first_msg.served_by if first_msg.HasField("served_by") else None
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **self._served_headers(served, decode),
            }  # fmt: skip
        )
        await resp.prepare(request)
        first = None
        ntok = 0
        finish = ""
        usage = None
        msg = first_msg
        try:
            while True:
                if msg.HasField("error"):
                    err = self._msg_error(msg)
                    await resp.write(sse(err.body()))
                    finish = "error"
                    break
                if msg.token_ids and first is None:
                    first = time.monotonic()
                ntok += len(msg.token_ids)
                if msg.HasField("usage"):
                    usage = msg.usage
                lps = [
                    Logprob(x.token_id, x.logprob, [(t.token_id, t.logprob) for t in x.top])
                    for x in msg.logprobs
                ]
                # tokens whose text is held back (an incomplete UTF-8 character, a possible stop
                # string) produce no chunk unless their logprobs were asked for
                if msg.text or msg.finish_reason or (lps and builder.want_logprobs):
                    chunk = builder.chunk(msg.text, lps, msg.finish_reason or None, spec.include_usage)
                    await resp.write(sse(chunk))
                if msg.finish_reason:
                    finish = msg.finish_reason
                try:
                    msg = await it.__anext__()
                except StopAsyncIteration:
                    break
        except grpc.aio.AioRpcError as e:
            err = self._worker_error(decode, e)
            await resp.write(sse(err.body()))
            finish = "error"
        except (asyncio.CancelledError, ConnectionResetError):
            call.cancel()
            asyncio.ensure_future(self._abort(decode, req.request_id))
            self.metrics.request_finished("abort")
            raise
        self._record(arrival, first, time.monotonic(), ntok, finish)
        if finish != "error":
            if spec.include_usage:
                u = usage or worker_pb2.Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=ntok)
                await resp.write(sse(builder.usage_chunk(usage_body(u.prompt_tokens, u.completion_tokens,
                                                                    u.cached_tokens))))  # fmt: skip
            await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp
