"""vLLM's `/tokenize` and `/detokenize` bodies (pure: the router's handlers do the tokenizing).

`/tokenize` takes a completion form (`prompt`) or a chat form (`messages`, rendered by the chat
template as a chat request's prompt is) and answers {count, max_model_len, tokens, token_strs};
`/detokenize` takes {tokens} and answers {prompt}. `model` is optional, as in vLLM.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from disagg.worker.router.protocol import ChatMessage, Text, Tool, _Strict
from disagg.worker.router.validation import _message, _parse

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1, strict=True)]


class TokenizeCompletion(_Strict):
    model: Text | None = None
    prompt: Text = Field(min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes the special tokens itself
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class Detokenize(_Strict):
    model: Text | None = None
    tokens: list[TokenId]


def parse_tokenize(body: bytes | Any) -> TokenizeCompletion | TokenizeChat:
    """The request in its form: chat when it has `messages`, completion otherwise."""
    chat = b'"messages"' in body if isinstance(body, bytes) else isinstance(body, dict) and "messages" in body
    return _parse(TokenizeChat if chat else TokenizeCompletion, body)


def parse_detokenize(body: bytes | Any) -> Detokenize:
    return _parse(Detokenize, body)


def chat_messages(req: TokenizeChat) -> list[dict]:
    """The messages as the chat template takes them (as a chat completion renders them)."""
    return [_message(m) for m in req.messages]


def tokenize_body(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}
