"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of every prompt token after the
tokens before it, and the top-k alternatives at each position, computed during prefill.

The logits at position p predict token p + 1, so a prefill chunk over positions [start, end)
yields the logprobs of prompt tokens start + 1 .. end (the last prompt position predicts the first
output token, which the sampler handles). Chunked prefill fills the list chunk by chunk; a request
recomputed after preemption skips the tokens it already has. The values are the model's raw
distribution (log_softmax of the logits, before penalties or temperature), as vLLM reports them
and as scoring harnesses expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagg.worker.engine.outputs import TokenLogprob
from disagg.worker.engine.request import Request
from disagg.worker.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class PromptSpan:
    """Positions [first, end) of chunk `chunk_index` whose logits give prompt logprobs."""

    chunk_index: int
    request: Request
    first: int
    end: int

    @property
    def num_rows(self) -> int:
        return self.end - self.first


def plan(out: SchedulerOutput) -> list[PromptSpan]:
    """The prompt positions of a prefill step whose logits are still missing."""
    if not out.is_prefill:
        return []
    spans = []
    for i, chunk in enumerate(out.chunks):
        req = chunk.request
        if not req.needs_prompt_logprobs:
            continue
        # the next missing token is len(req.prompt_logprobs), predicted one position before it
        first = max(chunk.start, len(req.prompt_logprobs) - 1)
        end = min(chunk.end, req.num_prompt_tokens - 1)
        if end > first:
            spans.append(PromptSpan(i, req, first, end))
    return spans


def record(logits: torch.Tensor, spans: list[PromptSpan]) -> None:
    """Append the logprobs of `spans` (their logits rows, in span order) to each request."""
    if not spans:
        return
    logprobs = logits.float().log_softmax(dim=-1)
    row = 0
    for span in spans:
        req = span.request
        rows = logprobs[row : row + span.num_rows]
        row += span.num_rows
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token has no context
        targets = torch.tensor(
            req.prompt_token_ids[span.first + 1 : span.end + 1], dtype=torch.long, device=rows.device
        )
        chosen = rows.gather(1, targets[:, None])[:, 0].tolist()
        k = req.params.prompt_logprobs
        top_ids = top_vals = None
        if k:
            top_vals, top_ids = rows.topk(k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, (tid, lp) in enumerate(zip(targets.tolist(), chosen, strict=True)):
            top = dict(zip(top_ids[j], top_vals[j], strict=True)) if k else {}
            req.prompt_logprobs.append(TokenLogprob(token_id=tid, logprob=lp, top_logprobs=top))
