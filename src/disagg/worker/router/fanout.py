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


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, repeated before its output (`echo`)."""

    text: str
    first_token_id: int  # has no logprob; the worker sends the prompt logprobs from the second on


@dataclass
class Delta:
    """What one worker message adds to a choice's response (echo included)."""

    text: str
    logprobs: list[Logprob]
    finish_reason: str


@dataclass
class ChoiceState:
    """What one generation's worker stream has delivered so far.

    `score_only` (max_tokens=0): the worker still samples one token, since a prefill always does;
    it is left out of the response and its usage, so only the prompt (with `echo`) is returned.
    """

    plan: ChoicePlan
    echo: Echo | None = None
    score_only: bool = False
    text: list[str] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # echo: the prompt's, first one null
    finish_reason: str = ""
    num_tokens: int = 0
    first_token_at: float | None = None
    last_at: float | None = None
    prompt_tokens: int | None = None  # from the worker's final usage
    completion_tokens: int | None = None
    cached_tokens: int = 0
    prefill_worker: str = ""
    itl: list[float] = field(default_factory=list)  # per output token after the first: its gap
    _echoed: bool = False
    _last_token_at: float = 0.0

    def add(self, msg, now: float) -> Delta:
        """Fold in one `GenerateResponse` (not an error); returns what it adds to the response."""
        if msg.HasField("served_by"):
            self.prefill_worker = msg.served_by.prefill_worker
        if msg.token_ids and self.first_token_at is None:
            self.first_token_at = now
        elif msg.token_ids:
            # tokens that arrive together share the gap since the previous ones
            k = len(msg.token_ids)
            self.itl.extend([(now - self._last_token_at) / k] * k)
        if msg.token_ids:
            self._last_token_at = now
        self.last_at = now
        self.num_tokens += len(msg.token_ids)
        lps = [_logprob(x) for x in msg.logprobs]
        text = msg.text
        if self.score_only:
            text, lps = "", []
        self.text.append(text)
        self.logprobs.extend(lps)
        if msg.finish_reason:
            self.finish_reason = "length" if self.score_only else msg.finish_reason
        if msg.HasField("usage"):
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = 0 if self.score_only else msg.usage.completion_tokens
            self.cached_tokens = msg.usage.cached_tokens
        if self.echo is not None and not self._echoed:
            self._echoed = True
            if msg.prompt_logprobs:
                first = Logprob(self.echo.first_token_id, None)
                self.prompt_logprobs = [first, *(_logprob(x) for x in msg.prompt_logprobs)]
            text, lps = self.echo.text + text, self.prompt_logprobs + lps
        return Delta(text, lps, self.finish_reason if msg.finish_reason else "")

    def response_text(self) -> str:
        return (self.echo.text if self.echo else "") + "".join(self.text)

    def response_logprobs(self) -> list[Logprob]:
        return self.prompt_logprobs + self.logprobs

    @property
    def output_tokens(self) -> int:
        if self.score_only:
            return 0
        return self.completion_tokens if self.completion_tokens is not None else self.num_tokens


def _logprob(x) -> Logprob:
    return Logprob(x.token_id, x.logprob, [(t.token_id, t.logprob) for t in x.top])


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
