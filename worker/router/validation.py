"""Parse and validate OpenAI request bodies into a `GenerationSpec` (pure: no I/O, no tokenizer).

Every refusal is an `APIError(400)` naming the field, the way OpenAI's API does. A request may
ask for several choices: `n` samples of each of its prompts (completions take a batch of
prompts). Sampling
fields outside OpenAI's spec that vLLM users send (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, skip_special_tokens) are accepted too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from disagg.worker.router.errors import APIError, invalid

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the range of the seed on the wire
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class SamplingSpec:
    max_tokens: int | None  # None: as many as the context allows (chat default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per token; None = no logprobs at all
    skip_special_tokens: bool = True


@dataclass
class GenerationSpec:
    kind: str  # "completion" | "chat"
    model: str
    sampling: SamplingSpec
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # samples per prompt
    prompts: list[str | list[int]] = field(default_factory=list)  # completion: texts or token ids
    messages: list[dict] | None = None  # chat, content flattened to text
    echo: bool = False
    user: str | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.kind == "completion" else 1

    @property
    def num_choices(self) -> int:
        """Internal generations the request fans out to: one per (prompt, sample)."""
        return self.num_prompts * self.n


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise invalid(name, f"'{name}' must be a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise invalid(name, f"'{name}' must be in {left}{lo}, {hi}], got {v}")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid(name, f"'{name}' must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(name, f"'{name}' must be {bound}, got {v}")
    return v


def _boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {v!r}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}")
    if any(s == "" for s in stops):
        raise invalid("stop", "'stop' sequences must not be empty")
    return stops


def _token_id_list(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise invalid(name, f"'{name}' must be a list of non-negative integers")
    return v


def _samples(body: dict) -> int:
    n = _integer(body, "n", 1, 1)
    best_of = _integer(body, "best_of", None, 1)
    if best_of is not None and best_of < n:
        raise invalid("best_of", f"'best_of' ({best_of}) must be greater than or equal to n ({n})")
    if best_of is not None and best_of > n:
        # best_of > n means generating extra candidates and returning the n most likely ones
        raise invalid(
            "best_of",
            f"'best_of' greater than n is not supported (got best_of={best_of}, n={n}): "
            "ask for n samples instead",
        )
    return n


def _common(body: dict, kind: str) -> tuple[str, SamplingSpec, bool, bool, int]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' is required and must be a non-empty string")
    n = _samples(body)
    if body.get("logit_bias"):
        raise invalid("logit_bias", "'logit_bias' is not supported")
    if kind == "chat":
        max_tokens = _integer(body, "max_completion_tokens", None, 1)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None, 1)
    else:
        max_tokens = _integer(body, "max_tokens", 16, 1)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise invalid("seed", f"'seed' must be an integer, got {seed!r}")
    if seed is not None and not INT64_MIN <= seed <= INT64_MAX:
        raise invalid("seed", f"'seed' must fit in a signed 64-bit integer, got {seed}")
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", "'stream_options' must be an object")
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
        include_usage = _boolean(options, "include_usage", False)
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_integer(body, "top_k", -1, -1),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=seed,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        min_tokens=_integer(body, "min_tokens", 0, 0),
        stop=_stop(body),
        stop_token_ids=_token_id_list(body, "stop_token_ids"),
        ignore_eos=_boolean(body, "ignore_eos", False),
        skip_special_tokens=_boolean(body, "skip_special_tokens", True),
    )
    if sampling.top_k == 0:
        raise invalid("top_k", "'top_k' must be -1 (off) or >= 1, got 0")
    if max_tokens is not None and sampling.min_tokens > max_tokens:
        raise invalid(
            "min_tokens", f"'min_tokens' ({sampling.min_tokens}) must not exceed max_tokens ({max_tokens})"
        )
    return model, sampling, stream, include_usage, n


def _token_ids(where: str, ids: list) -> list[int]:
    if not ids:
        raise invalid("prompt", f"{where} must not be an empty list of token ids")
    if not all(_is_int(t) for t in ids):
        raise invalid("prompt", f"{where} must hold integers only (token ids), not a mix of types")
    if any(t < 0 for t in ids):
        raise invalid("prompt", f"token ids in {where} must be non-negative")
    return ids


def _completion_prompts(body: dict) -> list[str | list[int]]:
    """The prompts of a completion: a string, a list of token ids, or a batch of either kind."""
    p = body.get("prompt")
    if isinstance(p, str):
        if not p:
            raise invalid("prompt", "'prompt' must not be empty")
        return [p]
    if not isinstance(p, list):
        raise invalid("prompt", "'prompt' is required: a string, a list of token ids, or a list of either")
    if not p:
        raise invalid("prompt", "'prompt' must not be an empty list")
    if all(_is_int(t) for t in p):
        return [_token_ids("'prompt'", p)]
    if all(isinstance(x, str) for x in p):
        empty = next((i for i, x in enumerate(p) if not x), None)
        if empty is not None:
            raise invalid("prompt", f"'prompt[{empty}]' must not be empty")
        return list(p)
    if all(isinstance(x, list) for x in p):
        return [_token_ids(f"'prompt[{i}]'", x) for i, x in enumerate(p)]
    raise invalid(
        "prompt",
        "'prompt' must be a string, a list of token ids, a list of strings or a list of token-id lists; "
        "a list mixing these is not accepted",
    )


def parse_completion(body: Any) -> GenerationSpec:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model, sampling, stream, include_usage, n = _common(body, "completion")
    prompts = _completion_prompts(body)
    logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    sampling.logprobs = logprobs
    if body.get("suffix"):
        raise invalid("suffix", "'suffix' is not supported")
    return GenerationSpec(
        kind="completion",
        model=model,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        n=n,
        prompts=prompts,
        echo=_boolean(body, "echo", False),
        user=body.get("user") if isinstance(body.get("user"), str) else None,
    )


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"messages[{i}].content[{j}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"messages[{i}].content", "'content' must be a string or a list of text parts")


def parse_chat(body: Any) -> GenerationSpec:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model, sampling, stream, include_usage, n = _common(body, "chat")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "'messages' is required and must be a non-empty list")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "each message must be an object")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role", f"'role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}"
            )
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        messages.append({"role": role, "content": _message_text(i, content)})
    want = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    sampling.logprobs = (top or 0) if want else None
    return GenerationSpec(
        kind="chat",
        model=model,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        n=n,
        messages=messages,
        user=body.get("user") if isinstance(body.get("user"), str) else None,
    )


def fit_to_context(sampling: SamplingSpec, prompt_tokens: int, max_model_len: int, kind: str) -> int:
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
        return max_model_len - prompt_tokens
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
