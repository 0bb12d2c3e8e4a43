"""The router's aiohttp application: OpenAI endpoints in front of the worker pool.

Per request: authenticate, validate, tokenize (chat template), compute the prompt's block
hashes, look them up in the Redis prefix index (skipped, and counted, when Redis is down).
A request fans out to one generation per (prompt, sample) — batched prompts, `n` > 1 — and
each gets its own decode worker and ranked prefill candidates. Their `Generate` streams run
concurrently and are relayed as interleaved SSE chunks or merged into one JSON body. A client
that goes away, or one generation that fails, cancels the rest, which aborts them on the workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib.metadata
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from disagg.proto import worker_pb2
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.router import readiness
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.body import read_body
from disagg.worker.router.errors import APIError, invalid
from disagg.worker.router.fanout import ChoiceState, Echo, plan_choices, total_usage
from disagg.worker.router.migration import (
    MIGRATION_SUFFIX,
    MOVABLE_ERRORS,
    finished_message,
    resumed_request,
    worth_pulling,
)
from disagg.worker.router.openai_format import ResponseBuilder, usage_body
from disagg.worker.router.openapi import openapi_spec
from disagg.worker.router.policy import (
    Lending,
    WorkerView,
    choose_decode,
    rank_holders,
    rank_prefill,
    served_quantization,
)
from disagg.worker.router.responses_format import ResponsesBuilder
from disagg.worker.router.responses_request import parse_responses
from disagg.worker.router.tokenize_api import (
    TokenizeChat,
    chat_messages,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
)
from disagg.worker.router.tools import ToolCalls
from disagg.worker.router.unsupported import fallback
from disagg.worker.router.validation import (
    GenerationSpec,
    check_choice_count,
    check_prompt_size,
    fit_to_context,
    parse_chat,
    parse_completion,
)
from disagg.worker.router.workers import WorkerPool
from disagg.worker.serving.auth import INSECURE, REFUSED, InternalAuth
from disagg.worker.serving.convert import sampling_params_to_proto
from disagg.worker.serving.metrics import CONTENT_TYPE, ServingMetrics
from disagg.worker.serving.remote_prefill import MAX_ATTEMPTS

log = logging.getLogger("disagg.router")

try:
    VERSION = importlib.metadata.version("disagg")
except importlib.metadata.PackageNotFoundError:  # a source tree without the distribution installed
    VERSION = "unknown"

ECHO_HEADERS = web.RequestKey("echo_headers", dict)
# When the request arrived: its latency is measured from here (before its body is read or parsed)
# to the first and last byte written, as its client sees it.
ARRIVAL = web.RequestKey("arrival", float)


# A decode worker tries its first prefill candidate and, when that fails, the next
# (serving/remote_prefill.py): offering it more would go unused.
PREFILL_CANDIDATES = MAX_ATTEMPTS


def _load_fields(v: WorkerView) -> dict[str, int | float]:
    """A worker's load at the last poll, as routing sees it."""
    return {
        "running": v.running, "waiting": v.waiting, "free_blocks": v.free_blocks,
        "total_blocks": v.total_blocks, "queued_prefill_tokens": v.queued_prefill_tokens,
        "prefill_tokens_per_s": v.prefill_tokens_per_s, "decode_step_seconds": v.decode_step_seconds,
    }  # fmt: skip


@dataclass
class _Choice:
    """One generation of a request: its worker request, where it runs, and what was relayed of it
    (what a move to another worker resumes from)."""

    state: ChoiceState
    req: worker_pb2.GenerateRequest
    decode: WorkerView
    used: list[WorkerView]  # decode workers counted in flight for it (a retry adds one)
    prompt_blocks: int
    match: dict[str, int]
    call: object = None  # the current worker's Generate call
    sent_ids: list[int] = field(default_factory=list)  # tokens relayed, over every worker
    sent_chars: int = 0  # characters of their text relayed
    migrations: int = 0
    moved_for: str | None = None  # why it last moved, until the new worker's first token
    moved_at: float | None = None
    last_token_at: float | None = None

    @property
    def original_id(self) -> str:
        return self.req.request_id.split(MIGRATION_SUFFIX, 1)[0]

    def relayed(self, msg, now: float, metrics: ServingMetrics) -> None:
        self.sent_ids.extend(msg.token_ids)
        self.sent_chars += len(msg.text)
        if msg.token_ids:
            if self.moved_for is not None:  # the first token after a move: the gap the client saw
                gap = now - (self.last_token_at if self.last_token_at is not None else self.moved_at)
                metrics.migrated(self.moved_for, "resumed", gap)
                self.moved_for = None
            self.last_token_at = now

    def moved(self, reason: str, now: float) -> None:
        self.moved_for, self.moved_at = reason, now


