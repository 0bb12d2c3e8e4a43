"""Moving a live stream to another decode worker: what may move, and the request that resumes it.

A stream whose decode worker dies, stops answering or drains mid-way is re-placed on another
decode worker with the prompt and every token already relayed; the new worker takes them as its
own outputs (recomputing their K/V, or pulling it from a draining worker that handed the stream
off) and goes on (`disagg.worker.engine.resume`), drawing token N from the same
seeded random numbers (`disagg.worker.engine.seeds`), so the client's stream continues with
nothing repeated and nothing missing. Pure: `Generation` (generation.py) does the I/O.
"""

from __future__ import annotations

from disagg.proto import worker_pb2 as pb

# A worker's error codes that end a stream another worker can continue, and the reason counted
# (`disagg_router_migrations_total{reason}`). The rest (a bad request, a refused grammar) would
# fail the same way anywhere.
MOVABLE_ERRORS = {
    "migrate": "draining",  # a draining worker handed its streams off
    "draining": "draining",
    "unavailable": "unavailable",
    "engine_failed": "unavailable",  # its engine (or a tensor-parallel rank) died
}
MIGRATION_SUFFIX = "~m"  # request ids on the workers: <id>~m1, <id>~m2 ... after each move


def resumed_request(
    original: pb.GenerateRequest,
    request_id: str,
    move: int,
    sent_ids: list[int],
    sent_chars: int,
    holder: pb.PrefillTarget | None = None,
) -> pb.GenerateRequest:
    """The request that continues `original` on another worker after its `move-th` move.
    `holder`: the worker that handed the stream off, still holding its K/V for the new worker to
    pull, the only prefill target; None: no target yet (the router adds the new worker's usual
    ones: prompt and outputs are prefilled as a prompt is)."""
    req = pb.GenerateRequest()
    req.CopyFrom(original)
    req.request_id = f"{request_id}{MIGRATION_SUFFIX}{move}"
    del req.prefill_targets[:]
    req.params.ClearField("prompt_logprobs")  # the prompt's logprobs were sent already
    req.resume.Clear()
    req.resume.output_token_ids.extend(sent_ids)
    req.resume.sent_chars = sent_chars
    if holder is not None:
        req.prefill_targets.append(holder)
        req.resume.handoff_of = original.request_id
    return req


def worth_pulling(num_tokens: int, block_size: int) -> bool:
    """Whether a handed-off stream's K/V is worth pulling: at least one full block of it, besides
    the block of its last token (which the new worker computes anyway)."""
    return (num_tokens - 1) // block_size >= 1


def finished_message(prompt_tokens: int, completion_tokens: int) -> pb.GenerateResponse:
    """The end of a stream whose worker died after its last token but before saying so."""
    return pb.GenerateResponse(
        finish_reason="length",
        usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
    )
