"""Structured output: a grammar (JSON schema, any JSON object, regex, a choice of strings, or a
Lark/GBNF grammar) that constrains sampling through a token bitmask, with llguidance.

Each constrained request carries a matcher that follows the tokens it generates. Before a sampling
step the masks of all constrained rows are computed in one parallel call (`fill_bitmasks`) and
applied to the logits (`apply_bitmask`); the engine feeds every appended token back to the matcher.
A grammar is compiled once per distinct spec (LRU cache) and each request gets a copy of it.
What a request asks for is a `StructuredOutputParams` (`structured_output_params.py`).
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance
import torch

from disagg.worker.engine.structured_output_params import StructuredOutputParams


class Grammars:
    """The engine's grammar compiler: one tokenizer view and a cache of compiled grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputParams, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, params: StructuredOutputParams) -> llguidance.LLMatcher:
        """A fresh matcher for `params` (raises ValueError naming the problem)."""
        compiled = self._cache.get(params)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, params.grammar_text(), log_level=0)
            if compiled.is_error():
                raise ValueError(f"invalid structured output grammar: {compiled.get_error()}")
            self._cache[params] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(params)
        return compiled.deep_copy()


_executor: llguidance.LLExecutor | None = None


def fill_bitmasks(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """The allowed next tokens of each matcher, one bit per token: [len(matchers), ceil(V / 32)]."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    _executor.unsafe_compute_mask_ptr(
        [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(matchers)
    )
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set the logits of tokens a row's grammar forbids to -inf, in place."""
    vocab = logits.shape[-1]
    allowed = ((bitmask.to(logits.device)[:, :, None] >> _BITS.to(logits.device)) & 1).bool()
    allowed = allowed.reshape(len(rows), -1)[:, :vocab]
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
