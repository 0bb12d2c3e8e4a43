"""Discrete-event simulation of a deployment under an open-loop request stream.

Disaggregated: prompts go to the prefill replica that frees up first (one prompt at a time: on the
hardware this models prefill is compute-bound, so batching prompts adds no throughput); the first
token leaves when the prompt is done and its KV has moved; the request then decodes on a decode
replica (round robin), which advances all its requests one token per step of the measured
duration for its batch (continuous batching, at most `max_batch`). Colocated: each replica
interleaves its decode steps with prefill chunks of at most `chunk_tokens`, so a step that carries
a chunk costs the decode step plus the chunk's prefill time (as the engine's scheduler does);
requests are spread round robin.

Each simulated request yields its TTFT and its TPOT (mean time between output tokens after the
first, queueing for a batch slot included), which is what a client measures.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from disagg.worker.engine.args import EngineArgs
from disagg.worker.planner.profile import Profile
from disagg.worker.planner.workload import Requests


@dataclass(frozen=True)
class Outcome:
    ttft: np.ndarray
    tpot: np.ndarray  # 0 for a request of one output token


def decode_context(prompt, output):
    """A request's context while it decodes, on average: its prompt and half its output (after the
    first token). Elementwise over arrays of requests."""
    return prompt + (output - 1) / 2


def _decode_replica(
    prof: Profile, join: np.ndarray, steps: np.ndarray, context: np.ndarray, max_batch: int
) -> np.ndarray:
    """Finish time of each request (joins ascending) that needs `steps` more decode steps."""
    finish = join.copy()
    t, done_steps, nxt = 0.0, 0, 0
    active: list[tuple[int, int]] = []  # (step count at which it finishes, request)
    held = 0.0  # the active requests' contexts, summed
    waiting: deque[int] = deque()
    n = len(join)
    while nxt < n or waiting or active:
        if not active and not waiting:
            t = max(t, join[nxt])
        while nxt < n and join[nxt] <= t:
            if steps[nxt] <= 0:
                finish[nxt] = join[nxt]
            else:
                waiting.append(nxt)
            nxt += 1
        while waiting and len(active) < max_batch:
            i = waiting.popleft()
            heapq.heappush(active, (done_steps + int(steps[i]), i))
            held += context[i]
        if not active:
            continue
        dt = prof.decode_seconds(len(active), held)
        k = active[0][0] - done_steps  # steps until the next request finishes
        if nxt < n and join[nxt] > t:  # a new request joins at the first step boundary after it arrives
            k = min(k, max(1, int(np.ceil((join[nxt] - t) / dt))))
        t += k * dt
        done_steps += k
        while active and active[0][0] <= done_steps:
            i = heapq.heappop(active)[1]
            finish[i] = t
            held -= context[i]
    return finish


def _round_robin(values: np.ndarray, replicas: int) -> list[np.ndarray]:
    return [np.arange(r, len(values), replicas) for r in range(replicas)]


def disaggregated(
    prof: Profile, req: Requests, prefill: int, decode: int, max_batch: int = EngineArgs.max_num_seqs
) -> Outcome:
    service = prof.prefill_seconds(req.prompt)
    free = [0.0] * prefill
    done = np.empty(len(req))
    for i, (a, s) in enumerate(zip(req.arrival, service, strict=True)):
        start = max(a, heapq.heappop(free))
        done[i] = start + s
        heapq.heappush(free, done[i])
    first = done + prof.transfer_seconds(req.prompt)
    context = decode_context(req.prompt, req.output)
    order = np.argsort(first, kind="stable")
    finish = np.empty(len(req))
    for idx in _round_robin(order, decode):
        mine = order[idx]
        finish[mine] = _decode_replica(prof, first[mine], req.output[mine] - 1, context[mine], max_batch)
    return outcome(req, first, finish)


def _colocated_replica(prof: Profile, arrival, prompt, output, context, max_batch: int, chunk_tokens: int):
    n = len(arrival)
    first, finish = np.empty(n), np.empty(n)
    t, done_steps, nxt = 0.0, 0, 0
    held = 0.0  # the active requests' contexts, summed
    active: list[tuple[int, int]] = []
    waiting: deque[list[int]] = deque()  # [request, prompt tokens left]
    ready: deque[int] = deque()  # prefilled, waiting for a batch slot
    while nxt < n or waiting or ready or active:
        if not (active or waiting or ready):
            t = max(t, arrival[nxt])
        while nxt < n and arrival[nxt] <= t:
            waiting.append([nxt, int(prompt[nxt])])
            nxt += 1
        while ready and len(active) < max_batch:
            i = ready.popleft()
            heapq.heappush(active, (done_steps + int(output[i]) - 1, i))
            held += context[i]
        if waiting:  # a step with a prefill chunk (and the decode batch, if any)
            budget, prefilled = chunk_tokens, []
            while waiting and budget > 0:
                take = min(waiting[0][1], budget)
                waiting[0][1] -= take
                budget -= take
                if waiting[0][1] == 0:
                    prefilled.append(waiting.popleft()[0])
            dt = float(prof.prefill_seconds(chunk_tokens - budget))
            if active:
                dt += prof.decode_seconds(len(active), held)
                done_steps += 1
            t += dt
            for i in prefilled:
                first[i] = t
                if output[i] <= 1:
                    finish[i] = t
                else:
                    ready.append(i)
        elif active:  # decode only: jump to the next finish or arrival
            dt = prof.decode_seconds(len(active), held)
            k = active[0][0] - done_steps
            if nxt < n and arrival[nxt] > t:
                k = min(k, max(1, int(np.ceil((arrival[nxt] - t) / dt))))
            t += k * dt
            done_steps += k
        while active and active[0][0] <= done_steps:
            i = heapq.heappop(active)[1]
            finish[i] = t
            held -= context[i]
    return first, finish


def colocated(
    prof: Profile,
    req: Requests,
    replicas: int,
    max_batch: int = EngineArgs.max_num_seqs,
    chunk_tokens: int = EngineArgs.max_num_batched_tokens,
) -> Outcome:
    first, finish = np.empty(len(req)), np.empty(len(req))
    context = decode_context(req.prompt, req.output)
    for idx in _round_robin(req.arrival, replicas):
        f, e = _colocated_replica(
            prof, req.arrival[idx], req.prompt[idx], req.output[idx], context[idx], max_batch, chunk_tokens
        )
        first[idx], finish[idx] = f, e
    return outcome(req, first, finish)


def outcome(req: Requests, first: np.ndarray, finish: np.ndarray) -> Outcome:
    after_first = np.maximum(req.output - 1, 1)
    tpot = np.where(req.output > 1, (finish - first) / after_first, 0.0)
    return Outcome(first - req.arrival, tpot)
