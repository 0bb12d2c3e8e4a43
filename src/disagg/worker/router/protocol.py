"""The OpenAI request bodies the router accepts, as pydantic models (the shapes and bounds in one
place; `validation.py` turns a parsed request into a `GenerationSpec`).

Unknown fields are refused (400 naming the field), never dropped. Fields OpenAI defines that this
server does not act on are listed in `IGNORED_FIELDS` with the reason; everything else it does not
support is refused by name. Numbers are strict: a boolean is not a number and a string is not an
integer, but an integral float such as `1.0` is accepted where an integer is expected, as
OpenAI's API does.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_STOP_SEQUENCES = 4
# Lists every generated token or every request is checked against: bounded so that one request
# cannot make each step slow (OpenAI's own limit for tools; the body size bounds the rest).
MAX_TOOLS = 128
MAX_STOP_TOKEN_IDS = 1024
MAX_GUIDED_CHOICES = 1024
MAX_TOP_LOGPROBS = 20
# The ranges of integers on the wire (worker.proto): every count and token id travels as int32,
# the seed as int64. A value outside them is a 400 naming its field, not a crash building the message.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Accepted and deliberately not acted on (docs/usage.md lists them too). Every other field OpenAI
# defines is either acted on or refused with a 400 naming it.
IGNORED_FIELDS = {
    "user": "an end-user identifier for the caller's own abuse monitoring; not used",
    "safety_identifier": "as `user`: an identifier for the caller's abuse monitoring; not used",
    "messages[].name": "participant names are not rendered by the chat templates served here",
    "metadata": "tags for stored completions; nothing is stored here",
    "store": "only false (the default) is accepted: completions are never stored",
    "service_tier": "one tier only: every request is served alike",
    "prompt_cache_key": "prefix caching is automatic (block hashes), no key needed",
}


def _integer(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be an integer, got a boolean")
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if not isinstance(v, int):
        raise ValueError(f"must be an integer, got {v!r}")
    return v


def _number(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"must be a finite number, got {v!r}")
    return float(v)


def _text(v: Any) -> Any:
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return v


Int = Annotated[int, BeforeValidator(_integer), Field(ge=INT32_MIN, le=INT32_MAX)]
Int64 = Annotated[int, BeforeValidator(_integer), Field(ge=INT64_MIN, le=INT64_MAX)]
Number = Annotated[float, BeforeValidator(_number)]
Text = Annotated[str, BeforeValidator(_text)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (guidellm asks for it)
    continuous_usage_stats: bool = False


class JSONSchemaFormat(_Strict):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise _FieldError(
                "response_format.json_schema.schema",
                "'response_format' of type 'json_schema' needs its schema",
            )
        return self


class TextPart(_Strict):
    type: str
    text: Text

    @field_validator("type")
    @classmethod
    def _only_text(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"only text content parts are supported, got type {v!r}")
        return v


class FunctionDef(_Strict):
    """A function a model may call: chat nests it under `function`, /v1/responses inlines its fields."""

    name: Text = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the parameters schema is enforced when the call is forced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Strict):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: Text
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal[CHAT_ROLES]  # an enum in /openapi.json; `_known_role` words the refusal
    content: Text | list[TextPart] | None = None
    name: Text | None = None  # see IGNORED_FIELDS
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message's answer to that call
    function_call: ToolCallFunction | None = None  # legacy form of tool_calls

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"'role' must be one of {', '.join(CHAT_ROLES)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError("'content' is required for this role")
        if (self.tool_calls or self.function_call) and self.role != "assistant":
            raise ValueError("only assistant messages carry tool calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Sampling(_Strict):
    """Fields both endpoints share; the non-OpenAI ones are what vLLM users send."""

    model: Text = Field(min_length=1)
    n: Int = Field(1, ge=1)
    best_of: Int | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(-1, ge=-1)
    min_p: Number = Field(0.0, ge=0.0, le=1.0)
    seed: Int64 | None = None
    presence_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Number = Field(1.0, gt=0.0, le=2.0)
    min_tokens: Int = Field(0, ge=0)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None
    include_stop_str_in_output: bool = False  # vLLM's: keep the matched stop string in the text
    # structured output: OpenAI's response_format, or one of vLLM's guided_* extras
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_GUIDED_CHOICES)
    guided_grammar: Text | None = None
    user: Text | None = None  # see IGNORED_FIELDS

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("'top_k' must be -1 (off) or >= 1, got 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}")
        if stops is not None and any(s == "" for s in stops):
            raise ValueError("'stop' sequences must not be empty")
        return stops

    @field_validator("logit_bias", "suffix", check_fields=False)
    @classmethod
    def _unsupported_when_set(cls, v, info: ValidationInfo):
        if v:
            raise ValueError(f"'{info.field_name}' is not supported")
        return v

    @model_validator(mode="after")
    def _cross_field(self):
        if self.best_of is not None and self.best_of < self.n:
            raise _FieldError(
                "best_of", f"'best_of' ({self.best_of}) must be greater than or equal to n ({self.n})"
            )
        if self.best_of is not None and self.best_of > self.n:
            # best_of > n means generating extra candidates and returning the n most likely ones
            raise _FieldError(
                "best_of",
                f"'best_of' greater than n is not supported (got best_of={self.best_of}, n={self.n}): "
                "ask for n samples instead",
            )
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "'stream_options' is only allowed when 'stream' is true")
        limit = self.max_output_tokens()
        if limit is not None and self.min_tokens > limit:
            raise _FieldError(
                "min_tokens", f"'min_tokens' ({self.min_tokens}) must not exceed max_tokens ({limit})"
            )
        return self

    def max_output_tokens(self) -> int | None:
        """The request's output limit (each endpoint names its own field); None: no limit given."""
        return None


