"""What the engine hands back: per-request outputs, vLLM-shaped."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str  # the whole text so far (stop strings removed)
    token_ids: list[int]  # every generated token so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefilled" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    `outputs[0]` holds everything generated so far; `new_token_ids` / `new_text` hold what
    this step added (what a streaming server sends).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    # when asked for: one per prompt token (None for the first, which has no context)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
