"""OpenAI request bodies -> a `GenerationSpec` (pure: no I/O, no tokenizer).

The shapes and bounds are the pydantic models of `protocol.py`; every refusal becomes an
`APIError(400)` naming the field, the way OpenAI's API does. A request may ask for several
choices: `n` samples of each of its prompts (completions take a batch of prompts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.structured_output_params import StructuredOutputParams, check
from disagg.worker.router import protocol, responses_protocol
from disagg.worker.router.errors import APIError, invalid
from disagg.worker.router.tools import ToolSpec, tool_spec


@dataclass
class GenerationSpec:
    kind: str  # "completion" | "chat"
    model: str
    sampling: SamplingParams  # the engine's own type: built here, sent as is (convert.py)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every chunk (with include_usage, as vLLM)
    n: int = 1  # samples per prompt
    prompts: list[str | list[int]] = field(default_factory=list)  # completion: texts or token ids
    messages: list[dict] | None = None  # chat, content flattened to text
    tools: ToolSpec | None = None  # chat: tools, tool_choice (or the legacy functions)
    echo: bool = False
    user: str | None = None
    score_only: bool = False  # max_tokens 0: only the prompt's logprobs are wanted

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.kind == "completion" else 1

    @property
    def num_choices(self) -> int:
        """Internal generations the request fans out to: one per (prompt, sample)."""
        return self.num_prompts * self.n


def request_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as OpenAI's 400 naming the field (`messages[0].role`)."""
    errors = exc.errors(include_url=False)
    # of a union's alternatives, the one that got furthest into the value says the most
    err = max(errors, key=lambda e: len(_field_path(e["loc"])))
    if err["type"] == "json_invalid":
        return invalid(None, f"the request body is not valid JSON: {err['msg']}", code="invalid_json")
    cause = (err.get("ctx") or {}).get("error")
    path = _field_path(err["loc"])
    if err["type"] == "extra_forbidden":  # the unknown field's own name is not among the known ones
        path = _field_path(err["loc"][:-1]) + [err["loc"][-1]]
    param = getattr(cause, "param", None) or _dotted(path) or None
    if err["type"] == "extra_forbidden":
        return invalid(param, f"'{param}' is not supported by this server")
    if err["type"] in ("model_type", "model_attributes_type") and not path:
        return invalid(None, "the request body must be a JSON object")
    if isinstance(cause, ValueError):
        message = str(cause)
    elif err["type"] in _BOUNDS:
        message = _BOUNDS[err["type"]].format(**err["ctx"]) if err.get("ctx") else err["msg"]
    else:
        message = err["msg"]
    if param and f"'{param}'" not in message and f"'{path[-1]}'" not in message:
        message = f"'{param}' {message}" if message.startswith("must") else f"'{param}': {message}"
    return invalid(param, message)


# pydantic's bound errors in the words the API has always used ("'n' must be >= 1, got 0")
_BOUNDS = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "too_short": "must not be empty",
}


_FIELDS = {
    name
    for model in (protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.ChatMessage,
                  protocol.TextPart, protocol.StreamOptions, protocol.ResponseFormat, protocol.JSONSchemaFormat,
                  protocol.Tool, protocol.FunctionDef, protocol.NamedToolChoice, protocol.FunctionName,
                  protocol.ToolCall, protocol.ToolCallFunction, *responses_protocol.MODELS)
    for name in model.model_fields
} | {"schema", "tokens", "add_special_tokens", "add_generation_prompt", "return_token_strs"}  # fmt: skip
# (the last four: /tokenize and /detokenize, tokenize_api.py)


def _field_path(loc: tuple) -> list:
    """The location without pydantic's names of union alternatives (`str`, `list[TextPart]`)."""
    return [part for part in loc if isinstance(part, int) or part in _FIELDS]


