"""Whether speculating pays, from measured step times: a verify step of n tokens costs what
`n` rows cost on this model and machine (measured once at start-up), against the plain decode step
of the same sequences. Where the forward pass is bound by memory bandwidth (a GPU, a model larger
than the caches) extra rows are nearly free and speculation wins; where it is bound by compute (a
tiny model on a CPU) every row costs almost a step, and the model says so: the step runs plain.

Expected tokens of a proposal of k at per-position acceptance a: 1 + a + a^2 + ... + a^k (the
last sampled token always counts). The speculator picks the k (shared by the step's sequences, cut
per sequence by its own budget) with the most tokens per second, if that beats plain decoding
by `MARGIN` (the verify step's extra bookkeeping is not in the measured forward times).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Sequence

import torch

from disagg.worker.engine.speculative import batches

MARGIN = 1.1


def expected_tokens(alpha: float, k: int) -> float:
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class StepCosts:
    """Seconds of a forward pass by number of rows, interpolated between measured sizes and
    extrapolated linearly beyond the largest."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float]):
        self.sizes = list(sizes)
        self.seconds = list(seconds)

    @classmethod
    def measure(cls, forward: Callable[[int], None], sizes: Sequence[int], repeats: int = 3) -> StepCosts:
        """`forward(n)` runs a step of n rows; each size is timed `repeats` times after one warm-up
        run, the fastest kept (the others paid for whatever else the machine did)."""
        seconds = []
        for n in sizes:
            forward(n)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                forward(n)
                best = min(best, time.perf_counter() - t)
            seconds.append(best)
        # a larger step never costs less (a timing that says so is noise)
        for i in range(1, len(seconds)):
            seconds[i] = max(seconds[i], seconds[i - 1])
        return cls(sizes, seconds)

    def __call__(self, rows: int) -> float:
        s, t = self.sizes, self.seconds
        i = bisect_left(s, rows)
        if i < len(s) and s[i] == rows:
            return t[i]
        if i == 0:
            return t[0]
        if i == len(s):
            slope = (t[-1] - t[-2]) / (s[-1] - s[-2]) if len(s) > 1 else t[-1] / s[-1]
            return t[-1] + slope * (rows - s[-1])
        w = (rows - s[i - 1]) / (s[i] - s[i - 1])
        return t[i - 1] + w * (t[i] - t[i - 1])


def choose_k(
    alphas: Sequence[float],
    budgets: Sequence[int],
    target: StepCosts,
    draft: StepCosts | None,
) -> int:
    """The shared proposal length with the most expected tokens per second, 0 when none beats a
    plain decode step by MARGIN. `draft`: the draft model's step costs (k steps per proposal)."""
    b = len(budgets)
    plain = b / target(b)
    best_k, best = 0, plain * MARGIN
    for k in range(1, max(budgets, default=0) + 1):
        ks = [min(k, kb) if a > 0 else 0 for a, kb in zip(alphas, budgets, strict=True)]
        rows = sum(ks) + b
        seconds = target(rows)
        if draft is not None:
            drafting = sum(1 for x in ks if x)
            seconds += k * draft(drafting)
        tokens = sum(expected_tokens(a, x) for a, x in zip(alphas, ks, strict=True))
        if tokens / seconds > best:
            best_k, best = k, tokens / seconds
    return best_k


# rows of the measured verify steps (more are extrapolated)
_COST_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)


def measure_costs(runner, block_size: int, num_blocks: int, max_rows: int) -> StepCosts | None:
    """Time decode-shaped steps of 1 .. max_rows rows over one sequence's context in `runner`'s
    still empty cache (what they write there is never read); None when the cache is too small to
    hold a context and one row."""
    capacity = num_blocks * block_size
    context = min(128, capacity // 2)
    sizes = [n for n in _COST_SIZES if n <= max(max_rows, 2) and context + n <= capacity]
    if context < 1 or len(sizes) < 2:
        return None
    blocks = list(range(-(-(context + sizes[-1]) // block_size)))

    def forward(n: int) -> None:
        logits = runner.forward(
            batches.rows([batches.Run([0] * n, context, blocks)], block_size, all_logits=True)
        )
        if logits.is_cuda:  # kernels run asynchronously: time them, not their launch
            torch.cuda.synchronize(logits.device)

    return StepCosts.measure(forward, sizes)
