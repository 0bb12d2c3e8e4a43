"""Moving a live stream to another decode worker: what may move, and the request that resumes it.

A stream whose decode worker dies, stops answering or drains mid-way is re-placed on another
decode worker with the prompt and every token already relayed; the new worker recomputes them
as its own outputs and goes on (`disagg.worker.engine.resume`), drawing token N from the same
seeded random numbers (`disagg.worker.engine.seeds`), so the client's stream continues with
nothing repeated and nothing missing. Pure: the router's `_move` does the I/O.
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
    original: pb.GenerateRequest, request_id: str, move: int, sent_ids: list[int], sent_chars: int
) -> pb.GenerateRequest:
    """The request that continues `original` on another worker after its `move`-th move."""
    req = pb.GenerateRequest()
    req.CopyFrom(original)
    req.request_id = f"{request_id}{MIGRATION_SUFFIX}{move}"
    # the new worker prefills prompt and outputs itself; the prompt's logprobs were sent already
    del req.prefill_targets[:]
    req.params.ClearField("prompt_logprobs")
    req.resume.Clear()
    req.resume.output_token_ids.extend(sent_ids)
    req.resume.sent_chars = sent_chars
    return req


def finished_message(prompt_tokens: int, completion_tokens: int) -> pb.GenerateResponse:
    """The end of a stream whose worker died after its last token but before saying so."""
    return pb.GenerateResponse(
        finish_reason="length",
        usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
    )