def _dotted(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        if isinstance(body, bytes | str):
            return model.model_validate_json(body)
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        return model.model_validate(body)
    except ValidationError as exc:
        raise request_error(exc) from None


def _sampling(req: protocol._Sampling, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's parameters from the request: the one place the router builds them (pydantic
    has checked every bound; the engine's own checks are the backstop, naming the field)."""
    try:
        return _engine_sampling(req, max_tokens, logprobs)
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise invalid(param, f"'{param}' {str(exc).split(' ', 1)[-1]}") from None


def _engine_sampling(req: protocol._Sampling, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        min_tokens=req.min_tokens,
        stop=list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_output=_structured_output(req),
    )


def _structured_output(req: protocol._Sampling) -> StructuredOutputParams | None:
    """The grammar a request asks for (at most one way), checked here so that an invalid schema or
    regex is a 400 naming its field rather than a worker error."""
    asked: list[tuple[str, StructuredOutputParams]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", StructuredOutputParams(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        schema = json.dumps(rf.json_schema.schema_)
        asked.append(("response_format.json_schema.schema", StructuredOutputParams(json=schema)))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except ValueError as e:
                raise invalid("guided_json", f"'guided_json' is not valid JSON: {e}") from None
        else:
            schema = json.dumps(schema)
        asked.append(("guided_json", StructuredOutputParams(json=schema)))
    if req.guided_regex is not None:
        asked.append(("guided_regex", StructuredOutputParams(regex=req.guided_regex)))
    if req.guided_choice is not None:
        asked.append(("guided_choice", StructuredOutputParams(choice=tuple(req.guided_choice))))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", StructuredOutputParams(grammar=req.guided_grammar)))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(f"'{name.split('.')[0]}'" for name, _ in asked)
        raise invalid(
            asked[1][0].split(".")[0], f"only one structured output constraint is allowed, got {names}"
        )
    param, so = asked[0]
    error = check(so)
    if error is not None:
        raise invalid(param, f"'{param}' is invalid: {error.strip()}")
    return so


def parse_completion(body: Any) -> GenerationSpec:
    """A completion request (raw JSON bytes, or the decoded object) -> its `GenerationSpec`."""
    req = _parse(protocol.CompletionRequest, body)
    # max_tokens 0 scores the prompt: a prefill always samples a token, which the response leaves out
    score_only = req.max_tokens == 0
    sampling = _sampling(req, 1 if score_only else req.max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None:
        sampling.prompt_logprobs = req.logprobs
    return GenerationSpec(
        kind="completion",
        model=req.model,
        sampling=sampling,
        score_only=score_only,
        stream=req.stream,
        **_usage_options(req.stream_options),
        n=req.n,
        prompts=req.prompt,
        echo=req.echo,
        user=req.user,
    )


def parse_chat(body: Any) -> GenerationSpec:
    """A chat request (raw JSON bytes, or the decoded object) -> its `GenerationSpec`."""
    req = _parse(protocol.ChatCompletionRequest, body)
    sampling = _sampling(req, req.max_output_tokens(), (req.top_logprobs or 0) if req.logprobs else None)
    tools = tool_spec(req)
    forced = tools.structured_output() if tools is not None else None
    if forced is not None:
        if sampling.structured_output is not None:
            raise invalid(
                "tool_choice", "a forced tool call cannot be combined with another structured output"
            )
        sampling.structured_output = forced
    return GenerationSpec(
        kind="chat",
        model=req.model,
        sampling=sampling,
        stream=req.stream,
        **_usage_options(req.stream_options),
        n=req.n,
        messages=[_message(m) for m in req.messages],
        tools=tools,
        user=req.user,
    )


def _usage_options(opts: protocol.StreamOptions | None) -> dict[str, bool]:
    include = bool(opts and opts.include_usage)
    return {"include_usage": include, "continuous_usage": include and opts.continuous_usage_stats}


def _message(m: protocol.ChatMessage) -> dict:
    """A chat message as the templates take it: content as text, earlier tool calls' arguments as
    objects (templates serialize them), the legacy function_call as a tool call."""
    out: dict = {"role": _ROLES.get(m.role, m.role), "content": m.text()}
    calls = list(m.tool_calls or [])
    if m.function_call is not None:
        calls.append(protocol.ToolCall(id="call_0", type="function", function=m.function_call))
    if calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c)},
            }
            for c in calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(call: protocol.ToolCall):
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments  # not JSON: the template gets the text


# OpenAI's `developer` messages are what chat templates call `system` (as OpenAI maps them for
# models without a developer role)
_ROLES = {"developer": "system", "function": "tool"}


def fit_to_context(sampling: SamplingParams, prompt_tokens: int, max_model_len: int, kind: str) -> int:
    """The max_tokens to use, or a 400 when prompt + max_tokens exceed the context."""
    param = "messages" if kind == "chat" else "prompt"
    if prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_tokens} tokens, which leaves no room for output.",
            param=param,
            code="context_length_exceeded",
        )
    if sampling.max_tokens is None:
        room = max_model_len - prompt_tokens
        if sampling.min_tokens > room:  # with max_tokens given, the model checked min_tokens against it
            raise invalid(
                "min_tokens",
                f"'min_tokens' ({sampling.min_tokens}) exceeds the {room} tokens the context leaves after "
                f"the {param}",
            )
        return room
    if prompt_tokens + sampling.max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + sampling.max_tokens} tokens ({prompt_tokens} in the {param}, "
            f"{sampling.max_tokens} in the completion). Please reduce the length of the {param} or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return sampling.max_tokens


def check_prompt_size(spec: GenerationSpec, max_bytes: int, max_model_len: int) -> None:
    """Refuse, before any tokenizing, a request whose prompt text adds up to more than `max_bytes`
    (the sum over its prompts, or its messages and tools: a batch of prompts each under the limit
    would otherwise cost their sum), or a token-id prompt that cannot fit the context."""
    if spec.kind == "chat":
        param = "messages"
        # the tools' schemas and earlier calls are rendered into the prompt too
        extra = [spec.tools.tools if spec.tools else None] + [m.get("tool_calls") for m in spec.messages]
        size = sum(len(m["content"].encode()) for m in spec.messages)
        size += sum(len(json.dumps(x).encode()) for x in extra if x)
    else:
        param = "prompt"
        size = sum(len(p.encode()) for p in spec.prompts if isinstance(p, str))
        for i, p in enumerate(spec.prompts):
            if isinstance(p, list) and len(p) >= max_model_len:
                where = f"prompt[{i}]" if spec.num_prompts > 1 else "prompt"
                raise APIError(
                    400,
                    f"This model's maximum context length is {max_model_len} tokens. However, {where} has "
                    f"{len(p)} tokens, which leaves no room for output.",
                    param=param,
                    code="context_length_exceeded",
                )
    if size > max_bytes:
        raise invalid(
            param,
            f"the {param} hold {size} bytes of text; this server accepts at most {max_bytes} per request",
            code="prompt_too_large",
        )


def check_choice_count(spec: GenerationSpec, max_choices: int) -> None:
    """A 400 when the request fans out to more generations than the router allows at once."""
    count = spec.num_choices
    if count <= max_choices:
        return
    if spec.n == 1 or spec.num_prompts > max_choices:
        raise invalid(
            "prompt",
            f"{spec.num_prompts} prompts exceed this server's limit of {max_choices} choices per request",
        )
    what = f"n={spec.n}" if spec.num_prompts == 1 else f"n={spec.n} x {spec.num_prompts} prompts = {count}"
    raise invalid("n", f"{what} exceeds this server's limit of {max_choices} choices per request")
