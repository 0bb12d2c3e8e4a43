"""The speculative decoding settings of an engine, read from its `EngineArgs`."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.worker.engine.args import EngineArgs


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft"
    num_tokens: int  # proposals per sequence per step (k)
    draft_model: str | None
    ngram_min: int
    ngram_max: int
    max_batch: int  # larger decode steps run without speculation
    min_acceptance: float
    adaptive: bool = True  # speculate only as far as measured step costs say it pays

    @classmethod
    def from_args(cls, args: EngineArgs) -> SpeculativeConfig | None:
        """None when speculation is off."""
        if args.speculative_method is None:
            return None
        return cls(
            method=args.speculative_method,
            num_tokens=args.num_speculative_tokens,
            draft_model=args.speculative_draft_model,
            ngram_min=args.speculative_ngram_min,
            ngram_max=args.speculative_ngram_max,
            max_batch=args.speculative_max_batch,
            min_acceptance=args.speculative_min_acceptance,
            adaptive=args.speculative_adaptive,
        )
