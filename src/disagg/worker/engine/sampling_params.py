"""Sampling parameters, named and defaulted as in vLLM, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.worker.engine.structured_output_params import StructuredOutputParams

_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k, as in the API and on the wire (0 is taken as -1, as vLLM does)
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: chosen only)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (0: the prompt token only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutputParams | None = None  # a grammar the output must match
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        # near-zero temperatures sample like greedy; treat them as greedy to avoid inf/nan
        if self.temperature < _EPS:
            self.temperature = 0.0

    def _validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool)

        need(is_int(self.n) and self.n == 1, "n", "1 (one completion per request)")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature", ">= 0")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k", "-1 (off) or >= 1")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(self.seed is None or is_int(self.seed), "seed", "an integer or None")
        need(
            is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "in [-2, 2]",
        )
        need(
            is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "in [-2, 2]",
        )
        need(is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "> 0")
        need(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            ">= 1",
        )
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", ">= 0")
        if self.max_tokens is not None and is_int(self.min_tokens) and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        stop_ok = (
            self.stop is None
            or (isinstance(self.stop, str) and self.stop != "")
            or (isinstance(self.stop, list | tuple) and all(isinstance(s, str) and s for s in self.stop))
        )
        need(stop_ok, "stop", "a non-empty string or a list of non-empty strings")
        ids_ok = self.stop_token_ids is None or (
            isinstance(self.stop_token_ids, list | tuple)
            and all(is_int(t) and t >= 0 for t in self.stop_token_ids)
        )
        need(ids_ok, "stop_token_ids", "a list of non-negative token ids")
        need(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "in [0, 20]",
        )
        need(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutputParams),
            "structured_output",
            "None or a StructuredOutputParams",
        )
        need(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs",
            "in [0, 20]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop_strings), default=0)
