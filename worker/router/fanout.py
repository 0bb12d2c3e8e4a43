"""One OpenAI request, many choices (pure): which generations a request fans out to, the state
each of them accumulates from its worker stream, and the usage of the whole response.

Every (prompt, sample) pair is its own generation with its own request id and routing. Choice
indices follow OpenAI: `prompt_index * n + sample_index` (chat has one prompt, so the sample
index). With a seed, sample i uses a seed derived from it, so the samples differ from each other
while the whole response stays reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.worker.router.openai_format import Logprob, usage_body
from disagg.worker.router.protocol import INT64_MAX, INT64_MIN


@dataclass(frozen=True)
class ChoicePlan:
    index: int
    prompt_index: int
    sample_index: int
    seed: int | None


def derive_seed(seed: int | None, sample_index: int) -> int | None:
    """The seed of sample `sample_index`: `seed + sample_index`, wrapped into the int64 range."""
    if seed is None:
        return None
    span = INT64_MAX - INT64_MIN + 1
    return (seed + sample_index - INT64_MIN) % span + INT64_MIN


def plan_choices(num_prompts: int, n: int, seed: int | None) -> list[ChoicePlan]:
    """The generations of a request, in choice-index order."""
    return [
        ChoicePlan(index=p * n + s, prompt_index=p, sample_index=s, seed=derive_seed(seed, s))
        for p in range(num_prompts)
        for s in range(n)
    ]


@dataclass
class ChoiceState:
    """What one generation's worker stream has delivered so far."""

    plan: ChoicePlan
    text: list[str] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str = ""
    num_tokens: int = 0
    first_token_at: float | None = None
    last_at: float | None = None
    prompt_tokens: int | None = None  # from the worker's final usage
    completion_tokens: int | None = None
    cached_tokens: int = 0
    prefill_worker: str = ""

    def add(self, msg, now: float) -> list[Logprob]:
        """Fold in one `GenerateResponse` (not an error); returns the logprobs it carried."""
        if msg.HasField("served_by"):
            self.prefill_worker = msg.served_by.prefill_worker
        if msg.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.last_at = now
        self.num_tokens += len(msg.token_ids)
        self.text.append(msg.text)
        lps = [Logprob(x.token_id, x.logprob, [(t.token_id, t.logprob) for t in x.top]) for x in msg.logprobs]
        self.logprobs.extend(lps)
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
        if msg.HasField("usage"):
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens
            self.cached_tokens = msg.usage.cached_tokens
        return lps

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.num_tokens


def total_usage(states: list[ChoiceState], prompt_lengths: list[int]) -> dict:
    """Usage of the whole response: each prompt counted once however many samples it had (as
    OpenAI does), the completion tokens of every choice summed."""
    prompt_tokens = cached = 0
    for p, length in enumerate(prompt_lengths):
        samples = sorted((s for s in states if s.plan.prompt_index == p), key=lambda s: s.plan.sample_index)
        reported = next((s for s in samples if s.prompt_tokens is not None), None)
        prompt_tokens += reported.prompt_tokens if reported else length
        cached += reported.cached_tokens if reported else 0
    completion = sum(s.output_tokens for s in states)
    return usage_body(prompt_tokens, completion, cached)
