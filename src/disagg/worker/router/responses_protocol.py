"""The request body of OpenAI's Responses API (`POST /v1/responses`) as pydantic models: text
input and output, function tools, structured output through `text.format`.

As with the other endpoints, unknown fields are refused by name. Fields the Responses API defines
that need state this server does not keep (`previous_response_id`, `conversation`, `background`,
stored responses) or capabilities it lacks (`reasoning`, `include`, built-in tools) are accepted
only at their "off" value and refused by name otherwise; `RESPONSES_IGNORED_FIELDS` lists what is
accepted and not acted on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from disagg.worker.router.protocol import MAX_TOOLS, FunctionDef, Int, Number, Text, _FieldError, _Strict

RESPONSES_IGNORED_FIELDS = {
    "user": "an end-user identifier for the caller's own abuse monitoring; not used",
    "safety_identifier": "as `user`: an identifier for the caller's abuse monitoring; not used",
    "metadata": "tags for stored responses; nothing is stored here",
    "store": "only false is accepted: responses are never stored (OpenAI's default is true)",
    "service_tier": "one tier only: every request is served alike",
    "prompt_cache_key": "prefix caching is automatic (block hashes), no key needed",
    "truncation": "only 'disabled' (the default): a prompt over the context is refused, never cut",
    "input[].id, input[].status": "ids and statuses of earlier output items sent back as input",
    "text.verbosity": "only 'medium' (the default): the output is what the model writes",
}

# Item types of `input` this server maps onto chat messages; others are refused by name.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
INPUT_ROLES = ("user", "assistant", "system", "developer")
BUILT_IN_TOOLS = "web_search, file_search, computer_use, code_interpreter, image_generation, mcp"


class InputText(_Strict):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back
    text: Text
    annotations: list[Any] | None = None  # of output_text; nothing to annotate here
    logprobs: list[Any] | None = None  # of output_text sent back; not used


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A function call the model made earlier, sent back with its output."""

    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    arguments: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_tag(v: Any) -> str | None:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return _TAGS.get(kind) if isinstance(kind, str) else None


_TAGS = {"message": "MessageItem", "function_call": "FunctionCallItem",
         "function_call_output": "FunctionCallOutputItem"}  # fmt: skip
# the item's `type` picks its model, so a refusal names the fields of that kind of item only
InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
    # pydantic's own message would name this module's function
    Discriminator(
        _item_tag,
        custom_error_type="input_item",
        custom_error_message="each input item must be an object with a 'type' (message, function_call "
        "or function_call_output)",
    ),
]


class FunctionTool(FunctionDef):
    type: Literal["function"]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: Text


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(None, min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise _FieldError("text.format", "'text.format' of type 'json_schema' needs 'name' and 'schema'")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # see RESPONSES_IGNORED_FIELDS


class ResponsesRequest(_Strict):
    model: Text = Field(min_length=1)
    input: Annotated[Text, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    # see RESPONSES_IGNORED_FIELDS
    user: Text | None = None
    safety_identifier: Text | None = None
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: Text | None = None
    truncation: Literal["disabled"] | None = None
    # refused unless off: they need state or capabilities this server does not have
    previous_response_id: Text | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[Text] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: Int | None = None
    top_logprobs: Int | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("'input' must not be empty")
        if isinstance(v, list):
            if not v:
                raise ValueError("'input' must not be an empty list")
            for i, item in enumerate(v):
                kind = item.get("type", "message") if isinstance(item, dict) else None
                if isinstance(item, dict) and not isinstance(kind, str):
                    raise _FieldError(f"input[{i}].type", f"'input[{i}].type' must be a string")
                if isinstance(kind, str) and kind not in INPUT_ITEM_TYPES:
                    raise _FieldError(
                        f"input[{i}].type",
                        f"input items of type {kind!r} are not supported; "
                        f"supported: {', '.join(INPUT_ITEM_TYPES)}",
                    )
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v):
        for i, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise _FieldError(
                    f"tools[{i}].type",
                    f"built-in tools ({kind!r}) are not supported: only 'function' tools "
                    f"(not {BUILT_IN_TOOLS})",
                )
        return v

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v):
        if v:
            raise ValueError("'store' must be false: this server does not store responses")
        return v

    @field_validator(
        "previous_response_id", "conversation", "background", "reasoning", "include", "prompt",
        "max_tool_calls", "top_logprobs", "stream_options",
    )  # fmt: skip
    @classmethod
    def _refused_when_set(cls, v, info: ValidationInfo):
        if v:
            raise ValueError(f"'{info.field_name}' is not supported by this server")
        return v


# every model of the request: validation names a refused field by these models' field names
MODELS = (ResponsesRequest, MessageItem, InputText, FunctionCallItem, FunctionCallOutputItem, FunctionTool,
          NamedFunction, TextConfig, TextFormat)  # fmt: skip
