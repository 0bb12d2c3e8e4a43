"""A prompt and its sampling parameters, checked and made into a `Request`: tokenized when it is
text, its token ids and length checked against the vocabulary and the context, its random stream
seeded, its grammar and detokenizer attached, and (a moved stream) the outputs it resumes from
applied. The output side is `output_processor.py`."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from disagg.worker.engine import resume as resumption
from disagg.worker.engine.request import Request
from disagg.worker.engine.resume import Resumption
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.seeds import PositionRng
from disagg.worker.engine.structured_output import Grammars
from disagg.worker.model.config import ModelConfig


class InputProcessor:
    def __init__(
        self, tokenizer, config: ModelConfig, max_model_len: int, device: torch.device, seed: int | None
    ):
        self.tokenizer = tokenizer  # None: prompts come as token ids only
        self.vocab_size = config.vocab_size
        self.max_model_len = max_model_len
        eos = set(config.eos_token_ids or ())
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)  # what ends a request, unless it ignores eos
        self.device = device
        self._seeds = random.Random(seed)  # seeds of sampled requests that name none
        self.grammars: Grammars | None = None  # the grammar compiler, built on first use

    def request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        prefill_only: bool = False,
        resume: Resumption | None = None,
    ) -> Request:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt is text but the engine was built without a tokenizer; pass token ids"
                )
            text = prompt
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                f"the prompt and at least one generated token must fit in the context"
            )
        rng = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seeds.randrange(2**63)
            rng = PositionRng(seed, self.device)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            prompt=text,
            prefill_only=prefill_only,
            eos_token_ids=self.eos_token_ids,
            rng=rng,
        )
        if params.structured_output is not None:
            req.grammar = self._grammars().matcher(params.structured_output)
        if self.tokenizer is not None:
            from disagg.worker.engine.detokenizer import IncrementalDetokenizer

            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens
            )
        if resume is not None:
            if prefill_only:
                raise ValueError("a prefill-only request cannot resume outputs")
            resumption.apply(req, resume, self.vocab_size, self.max_model_len)
        return req

    def _grammars(self) -> Grammars:
        """The grammar compiler, built on first use (it reads the whole vocabulary)."""
        if self.grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the engine's tokenizer")
            self.grammars = Grammars(
                self.tokenizer.backend.to_str(), self.vocab_size, sorted(self.eos_token_ids)
            )
        return self.grammars
