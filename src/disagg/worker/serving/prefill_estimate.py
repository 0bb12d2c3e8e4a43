"""Running estimates that price a prefill: how fast this worker prefills, what a remote
prefill costs beyond the prefill itself (hops, handshake, KV transfer, commit), and what one of
its decode steps takes (the router weighs a prompt's compute against the decode steps it saves).

All are exponentially weighted so they follow a changing load but not one noisy step. Pure:
callers pass the measured tokens and seconds (and may pass the time).
"""

from __future__ import annotations

import time

# Weight of the newest observation. Prefill steps are long (tens to hundreds of ms), so 0.2
# settles within ~10 steps: fast enough to see a load change, slow enough to ignore one hiccup.
_ALPHA = 0.2


def _ewma(old: float | None, new: float, alpha: float = _ALPHA) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class PrefillRate:
    """Prompt tokens per second this worker's prefill steps reach (None until the first step).

    A rate is *fresh* when a step of served work measured it within `stale_after_s`. The warm-up's
    is provisional (it ran beside the other processes starting up; on a 2-core host one such seed
    made an idle decode worker look 10-20% slower than its prefill peer and send every prompt
    away), and a rate nobody refreshed for a while describes a load long gone: the next real
    measurement replaces either rather than averaging with it."""

    def __init__(self, min_tokens: int = 16, stale_after_s: float = 60.0):
        # a step of a handful of tokens measures per-step overhead, not throughput: skip it
        self.min_tokens = min_tokens
        self.stale_after_s = stale_after_s
        self.tokens_per_s: float | None = None
        self.provisional = False
        self.observed_at: float | None = None

    def observe(
        self, tokens: int, seconds: float, *, provisional: bool = False, now: float | None = None
    ) -> None:
        if tokens < self.min_tokens or seconds <= 0:
            return
        now = time.monotonic() if now is None else now
        restart = not provisional and not self.fresh(now)
        self.tokens_per_s = _ewma(None if restart else self.tokens_per_s, tokens / seconds)
        self.provisional = provisional
        self.observed_at = now

    def fresh(self, now: float | None = None) -> bool:
        """Measured by served work within `stale_after_s`."""
        if self.observed_at is None or self.provisional:
            return False
        now = time.monotonic() if now is None else now
        return now - self.observed_at <= self.stale_after_s


class RemoteCost:
    """What a remote prefill costs D on top of P's queueing and compute: a fixed part per
    request (RPCs, Redis record, commit) and a part per transferred token (the KV moving).

    Observed from finished remote prefills: D's wall time for the whole exchange, less the queue
    and compute time P reported, is the overhead; P's reported transfer time over the tokens
    sent is the per-token part. Until observed, `default_overhead_s` stands in (the transfer
    part then counts as zero, which favours trying the remote path once and measuring it).
    """

    def __init__(self, default_overhead_s: float = 0.01):
        self.overhead_s: float | None = None
        self.transfer_s_per_token: float | None = None
        self.default_overhead_s = default_overhead_s

    def observe(
        self, wall_s: float, queue_s: float, compute_s: float, transfer_s: float, tokens: int
    ) -> None:
        self.overhead_s = _ewma(self.overhead_s, max(wall_s - queue_s - compute_s - transfer_s, 0.0))
        if tokens > 0 and transfer_s >= 0:
            self.transfer_s_per_token = _ewma(self.transfer_s_per_token, transfer_s / tokens)

    def seconds(self, tokens: int) -> float:
        """The expected extra cost of prefilling `tokens` remotely."""
        fixed = self.default_overhead_s if self.overhead_s is None else self.overhead_s
        return fixed + tokens * (self.transfer_s_per_token or 0.0)


class DecodeStepTime:
    """Seconds of this worker's recent decode steps (moving average; None until one ran): at its
    current batch, what each token of a stream decoding here costs the worker."""

    def __init__(self):
        self.seconds: float | None = None

    def observe(self, seconds: float) -> None:
        if seconds > 0:
            self.seconds = _ewma(self.seconds, seconds)
