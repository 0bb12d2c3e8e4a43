"""The generation endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/responses`, and
SageMaker's `/invocations`, which takes any of their bodies.

Per request: authenticate, validate, admit (`admission.py`), tokenize (`prompt_tokens.py`), hash
the prompts per block and look them up in the Redis prefix index; then fan out to one generation
per (prompt, sample) (`fanout.py`), each placed on its own decode worker with ranked prefill
candidates (`placement.py`) and run there (`generation.py`), their events written as SSE chunks
or one JSON body (`response_writers.py`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import Callable

from aiohttp import web

from disagg.proto import worker_pb2
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.router.admission import Admission
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.body import read_body
from disagg.worker.router.client_checks import check_api_key, unknown_model
from disagg.worker.router.errors import APIError, invalid
from disagg.worker.router.fanout import ChoiceState, plan_choices
from disagg.worker.router.generation import Generation
from disagg.worker.router.openai_format import ResponseBuilder
from disagg.worker.router.placement import Placement
from disagg.worker.router.prompt_tokens import PromptTokenizer
from disagg.worker.router.response_writers import ResponseWriter
from disagg.worker.router.responses_format import ResponsesBuilder
from disagg.worker.router.responses_request import parse_responses
from disagg.worker.router.tools import ToolCalls
from disagg.worker.router.validation import (
    GenerationSpec,
    check_choice_count,
    check_prompt_size,
    fit_to_context,
    parse_chat,
    parse_completion,
)
from disagg.worker.serving.convert import sampling_params_to_proto
from disagg.worker.serving.metrics import ServingMetrics

# Headers every response to the request carries (its X-Request-Id), set once it has an id.
ECHO_HEADERS = web.RequestKey("echo_headers", dict)
# When the request arrived (the app's outermost middleware): its latency is measured from here,
# before its body is read or parsed, to the first and last byte written, as its client sees it.
ARRIVAL = web.RequestKey("arrival", float)


class GenerateEndpoints:
    def __init__(
        self,
        args: RouterArgs,
        model_name: str,
        api_keys: frozenset[str],
        prompts: PromptTokenizer,
        admission: Admission,
        placement: Placement,
        metrics: ServingMetrics,
        clock: Callable[[], float],
    ):
        self.args = args
        self.model_name = model_name
        self.api_keys = api_keys
        self.max_choices = args.resolved_max_choices()
        self.prompts = prompts
        self.admission = admission
        self.placement = placement
        self.metrics = metrics
        self.clock = clock
        self.writer = ResponseWriter(metrics, clock, args.client_write_timeout)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_responses, ResponsesBuilder)

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's inference route, as vLLM serves it: the body's shape picks the API (`messages`:
        chat, `prompt`: completion, `input`: responses), with that API's validation and answer."""
        check_api_key(request, self.api_keys)
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
        check_api_key(request, self.api_keys)
        if body is None:  # JSON decoding and validation in one pass (protocol.py)
            spec = parse(await read_body(request, self.args.max_body_bytes))
        else:
            spec = parse(body)
        if spec.model != self.model_name:
            raise unknown_model(spec.model)
        check_choice_count(spec, self.max_choices)
        check_prompt_size(spec, self.args.max_prompt_bytes, self.args.max_model_len)
        seed = spec.sampling.seed
        if seed is None and not spec.sampling.greedy:
            # every sampled generation carries a seed: a stream moved to another worker goes on
            # drawing from its own random numbers (seeds.py)
            seed = secrets.randbits(63)
        plans = plan_choices(spec.num_prompts, spec.n, seed)
        generations: list[Generation] = []
        with self.admission.admit(len(plans)) as slots:
            try:
                prompts = await self.prompts.tokenize_all(spec)
                max_tokens = [self._fit(spec, i, len(ids)) for i, ids in enumerate(prompts)]
                hashes = [block_hashes(ids, self.args.block_size) for ids in prompts]
                matches = await asyncio.gather(*(self.placement.prefix_match(h) for h in hashes))
                # Our own id for the workers and Redis: a client's X-Request-Id is only echoed back,
                # so one client cannot name (and abort) another's generation.
                base_id = uuid.uuid4().hex
                client_id = request.headers.get("X-Request-Id")
                request[ECHO_HEADERS] = {"X-Request-Id": client_id or base_id}
                tools = ToolCalls(spec.tools, self.args.tool_call_parser) if spec.tools is not None else None
                builder = builder_cls.for_spec(spec, self.prompts.token_text, tools)
                for plan in plans:
                    # one routing decision per generation; each one counted in flight on its worker
                    # weighs on the next choice
                    p = plan.prompt_index
                    lend = self.placement.lending(len(prompts[p]), max_tokens[p])
                    views, decode = await self.placement.choose_or_wait(matches[p], len(hashes[p]), lend)
                    if decode is None:
                        raise APIError(503, "No decode worker is ready; retry shortly.", code="no_workers",
                                       retry_after=2)  # fmt: skip
                    req = worker_pb2.GenerateRequest(
                        request_id=base_id if len(plans) == 1 else f"{base_id}-{plan.index}",
                        prompt_token_ids=prompts[p],
                        params=sampling_params_to_proto(spec.sampling, max_tokens[p], plan.seed),
                        prefill_targets=self.placement.prefill_targets(views, decode, matches[p]),
                        stream_interval=(
                            self.args.stream_interval if spec.stream else self.args.nonstreaming_interval
                        ),
                    )
                    self.metrics.routed(decode.role)
                    echo = self.prompts.echo(spec, p, prompts[p])
                    state = ChoiceState(plan, echo, score_only=spec.score_only)
                    generation = Generation(
                        state,
                        req,
                        decode,
                        len(hashes[p]),
                        matches[p],
                        placement=self.placement,
                        metrics=self.metrics,
                        clock=self.clock,
                    )
                    generations.append(generation)
                if spec.stream:
                    return await self.writer.stream(request, spec, generations, builder, arrival, slots)
                lengths = [len(ids) for ids in prompts]
                return await self.writer.whole(request, generations, builder, lengths, arrival, slots)
            finally:
                for g in generations:
                    g.release()

    def _fit(self, spec: GenerationSpec, prompt_index: int, prompt_tokens: int) -> int:
        """The prompt's max_tokens within the context (a batch's error names its prompt)."""
        try:
            return fit_to_context(spec.sampling, prompt_tokens, self.args.max_model_len, spec.kind)
        except APIError as e:
            if spec.num_prompts > 1:
                e.message = f"prompt[{prompt_index}]: {e.message}"
            raise
