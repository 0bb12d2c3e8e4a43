"""Request mixes and their arrival streams (open-loop Poisson), fixed by a seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Requests:
    arrival: np.ndarray  # seconds, ascending
    prompt: np.ndarray  # prompt tokens
    output: np.ndarray  # output tokens (the first one comes out of prefill)

    def __len__(self) -> int:
        return len(self.arrival)


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: tuple[int, int]  # uniform, inclusive
    output_tokens: tuple[int, int]
    description: str = ""

    def sample(self, n: int, rate: float, seed: int = 0) -> Requests:
        rng = np.random.default_rng(seed)
        arrival = np.cumsum(rng.exponential(1.0 / rate, n))
        prompt = rng.integers(self.prompt_tokens[0], self.prompt_tokens[1] + 1, n)
        output = rng.integers(self.output_tokens[0], self.output_tokens[1] + 1, n)
        return Requests(arrival, prompt, output)

    @property
    def longest_prompt(self) -> int:
        return self.prompt_tokens[1]

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt_tokens) / 2

    @property
    def mean_output(self) -> float:
        return sum(self.output_tokens) / 2


WORKLOADS = {
    "chat": Workload("chat", (64, 256), (128, 384), "short prompts, long answers (decode-heavy)"),
    "summarization": Workload(
        "summarization", (768, 1536), (16, 64), "long documents, short summaries (prefill-heavy)"
    ),
}
