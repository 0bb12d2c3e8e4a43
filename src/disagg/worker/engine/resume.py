"""A generation continued from tokens another worker already produced (a migrated stream).

The request starts with those tokens as its outputs, exactly as a preempted request is
recomputed: prompt and outputs are prefilled together, then decoding goes on from the next
position. Every rule that counts outputs (max_tokens, min_tokens, penalties, the grammar's state,
the stop strings, the seeded draws of `seeds.py`) sees them as generated, and the text they make
is known: of it, `sent_chars` already reached the client, so only the rest is emitted (text held
back for a possible stop string is not lost).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.worker.engine.request import Request


@dataclass(frozen=True)
class Resumption:
    output_token_ids: tuple[int, ...]
    sent_chars: int = 0  # characters of the outputs' text the client has already received


def with_outputs(prompt: list[int], resume: Resumption | None) -> list[int]:
    """The tokens whose K/V a resumed request needs: its prompt, then the outputs it resumes."""
    return prompt if resume is None else prompt + list(resume.output_token_ids)


def apply(req: Request, resume: Resumption, vocab_size: int, max_model_len: int) -> None:
    """Give a new request the outputs it resumes from; raises ValueError naming what is wrong."""
    ids = resume.output_token_ids
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"resumed token id {bad} is outside the vocabulary [0, {vocab_size})")
    if req.num_prompt_tokens + len(ids) >= max_model_len:
        raise ValueError(
            f"prompt and resumed outputs are {req.num_prompt_tokens + len(ids)} tokens but max_model_len is "
            f"{max_model_len}: nothing is left to generate"
        )
    if req.params.max_tokens is not None and len(ids) >= req.params.max_tokens:
        raise ValueError(f"{len(ids)} resumed tokens already reach max_tokens ({req.params.max_tokens})")
    if resume.sent_chars < 0:
        raise ValueError(f"sent_chars must be >= 0, got {resume.sent_chars}")
    for token in ids:
        req.output_token_ids.append(token)
        if req.grammar is not None and not req.grammar.consume_token(token):
            raise ValueError(f"resumed token {token} is outside the request's grammar")
        if req.detokenizer is not None:
            req.text += req.detokenizer.add(token)
    if req.params.logprobs is not None:
        req.logprobs.extend([None] * len(ids))  # sent before; kept aligned with the outputs
    req.num_sent_tokens = len(ids)
    req.num_sent_chars = min(resume.sent_chars, len(req.text))