class Router:
    def __init__(
        self,
        args: RouterArgs,
        tokenizer,
        pool: WorkerPool,
        *,
        model_name: str,
        api_keys: frozenset[str] = frozenset(),
        prefix_lookup: Callable[[list[int]], dict[str, int]] | None = None,
        metrics: ServingMetrics | None = None,
        internal_auth: InternalAuth = INSECURE,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`args.max_model_len` is the model's context, resolved (the flag's None is not)."""
        if args.max_model_len is None:
            raise ValueError("the router needs max_model_len: the model's context, resolved before")
        self.args = args
        self.model_name = model_name
        self.api_keys = api_keys
        self.max_choices = args.resolved_max_choices()
        self.clock = clock  # every latency the router reports (tests inject theirs)
        self.internal_auth = internal_auth
        # Tokenizing and chat templates run here, off the event loop: a long prompt must not hold
        # up /health or other requests.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        self.tokenizer = tokenizer
        self.pool = pool
        self.prefix_lookup = prefix_lookup
        self.metrics = metrics or ServingMetrics("router", model_name)
        self.inflight = 0
        self.created = int(time.time())  # the model card's `created`: when this router started serving it
        self._prefix_warned = False
        self._token_text_cache: dict[int, str] = {}

    # ---- app ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        # bodies are decoded by read_body under max_body_bytes, not by aiohttp (router/body.py)
        app = web.Application(
            middlewares=[self._arrival_middleware, self._errors_middleware],
            client_max_size=self.args.max_body_bytes,
            handler_args={"auto_decompress": False},
        )
        served = {
            "/v1/completions": ("POST", self.completions),
            "/v1/chat/completions": ("POST", self.chat_completions),
            "/v1/responses": ("POST", self.responses),
            "/v1/models": ("GET", self.models),
            "/v1/models/{model_id}": ("GET", self.model),
            "/health": ("GET", self.health),
            "/ping": ("GET", self.health),  # vLLM's (SageMaker's) name for the same readiness
            "/invocations": ("POST", self.invocations),
            "/version": ("GET", self.version),
            "/tokenize": ("POST", self.tokenize),
            "/detokenize": ("POST", self.detokenize),
            "/internal/workers": ("GET", self.internal_workers),
            "/openapi.json": ("GET", self.openapi),
            "/metrics": ("GET", self.metrics_page),
        }
        for path, (method, handler) in served.items():
            # clients and proxies add a trailing slash: the same route, not a 405 or a redirect
            path = path.replace("{model_id}", "{model_id:.+}")  # model ids hold slashes (org/model)
            for p in (path, path + "/") if not path.endswith("}") else (path,):
                app.router.add_route(method, p, handler)
                if method == "GET":
                    app.router.add_route("HEAD", p, handler)
        methods = {path: [m, *(["HEAD"] if m == "GET" else [])] for path, (m, _) in served.items()}
        catch_all = fallback(methods)
        app.router.add_route("*", "/v1/{endpoint:.*}", catch_all)  # after every served route
        for path in methods:
            if not path.startswith("/v1/"):  # another method on a served path outside /v1: 405 too
                app.router.add_route("*", path, catch_all)
                app.router.add_route("*", path + "/", catch_all)
        app.on_response_prepare.append(self._echo_headers)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    @staticmethod
    async def _echo_headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(request.get(ECHO_HEADERS) or {})

    async def _on_startup(self, _app) -> None:
        await self.pool.start()

    async def _on_cleanup(self, _app) -> None:
        await self.pool.stop()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _arrival_middleware(self, request: web.Request, handler):
        request[ARRIVAL] = self.clock()  # the outermost middleware: before anything reads the body
        return await handler(request)

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
        if not self.api_keys:
            return
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if token not in self.api_keys:
            msg = (
                "Incorrect API key provided."
                if token
                else "Missing API key: send 'Authorization: Bearer <key>'."
            )
            raise APIError(401, msg, code="invalid_api_key")

    def _card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "disagg",
            "quantization": served_quantization(self.pool.views()),
        }

    async def models(self, request: web.Request) -> web.Response:
        self._check_key(request)
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{id}` (the SDKs' `models.retrieve`)."""
        self._check_key(request)
        model_id = request.match_info["model_id"].rstrip("/")
        if model_id != self.model_name:
            raise self._unknown_model(model_id)
        return web.json_response(self._card())

    @staticmethod
    def _unknown_model(name: str) -> APIError:
        return APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize`: a prompt, or chat messages rendered by the chat template."""
        self._check_key(request)
        req = parse_tokenize(await read_body(request, self.args.max_body_bytes))
        self._check_model(req.model)
        if isinstance(req, TokenizeChat):
            messages = chat_messages(req)
            tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or []] or None
            spec = GenerationSpec("chat", "", SamplingParams(max_tokens=None), messages=messages)
            check_prompt_size(spec, self.args.max_prompt_bytes, self.args.max_model_len)
            render = functools.partial(self._render_chat, messages, tools, req.add_generation_prompt,
                                       req.add_special_tokens)  # fmt: skip
        else:
            spec = GenerationSpec("completion", "", SamplingParams(max_tokens=None), prompts=[req.prompt])
            check_prompt_size(spec, self.args.max_prompt_bytes, self.args.max_model_len)
            render = functools.partial(
                self.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens
            )
        ids = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, render)
        strs = [self.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return web.json_response(tokenize_body(ids, self.args.max_model_len, strs))

    def _render_chat(
        self, messages, tools, add_generation_prompt: bool, add_special_tokens: bool
    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except Exception as e:  # template errors (raise_exception in the template) are the caller's
            raise invalid("messages", f"the chat template rejected the messages: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/detokenize`: token ids back to text."""
        self._check_key(request)
        req = parse_detokenize(await read_body(request, self.args.max_body_bytes))
        self._check_model(req.model)
        vocab = self.tokenizer.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
        if bad is not None:
            raise invalid(
                f"tokens[{bad}]", f"token id {req.tokens[bad]} is out of the vocabulary (size {vocab})"
            )
        return web.json_response({"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise self._unknown_model(model)

    async def openapi(self, _request: web.Request) -> web.Response:
        return web.json_response(openapi_spec(self.model_name))

    async def health(self, _request: web.Request) -> web.Response:
        """Readiness for clients and probes: counts only, no worker ids or internal addresses."""
        views = self.pool.views()
        decode = sum(1 for v in views if v.role in ("decode", "both"))
        prefill = sum(1 for v in views if v.role == "prefill")
        state = readiness.Readiness(decode, prefill, self.pool.registry_problem, self.pool.uses_registry)
        return web.json_response(state.body(), status=200 if state.ready else 503)

    async def internal_workers(self, request: web.Request) -> web.Response:
        """Every known worker with its id and address, for operators and tools holding the
        deployment's internal credential."""
        if not self.internal_auth.check(request.headers.get("Authorization")):
            REFUSED.labels("internal_workers").inc()
            return web.json_response({"error": "missing or wrong internal credential"}, status=401)
        body = {
            "workers": [
                {
                    "id": v.worker_id if v else None,
                    "address": addr,
                    "role": v.role if v else None,
                    "ready": ready,
                    "load": _load_fields(v) if v else None,
                }
                for v, ready, addr in self.pool.all_views()
            ],
            "registry": self.pool.registry_ok,
        }
        return web.json_response(body)

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    # ---- generation -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_responses, ResponsesBuilder)

    async def _tokenize_all(self, spec: GenerationSpec) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(
                *(
                    loop.run_in_executor(self._tokenize_pool, self._tokenize, spec, i)
                    for i in range(spec.num_prompts)
                )
            )
        )

    def _tokenize(self, spec: GenerationSpec, prompt_index: int) -> list[int]:
        if spec.kind == "chat":
            try:
                tools = spec.tools.tools if spec.tools is not None else None
                text = self.tokenizer.apply_chat_template(
                    spec.messages, add_generation_prompt=True, tools=tools
                )
            except Exception as e:  # template errors (raise_exception in the template) are the caller's
                raise invalid("messages", f"the chat template rejected the messages: {e}") from e
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = spec.prompts[prompt_index]
        if isinstance(prompt, list):
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is out of the vocabulary (size {vocab})")
            return list(prompt)
        return self.tokenizer.encode(prompt)

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

    def token_text(self, token_id: int) -> str:
        t = self._token_text_cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = t
        return t

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's inference route, as vLLM serves it: the body's shape picks the API (`messages`:
        chat, `prompt`: completion, `input`: responses), with that API's validation and answer."""
        self._check_key(request)
        raw = await read_body(request, self.args.max_body_bytes)
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise invalid(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        for key, parse, builder in (
            ("messages", parse_chat, ResponseBuilder),
            ("prompt", parse_completion, ResponseBuilder),
            ("input", parse_responses, ResponsesBuilder),
        ):
            if key in body:
                return await self._generate(request, parse, builder, body=body)
        raise invalid(
            None, "/invocations takes a chat ('messages'), completion ('prompt') or responses ('input') body"
        )

    async def _generate(
        self, request: web.Request, parse, builder_cls=ResponseBuilder, body: dict | None = None
    ) -> web.StreamResponse:
        arrival = request.get(ARRIVAL) or self.clock()
        self._check_key(request)
        if body is None:  # JSON decoding and validation in one pass (protocol.py)
            spec = parse(await read_body(request, self.args.max_body_bytes))
        else:
            spec = parse(body)
        if spec.model != self.model_name:
            raise self._unknown_model(spec.model)
        check_choice_count(spec, self.max_choices)
        check_prompt_size(spec, self.args.max_prompt_bytes, self.args.max_model_len)
        seed = spec.sampling.seed
        if seed is None and not spec.sampling.greedy:
            # every sampled generation carries a seed: a stream moved to another worker goes on
            # drawing from its own random numbers (seeds.py)
            seed = secrets.randbits(63)
        plans = plan_choices(spec.num_prompts, spec.n, seed)
        # admission counts generations, not HTTP requests: n=8 weighs as much as 8 requests; the
        # count is taken together with the check, before any await, so a burst cannot slip past it
        if self.inflight + len(plans) > self.args.max_queue:
            raise APIError(429, "The server is at capacity; retry shortly.", code="queue_full", retry_after=1)
        self.inflight += len(plans)
        choices: list[_Choice] = []
        try:
            prompts = await self._tokenize_all(spec)
            max_tokens = [self._fit(spec, i, len(ids)) for i, ids in enumerate(prompts)]
            hashes = [block_hashes(ids, self.args.block_size) for ids in prompts]
            matches = await asyncio.gather(*(self._prefix_match(h) for h in hashes))
            # Our own id for the workers and Redis: a client's X-Request-Id is only echoed back, so
            # one client cannot name (and abort) another's generation.
            base_id = uuid.uuid4().hex
            client_id = request.headers.get("X-Request-Id")
            request[ECHO_HEADERS] = {"X-Request-Id": client_id or base_id}
            tools = ToolCalls(spec.tools, self.args.tool_call_parser) if spec.tools is not None else None
            builder = builder_cls.for_spec(spec, self.token_text, tools)
            for plan in plans:
                p = plan.prompt_index
                # one routing decision per generation; each `begin` below weighs on the next choice
                views = self.pool.views()
                lend = Lending(self.args.prefill_overflow, len(prompts[p]), max_tokens[p])
                decode = choose_decode(views, matches[p], len(hashes[p]), lend)
                if decode is None:
                    # a worker leaves rotation for a poll or two (restarting, one failed poll): wait
                    # for the next poll of the pool before answering 503
                    await self.pool.next_refresh(timeout=2 * self.pool.refresh_seconds + 1)
                    views = self.pool.views()
                    decode = choose_decode(views, matches[p], len(hashes[p]), lend)
                if decode is None:
                    raise APIError(503, "No decode worker is ready; retry shortly.", code="no_workers",
                                   retry_after=2)  # fmt: skip
                req = worker_pb2.GenerateRequest(
                    request_id=base_id if len(plans) == 1 else f"{base_id}-{plan.index}",
                    prompt_token_ids=prompts[p],
                    params=sampling_params_to_proto(spec.sampling, max_tokens[p], plan.seed),
                    prefill_targets=self._prefill_targets(views, decode, matches[p]),
                    stream_interval=(
                        self.args.stream_interval if spec.stream else self.args.nonstreaming_interval
                    ),
                )
                self.pool.begin(decode.worker_id)
                self.metrics.routed(decode.role)
                state = ChoiceState(plan, self._echo(spec, p, prompts[p]), score_only=spec.score_only)
                choices.append(_Choice(state, req, decode, [decode], len(hashes[p]), matches[p]))
            if spec.stream:
                return await self._stream(request, spec, choices, builder, arrival)
            return await self._unary(request, choices, builder, [len(ids) for ids in prompts], arrival)
        finally:
            self.inflight -= len(plans)
            for c in choices:
                for d in c.used:
                    self.pool.end(d.worker_id)

    def _prefill_targets(
        self, views: list[WorkerView], decode: WorkerView, match: dict[str, int]
    ) -> list[worker_pb2.PrefillTarget]:
        """The prefill targets `decode` is offered, with what it prices them by."""
        return [
            worker_pb2.PrefillTarget(
                worker_id=w.worker_id,
                address=w.address,
                queued_prefill_tokens=w.queued_prefill_tokens,
                prefill_tokens_per_s=w.prefill_tokens_per_s,
                cached_tokens=match.get(w.worker_id, 0) * self.args.block_size,
            )  # fmt: skip
            for w in self._prefill_candidates(views, decode, match)
        ]

    def _prefill_candidates(self, views: list[WorkerView], decode: WorkerView, match: dict[str, int]):
        """Where `decode` may have its prompt prefilled: the prefill workers for a decode worker;
        for a colocated one, the workers holding a longer prefix of it (a pull it prices); none for
        a lent prefill worker, which prefills itself."""
        if decode.role == "decode":
            return rank_prefill(views, match, PREFILL_CANDIDATES)
        if decode.role == "both":
            return rank_holders(views, decode, match, PREFILL_CANDIDATES)
        return []

    def _echo(self, spec: GenerationSpec, prompt_index: int, ids: list[int]) -> Echo | None:
        if not spec.echo:
            return None
        prompt = spec.prompts[prompt_index]
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
        return Echo(text, ids[0])

    def _fit(self, spec: GenerationSpec, prompt_index: int, prompt_tokens: int) -> int:
        try:
            return fit_to_context(spec.sampling, prompt_tokens, self.args.max_model_len, spec.kind)
        except APIError as e:
            if spec.num_prompts > 1:
                e.message = f"prompt[{prompt_index}]: {e.message}"
            raise

    async def _start(self, req, decode, match, prompt_blocks: int, used: list):
        """Open the worker's stream and wait for its first message. A decode worker that turns out
        unreachable or draining before answering anything is replaced by another one: nothing was
        sent to the client yet, and whatever the dead worker held is reclaimed by its leases."""
        attempts = self.args.decode_attempts
        for attempt in range(attempts):
            call = self.pool.stub(decode.address).Generate(req, timeout=self.args.request_timeout)
            try:
                first = await call.__aiter__().__anext__()
            except StopAsyncIteration:
                raise APIError(
                    500, "the worker closed the stream without output", code="worker_error"
                ) from None
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._worker_error(decode, e) from e
                failure, why = self._worker_error(decode, e), e.details()
            except asyncio.CancelledError:
                call.cancel()
                asyncio.ensure_future(self._abort(decode, req.request_id))
                raise
            else:
                if first.error.code != "draining":
                    return decode, call, first
                # it began draining after the router last polled it: out of rotation, try another
                self.pool.mark_failed(decode.worker_id)
                failure, why = self._msg_error(first), "draining"
            taken = {u.worker_id for u in used}
            alt = choose_decode(
                [v for v in self.pool.views() if v.worker_id not in taken],
                match,
                prompt_blocks,
                Lending(self.args.prefill_overflow, len(req.prompt_token_ids), req.params.max_tokens),
            )
            if attempt + 1 == attempts or alt is None:
                raise failure
            log.warning("decode worker %s %s; retrying on %s", decode.worker_id, why, alt.worker_id)
            decode = alt
            used.append(alt)
            self.pool.begin(alt.worker_id)
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

    # ---- the generations of one request, run concurrently ----------------------------------------
    async def _run_choice(self, c: _Choice, events: asyncio.Queue) -> None:
        """Relay one generation's worker stream onto `events` as (choice, message); then
        (choice, None) when the stream ended, or (choice, APIError) when it failed. A stream whose
        worker dies, stops answering or hands it off mid-way moves to another decode worker and
        resumes there from the tokens already relayed (`_move`), at most `max_migrations` times."""
        try:
            c.decode, c.call, msg = await self._start(c.req, c.decode, c.match, c.prompt_blocks, c.used)
            while True:
                broke = await self._relay(c, msg, events)
                if broke is None:
                    return
                started = await self._move(c, broke, events)
                if started is None:
                    return
                msg = started
        except APIError as e:
            events.put_nowait((c, e))
        except grpc.aio.AioRpcError as e:
            events.put_nowait((c, self._worker_error(c.decode, e)))
        except asyncio.CancelledError:
            if c.call is not None:
                c.call.cancel()
                asyncio.ensure_future(self._abort(c.decode, c.req.request_id))
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # a sibling failed or the client left: the worker frees this generation's blocks
            # a call cancelled under us before any token: the generation still needs an answer
            self.pool.mark_failed(c.decode.worker_id)
            events.put_nowait((c, self._went_away(c)))

    def _went_away(self, c: _Choice) -> APIError:
        """The client's 503 when a generation's call was cancelled under it (the pool closed the
        channel of a worker that left the registry or stopped answering)."""
        return APIError(
            503, f"worker {c.decode.worker_id} went away", code="worker_unavailable", retry_after=1
        )

    async def _relay(self, c: _Choice, msg, events: asyncio.Queue) -> str | None:
        """Relay the current worker's messages from `msg` on. None when the stream is over (ended,
        or failed in a way another worker cannot fix); else why it broke, for `_move`: the worker's
        error code (a key of MOVABLE_ERRORS), or `unavailable` / `unresponsive` for a broken call."""
        it = c.call.__aiter__()
        finished = False  # its last message (finish reason, usage) is relayed: nothing to move
        try:
            while msg is not None:
                if msg.HasField("error"):
                    if msg.error.code in MOVABLE_ERRORS and c.migrations < self.args.max_migrations:
                        return msg.error.code
                    events.put_nowait((c, msg))
                    return None
                c.relayed(msg, self.clock(), self.metrics)
                events.put_nowait((c, msg))
                finished = finished or bool(msg.finish_reason)
                msg = await anext(it, None)
            events.put_nowait((c, None))
            return None
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                self.pool.mark_failed(c.decode.worker_id)
                if finished:  # it broke after the end was relayed: the generation is whole
                    events.put_nowait((c, None))
                    return None
                if c.migrations < self.args.max_migrations:
                    return "unavailable"
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # the call was cancelled under us: the generation still needs an answer
            self.pool.mark_failed(c.decode.worker_id)
            if finished:
                events.put_nowait((c, None))
                return None
            if c.migrations < self.args.max_migrations:
                return "unresponsive"
            raise self._went_away(c) from None

    async def _move(self, c: _Choice, broke: str, events: asyncio.Queue):
        """Re-place a stream broken for `broke` (what `_relay` said) on another decode worker,
        resuming from what was relayed; returns the new worker's first message, or None when the
        generation was finished here."""
        reason = MOVABLE_ERRORS.get(broke, broke)
        old = c.decode
        if c.call is not None:
            c.call.cancel()
        asyncio.ensure_future(self._abort(old, c.req.request_id))  # a frozen worker gets it later
        c.migrations += 1
        holder = None  # a worker that handed the stream off (draining) still holds its K/V
        if broke == "migrate" and worth_pulling(
            len(c.req.prompt_token_ids) + len(c.sent_ids), self.args.block_size
        ):
            holder = worker_pb2.PrefillTarget(worker_id=old.worker_id, address=old.address)
        req = resumed_request(c.req, c.original_id, c.migrations, c.sent_ids, c.sent_chars, holder)
        params = req.params
        done = (params.max_tokens and len(c.sent_ids) >= params.max_tokens) or (
            len(req.prompt_token_ids) + len(c.sent_ids) >= self.args.max_model_len
        )
        if done:  # the old worker sent the last token but not the end: nothing is left to generate
            events.put_nowait((c, finished_message(len(req.prompt_token_ids), len(c.sent_ids))))
            events.put_nowait((c, None))
            self.metrics.migrated(reason, "finished")
            return None
        taken = {u.worker_id for u in c.used}
        views = [v for v in self.pool.views() if v.worker_id not in taken]
        lend = Lending(self.args.prefill_overflow, len(req.prompt_token_ids), params.max_tokens)
        alt = choose_decode(views, c.match, c.prompt_blocks, lend)
        if alt is None:
            await self.pool.next_refresh(timeout=2 * self.pool.refresh_seconds + 1)
            views = [v for v in self.pool.views() if v.worker_id not in taken]
            alt = choose_decode(views, c.match, c.prompt_blocks, lend)
        if alt is None:
            self.metrics.migrated(reason, "failed")
            raise APIError(503, f"worker {old.worker_id} went away and no other decode worker can take its "
                           "stream", code="worker_unavailable", retry_after=1)  # fmt: skip
        log.warning("stream %s: worker %s %s; resuming it on %s after %d tokens",
                    c.original_id, old.worker_id, reason, alt.worker_id, len(c.sent_ids))  # fmt: skip
        if holder is None:  # prompt and outputs are prefilled where the usual placement says
            req.prefill_targets.extend(self._prefill_targets(views, alt, c.match))
        c.used.append(alt)
        self.pool.begin(alt.worker_id)
        c.req = req
        try:
            c.decode, c.call, first = await self._start(req, alt, c.match, c.prompt_blocks, c.used)
        except APIError:
            self.metrics.migrated(reason, "failed")
            raise
        c.moved(reason, self.clock())
        return first

    async def _stop_choices(self, tasks: list[asyncio.Task]) -> None:
        """Cancel the generations still running (each aborts on its worker) and count them."""
        live = [t for t in tasks if not t.done()]
        for t in live:
            t.cancel()
        await asyncio.gather(*live, return_exceptions=True)
        for _ in live:
            self.metrics.request_finished("abort")

    @staticmethod
    def _failure(item) -> APIError | None:
        if isinstance(item, APIError):
            return item
        if item is not None and item.HasField("error"):
            return Router._msg_error(item)
        return None

    def _record(
        self, arrival: float, state: ChoiceState, finish: str, first: float | None, end: float
    ) -> None:
        """One generation as its client saw it: TTFT (from arrival to `first`, its first byte
        written), each later token's gap, its tokens, and e2e (to `end`, its last byte written)."""
        if first is not None:
            self.metrics.ttft.observe(first - arrival)
        for gap in state.itl:
            self.metrics.itl.observe(gap)
        self.metrics.prompt_tokens.inc(state.prompt_tokens or 0)
        self.metrics.generation_tokens.inc(state.output_tokens)
        self.metrics.e2e.observe(end - arrival)
        self.metrics.request_finished(finish)

    async def _unary(
        self,
        request,
        choices: list[_Choice],
        builder: ResponseBuilder,
        prompt_lengths: list[int],
        arrival: float,
    ) -> web.Response:
        events: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(c, events)) for c in choices]
        try:
            pending = len(choices)
            while pending:
                c, item = await events.get()
                err = self._failure(item)
                if err is not None:
                    raise err
                if item is None:
                    pending -= 1
                else:
                    c.state.add(item, self.clock())
        finally:
            await self._stop_choices(tasks)
        states = [c.state for c in choices]
        body = builder.response(
            [
                builder.choice(
                    s.plan.index, s.response_text(), s.response_logprobs(), s.finish_reason or "stop"
                )
                for s in states
            ],
            total_usage(states, prompt_lengths),
        )
        resp = web.json_response(body, headers=self._served_headers(choices))
        await resp.prepare(request)
        await resp.write_eof()
        end = self.clock()
        for s in states:
            # a whole body has no first byte before its last: TTFT here is when the first token
            # reached the router, so that prefill scales on prefill time whatever the client asked
            self._record(arrival, s, s.finish_reason or "stop", s.first_token_at, end)
        return resp

    @staticmethod
    def _served_headers(choices: list[_Choice]) -> dict[str, str]:
        """The workers that served the request (comma-separated, in choice order, when several)."""
        decode = dict.fromkeys(c.decode.worker_id for c in choices)
        prefill = dict.fromkeys(c.state.prefill_worker for c in choices if c.state.prefill_worker)
        h = {"X-Disagg-Decode-Worker": ",".join(decode)}
        if prefill:
            h["X-Disagg-Prefill-Worker"] = ",".join(prefill)
        return h

    async def _stream(self, request, spec, choices: list[_Choice], builder: ResponseBuilder, arrival: float):
        events: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(c, events)) for c in choices]
        try:
            # Answer once every generation sent its first message, so that errors found before any
            # token (bad parameters on the worker, no prefill worker) still get a proper HTTP status.
            held: list = []
            started: set[int] = set()
            while len(started) < len(choices):
                c, item = await events.get()
                err = self._failure(item)
                if err is not None:
                    raise err
                started.add(c.state.plan.index)
                held.append((c, item))
            for c, item in held:
                if item is not None and item.HasField("served_by"):
                    c.state.prefill_worker = item.served_by.prefill_worker
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    **self._served_headers(choices),
                }  # fmt: skip
            )
            await resp.prepare(request)
            if start := builder.stream_start():
                await resp.write(start)
            pending = len(choices)
            error = None
            first_written: dict[int, float] = {}  # choice index -> when its first chunk was written
            while pending:
                c, item = held.pop(0) if held else await events.get()
                error = self._failure(item)
                if error is not None:
                    self._record(
                        arrival, c.state, "error", first_written.get(c.state.plan.index), self.clock()
                    )
                    break
                if item is None:
                    pending -= 1
                    continue
                delta = c.state.add(item, self.clock())
                # tokens whose text is held back (an incomplete UTF-8 character, a possible stop
                # string) produce no chunk unless their logprobs were asked for
                if delta.text or delta.finish_reason or (delta.logprobs and builder.want_logprobs):
                    usage = None
                    if spec.continuous_usage:  # this choice's usage so far, as vLLM sends it
                        s = c.state
                        usage = usage_body(s.prompt_tokens or len(c.req.prompt_token_ids), s.output_tokens,
                                           s.cached_tokens)  # fmt: skip
                    chunk = builder.stream_chunk(
                        delta.text, delta.logprobs, delta.finish_reason or None, spec.include_usage,
                        c.state.plan.index, usage,
                    )  # fmt: skip
                    await resp.write(chunk)
                    first_written.setdefault(c.state.plan.index, self.clock())
            if error is not None:
                await resp.write(builder.stream_error(error))
            else:
                usage = None
                if spec.include_usage:
                    lengths = [0] * spec.num_prompts
                    for c in choices:
                        lengths[c.state.plan.prompt_index] = len(c.req.prompt_token_ids)
                    usage = total_usage([c.state for c in choices], lengths)
                await resp.write(builder.stream_end(usage))
            await resp.write_eof()
            if error is None:
                end = self.clock()  # the last byte written: every generation's end, as the client saw it
                for c in choices:
                    s = c.state
                    self._record(arrival, s, s.finish_reason or "stop", first_written.get(s.plan.index), end)
            return resp
        finally:
            await self._stop_choices(tasks)
