"""When a decode worker sends a prompt to a prefill worker rather than prefilling it itself (pure)."""

from __future__ import annotations


def should_disaggregate(prompt_tokens: int, cached_tokens: int, threshold: int, have_prefill: bool) -> bool:
    """Prefill remotely only when the uncached part of the prompt is long enough to pay for the trip.

    Short prompts cost D less to prefill itself than a round trip plus a KV transfer costs.
    """
    if not have_prefill:
        return False
    return prompt_tokens - cached_tokens >= threshold
