"""The non-streamed response bodies the router sends, as pydantic models: the source of the
responses in `/openapi.json`, and what tests validate the builders' output against (extra fields
are forbidden, so a body that drifts from its documented shape fails)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared -------------------------------------------------------------------------------
class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    error: ErrorDetail


# ---- /v1/completions ----------------------------------------------------------------------
class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ---- /v1/chat/completions -----------------------------------------------------------------
class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # the legacy `functions` form


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]
    refusal: None


class ChatChoice(_Body):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "function_call"]


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# ---- /v1/responses ------------------------------------------------------------------------
class OutputText(_Body):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(_Body):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(_Body):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(_Body):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(_Body):
    reasoning_tokens: int


class ResponsesUsage(_Body):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(_Body):
    code: str
    message: str


class IncompleteDetails(_Body):
    reason: Literal["max_output_tokens"]


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class ResponseObject(_Body):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]]
    parallel_tool_calls: bool
    previous_response_id: None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponsesUsage | None
    user: str | None
    metadata: dict[str, str]


# ---- /v1/models ---------------------------------------------------------------------------
class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    # the weights' quantization the ready workers serve (none | int8 | fp8; several joined by ","
    # during a rollout that changes it); null while no worker is ready
    quantization: str | None = None


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]
