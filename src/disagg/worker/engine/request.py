"""One request's state as it moves through the engine.

Tokens: `prompt_token_ids + output_token_ids` is the sequence; `num_computed_tokens` of it
have their K/V in the cache. A step computes some of the rest; when it reaches the end of
the sequence a new token is sampled. Preemption drops the cache (num_computed_tokens = 0)
and the request later recomputes prompt and outputs together, as one longer prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from disagg.worker.engine.block_hash import hash_block
from disagg.worker.engine.outputs import TokenLogprob
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.seeds import PositionRng


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its cache dropped
    RESERVED = "reserved"  # blocks held for KV that another worker writes
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_PREFILLED = "prefilled"  # prefill-only request done; its blocks stay pinned

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "prefilled")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival: int = 0  # admission order; larger is newer
    prefill_only: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    rng: PositionRng | None = None  # sampled (not greedy) requests: draws keyed by output position
    grammar: object | None = None  # the structured output matcher (llguidance), fed every output token

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # one entry per prompt token once prefilled (None for the first), when params ask for them
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks of the sequence
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # output text bookkeeping (owned by the engine)
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    detokenizer: object | None = None  # IncrementalDetokenizer when the engine has a tokenizer
    extra_key: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still missing."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Extend `block_hashes` to cover every full block of the sequence; returns it."""
        n_full = self.num_tokens // block_size
        if len(self.block_hashes) < n_full:
            tokens = self.all_token_ids
            parent = self.block_hashes[-1] if self.block_hashes else None
            for i in range(len(self.block_hashes), n_full):
                parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], self.extra_key)
                self.block_hashes.append(parent)
        return self.block_hashes
