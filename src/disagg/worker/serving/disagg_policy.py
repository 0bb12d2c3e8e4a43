"""Where a decode worker prefills a prompt: itself, or on a prefill worker (pure).

The price of each site is the time until the first token could be sampled there:

  local  = (prompt tokens already queued on D + the prompt's tokens D holds no K/V for) / D's rate
  remote = (tokens queued on P + the prompt's tokens P holds no K/V for) / P's rate
           + transfer of the tokens D lacks + hop overhead

Each side's cached prefix (its prefix cache and the KV tiers below it) is what it skips: a prefill
worker that holds a longer prefix than D (the router's prefix index says how long) is priced for
the shorter suffix it computes, so a prompt whose history lives on P is pulled from there rather
than recomputed on D when the transfer costs less than the compute it saves.

An idle D (nothing decoding) prefills itself, as a colocated worker would, unless the remote site
is clearly cheaper (by more than `IDLE_REMOTE_MARGIN`: a faster or less-loaded prefill pool), so
at low load a disaggregated deployment never loses TTFT to a colocated one. The margin is there
because the two rates are measured apart, each a few percent off: on equal hardware the estimates
sat within 1-3% of each other and their noise alone sent 8 of 8 prompts remote in one run of
bench/ttft_breakdown.py (small preset, 2 cores), 10% slower than colocated (the same prompt's
compute drifts by 3-6% between deployments started minutes apart). Nor does an idle D trust a
local rate that is not fresh (only the warm-up's, or none refreshed for a minute:
`PrefillRate.fresh`): a D that sends every prompt away never measures itself again, so one slow
measurement would keep it looking slower for good. It prefills that prompt itself
("idle_remeasure"), which costs at most what a colocated worker pays.

A D that is decoding has something to protect: a local prefill stalls every running stream's
next tokens for as long as it computes. Then the remote site wins unless it would delay the first
token by more than `busy_slack` times the local price. Short prompts (under `threshold` uncached
tokens) always stay local: their prefill costs less than the trip. A rate nobody measured yet
falls back to the other side's (same hardware), and with neither measured, long prompts go remote
as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from disagg.worker.serving.args import ServingArgs

# An idle D goes remote only when that is cheaper than local by more than this fraction.
IDLE_REMOTE_MARGIN = 0.1


@dataclass(frozen=True)
class PrefillSite:
    queued_tokens: int  # prompt tokens waiting for prefill there
    tokens_per_s: float | None  # its measured prefill rate, None when not measured yet
    fresh: bool = True  # the rate was measured by served work lately (not only at warm-up)
    cached_tokens: int = 0  # leading prompt tokens it holds K/V for (the router's prefix index)


@dataclass(frozen=True)
class Decision:
    remote: bool
    reason: str  # short label, also a metric label
    local_s: float | None = None
    remote_s: float | None = None


def choose_prefill_site(
    uncached_tokens: int,
    threshold: int,
    local: PrefillSite,
    remote: PrefillSite | None,
    remote_extra_s: float,
    decoding: int,
    busy_slack: float,
    remote_uncached_tokens: int | None = None,
) -> Decision:
    """Decide for one prompt. `uncached_tokens`: what D would compute; `remote_uncached_tokens`:
    what P would (default: the same); `remote_extra_s`: the transfer and hop cost for this prompt
    (`RemoteCost.seconds`); `decoding`: streams D is generating for right now."""
    if remote is None:
        return Decision(False, "no_prefill_worker")
    if uncached_tokens < threshold:
        return Decision(False, "short")
    local_rate = local.tokens_per_s or remote.tokens_per_s
    remote_rate = remote.tokens_per_s or local.tokens_per_s
    if not local_rate or not remote_rate:
        return Decision(True, "unmeasured")
    local_s = (local.queued_tokens + uncached_tokens) / local_rate
    remote_uncached = uncached_tokens if remote_uncached_tokens is None else remote_uncached_tokens
    remote_s = (remote.queued_tokens + remote_uncached) / remote_rate + remote_extra_s
    if decoding == 0:
        if remote_s < (1.0 - IDLE_REMOTE_MARGIN) * local_s:
            if not local.fresh and local.tokens_per_s:
                return Decision(False, "idle_remeasure", local_s, remote_s)
            return Decision(True, "remote_faster", local_s, remote_s)
        return Decision(False, "idle_local_faster", local_s, remote_s)
    if remote_s <= busy_slack * local_s:
        return Decision(True, "protect_decode", local_s, remote_s)
    return Decision(False, "prefill_pool_backlogged", local_s, remote_s)


@dataclass(frozen=True)
class Placement:
    """What a decode worker knows of a prompt's placement before its engine loop prices the
    local side: the prompt, the router's first prefill candidate, the cost of the trip, and the
    placement settings (`--prefill-placement`, `--disagg-threshold`, `--disagg-busy-slack`)."""

    prompt_len: int
    remote: PrefillSite
    remote_extra_s: Callable[[int], float]  # tokens -> transfer and hop seconds (`RemoteCost.seconds`)
    mode: str = ServingArgs.prefill_placement  # load | threshold
    threshold: int = ServingArgs.disagg_threshold
    busy_slack: float = ServingArgs.disagg_busy_slack


def place(p: Placement, cached_tokens: int, local: PrefillSite, decoding: int) -> Decision:
    """Decide for one prompt once the engine loop knows its cached tokens here, this worker as a
    prefill site and how many streams it decodes. `threshold` mode sends every prompt of
    `threshold` uncached tokens or more away, whatever the load."""
    uncached = p.prompt_len - cached_tokens
    if p.mode == "threshold":
        remote = uncached >= p.threshold
        return Decision(remote, "threshold" if remote else "short")
    # P computes what it lacks (all of it where D alone holds a prefix: D's K/V cannot reach P)
    remote_uncached = p.prompt_len - min(p.remote.cached_tokens, p.prompt_len - 1)
    return choose_prefill_site(
        uncached, p.threshold, local, p.remote, p.remote_extra_s(uncached), decoding, p.busy_slack,
        remote_uncached,
    )  # fmt: skip
