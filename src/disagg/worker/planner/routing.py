"""Discrete-event simulation of prefill and decode replicas under the product's own policies: the
router's (it lends an idle prefill replica whole requests: `--prefill-overflow MARGIN`,
router/policy.choose_decode) and the decode worker's (it prefills a prompt itself when that is
cheaper: serving/disagg_policy.choose_prefill_site, `--prefill-placement load`).

In `simulate`, each replica's timeline follows from the requests assigned to it up front. Here
the policies decide at each arrival from every replica's state at that instant, so all replicas
advance together on one event queue.

Routing, with the router's cost of a worker (running streams + 2 x requests routed to it that do
not decode yet): a request goes to the cheapest decode replica, unless a prefill replica with no
prompt to compute is cheaper by more than `margin` (None: never), and the request's prompt costs it
no more than the decode steps it takes off the decode replica (`worth_lending`, at that replica's
step time for its batch then); that replica then prefills and decodes the request itself. The
decode replica prices its prompt at both sites (queued prompt tokens and this one at the prefill
rate; remote: plus the KV transfer) with the worker's own function, or, with
`placement="threshold"`, sends every prompt of at least `threshold` tokens away. A remote prompt
goes to the prefill replica with the fewest prompt tokens queued; its first token leaves once the
prompt is computed and its KV has moved, and it joins the decode batch at the next step.

Every replica steps as the engine does: a step carries a prompt chunk (<= `chunk_tokens`, its
prefill time) and one token of each stream decoding there; with no prompt queued, decode steps of
the measured time for the batch. Prompts are never cached (random prompts, as the benchmarks send).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from disagg.worker.engine.args import EngineArgs
from disagg.worker.planner.profile import Profile
from disagg.worker.planner.simulate import Outcome, decode_context, outcome
from disagg.worker.planner.workload import Requests
from disagg.worker.router.policy import WAITING_WEIGHT, WorkerView, worth_lending
from disagg.worker.serving.args import PREFILL_PLACEMENTS, ServingArgs
from disagg.worker.serving.disagg_policy import PrefillSite, choose_prefill_site


@dataclass
class _Replica:
    prompts: deque = field(default_factory=deque)  # [request, tokens left, decode replica | None]
    ready: deque = field(default_factory=deque)  # computed or landed here, waiting for a batch slot
    active: list = field(default_factory=list)  # heap of (step count at which it finishes, request)
    done_steps: int = 0
    pending: int = 0  # routed here to decode, not decoding yet
    queued: int = 0  # prompt tokens not computed yet
    held: float = 0.0  # the decoding streams' contexts, summed
    busy: bool = False
    start: float = 0.0  # the step (or run of decode steps) in progress
    dt: float = 0.0
    steps: int = 0  # decode steps in the run; 0: a step with a prompt chunk
    completing: list = field(default_factory=list)  # prompts the chunk step in progress completes
    version: int = 0  # of the scheduled end event (a shortened run leaves a stale one)

    def cost(self) -> float:
        return len(self.active) + WAITING_WEIGHT * self.pending

    def queue(self, request: int, tokens: int, dest: int | None) -> None:
        """A prompt to compute here; its KV goes to decode replica `dest` (None: it decodes here)."""
        self.prompts.append([request, tokens, dest])
        self.queued += tokens

    def spare(self) -> bool:
        return not self.prompts and not self.completing


def simulate(
    prof: Profile,
    req: Requests,
    prefill: int,
    decode: int,
    margin: float | None,
    max_batch: int = EngineArgs.max_num_seqs,
    chunk_tokens: int = EngineArgs.max_num_batched_tokens,
    placement: str = ServingArgs.prefill_placement,
    threshold: int = ServingArgs.disagg_threshold,
    busy_slack: float = ServingArgs.disagg_busy_slack,
) -> Outcome:
    if prefill < 1 or decode < 1:
        raise ValueError(f"needs a prefill and a decode replica, got {prefill}:{decode}")
    if placement not in PREFILL_PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PREFILL_PLACEMENTS)}, got {placement!r}")
    rate = 1.0 / float(prof.prefill_per_token)  # tokens/s, the same on every replica
    # service times as plain floats: the loop below asks for them tens of thousands of times
    step_of = [float(v) for v in prof.step_seconds(np.arange(max_batch + 1))]
    context = decode_context(req.prompt, req.output).tolist()
    fixed, per_token = float(prof.prefill_fixed), float(prof.prefill_per_token)
    n = len(req)
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    after_first = (req.output - 1).astype(int)
    transfer = prof.transfer_seconds(req.prompt)
    reps = [_Replica() for _ in range(prefill + decode)]
    lenders, decoders = range(prefill), range(prefill, prefill + decode)
    lender_view = WorkerView("lender", "prefill", "", prefill_tokens_per_s=rate)  # as the router sees one
    events: list = []
    order = itertools.count()

    def push(t: float, kind: str, a: int, b: int = 0) -> None:
        heapq.heappush(events, (t, next(order), kind, a, b))

    def step(r: _Replica) -> float:
        """A decode step of r's streams: Profile.decode_seconds, its batch's part from the table."""
        b = len(r.active)
        return step_of[b] + prof.context_seconds(b, r.held)

    def begin(k: int, t: float) -> None:
        """Start replica k's next step (or run of decode steps) at t, if it has work."""
        r = reps[k]
        while r.ready and len(r.active) < max_batch:
            i = r.ready.popleft()
            r.pending -= 1
            heapq.heappush(r.active, (r.done_steps + after_first[i], i))
            r.held += context[i]
        if r.prompts:
            budget = chunk_tokens
            while r.prompts and budget > 0:
                take = min(r.prompts[0][1], budget)
                r.prompts[0][1] -= take
                r.queued -= take
                budget -= take
                if r.prompts[0][1] == 0:
                    r.completing.append(r.prompts.popleft())
            r.dt = fixed + per_token * (chunk_tokens - budget)
            if r.active:
                r.dt += step(r)
            r.steps = 0
        elif r.active:
            r.dt = step(r)
            r.steps = r.active[0][0] - r.done_steps  # until the next stream finishes
        else:
            r.busy = False
            return
        r.busy, r.start = True, t
        r.version += 1
        push(t + r.dt * max(r.steps, 1), "end", k, r.version)

    def end(k: int, t: float) -> None:
        r = reps[k]
        if r.steps:
            r.done_steps += r.steps
        else:
            if r.active:
                r.done_steps += 1
            for i, _left, dest in r.completing:
                if dest is None:  # computed where it decodes (lent, or prefilled by its decode replica)
                    first_token(k, i, t)
                else:
                    push(t + float(transfer[i]), "land", i, dest)
            r.completing = []
        while r.active and r.active[0][0] <= r.done_steps:
            i = heapq.heappop(r.active)[1]
            finish[i] = t
            r.held -= context[i]
        begin(k, t)

    def first_token(k: int, i: int, t: float) -> None:
        """Request i's first token leaves replica k, where it decodes (a one-token request is done)."""
        first[i] = t
        if after_first[i] > 0:
            reps[k].ready.append(i)
        else:
            finish[i] = t
            reps[k].pending -= 1

    def poke(k: int, t: float) -> None:
        """Work arrived at replica k: start now if idle, else cut a run of decode steps short at
        the first step boundary after t (the new work joins there)."""
        r = reps[k]
        if not r.busy:
            begin(k, t)
            return
        if r.steps > 1:
            j = min(r.steps, int((t - r.start) // r.dt) + 1)
            if j < r.steps:
                r.steps = j
                r.version += 1
                push(r.start + r.dt * j, "end", k, r.version)

    def route(i: int, t: float) -> None:
        best = min(decoders, key=lambda k: (reps[k].cost(), k))
        if margin is not None:
            spare = [k for k in lenders if reps[k].spare()]
            if spare:
                lender = min(spare, key=lambda k: (reps[k].cost(), k))
                if reps[lender].cost() + margin < reps[best].cost() and worth_lending(
                    lender_view,
                    WorkerView("decoder", "decode", "", decode_step_seconds=step(reps[best])),
                    int(req.prompt[i]),
                    int(req.output[i]),
                ):
                    reps[lender].pending += 1
                    reps[lender].queue(i, int(req.prompt[i]), None)
                    poke(lender, t)
                    return
        d = reps[best]
        d.pending += 1
        tokens = int(req.prompt[i])
        target = min(lenders, key=lambda k: (reps[k].queued, len(reps[k].prompts), k))
        if placement == "threshold":
            remote = tokens >= threshold
        else:
            remote = choose_prefill_site(
                tokens,
                threshold,
                PrefillSite(d.queued, rate),
                PrefillSite(reps[target].queued, rate),
                float(transfer[i]),
                len(d.active),
                busy_slack,
            ).remote
        if remote:
            reps[target].queue(i, tokens, best)
            poke(target, t)
        else:  # prefilled by the decode replica itself, between its decode steps
            d.queue(i, tokens, None)
            poke(best, t)

    for i, a in enumerate(req.arrival):
        push(float(a), "arrive", i)
    while events:
        t, _, kind, a, b = heapq.heappop(events)
        if kind == "arrive":
            route(a, t)
        elif kind == "land":
            first_token(b, a, t)
            poke(b, t)
        elif b == reps[a].version:  # an end event not superseded
            end(a, t)
    return outcome(req, first, finish)