# The prompt forms `completion_prompts` accepts, as /openapi.json documents them.
_TOKEN_IDS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
}
_TEXT = {"type": "string", "minLength": 1}
PROMPT_SCHEMA = {
    "anyOf": [_TEXT, _TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TEXT},
              {"type": "array", "minItems": 1, "items": _TOKEN_IDS}],
    "description": "a string, a list of token ids, or a batch (list) of either kind",
}  # fmt: skip


class CompletionRequest(_Sampling):
    prompt: Any = Field(json_schema_extra=PROMPT_SCHEMA)
    max_tokens: Int = Field(16, ge=0)  # 0: score the prompt only (with echo and logprobs)
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, p):
        return completion_prompts(p)

    def max_output_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = Field(None, max_length=MAX_TOOLS)  # legacy tools
    function_call: Literal["none", "auto"] | FunctionName | None = None  # legacy tool_choice
    # see IGNORED_FIELDS
    safety_identifier: Text | None = None
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: Text | None = None

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v):
        if v:
            raise ValueError("'store' is not supported: this server does not store completions")
        return v

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _FieldError("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        return self

    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class _FieldError(ValueError):
    """A cross-field check's refusal, with the field it names (pydantic would name the model)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_ids(where: str, ids: list) -> list[int]:
    if not ids:
        raise ValueError(f"{where} must not be an empty list of token ids")
    if not all(_is_int(t) for t in ids):
        raise ValueError(f"{where} must hold integers only (token ids), not a mix of types")
    if any(t < 0 for t in ids):
        raise ValueError(f"token ids in {where} must be non-negative")
    if any(t > INT32_MAX for t in ids):
        raise ValueError(f"token ids in {where} must be <= {INT32_MAX}")
    return ids


def completion_prompts(p: Any) -> list[str | list[int]]:
    """The prompts of a completion: a string, a list of token ids, or a batch of either kind."""
    if isinstance(p, str):
        if not p:
            raise ValueError("'prompt' must not be empty")
        return [_text(p)]
    if not isinstance(p, list):
        raise ValueError("'prompt' is required: a string, a list of token ids, or a list of either")
    if not p:
        raise ValueError("'prompt' must not be an empty list")
    if all(_is_int(t) for t in p):
        return [_token_ids("'prompt'", p)]
    if all(isinstance(x, str) for x in p):
        empty = next((i for i, x in enumerate(p) if not x), None)
        if empty is not None:
            raise ValueError(f"'prompt[{empty}]' must not be empty")
        return [_text(x) for x in p]
    if all(isinstance(x, list) for x in p):
        return [_token_ids(f"'prompt[{i}]'", x) for i, x in enumerate(p)]
    raise ValueError(
        "'prompt' must be a string, a list of token ids, a list of strings or a list of token-id lists; "
        "a list mixing these is not accepted"
    )
