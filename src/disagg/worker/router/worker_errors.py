"""A worker's failures as the client's API errors: an error message in its Generate stream, or its
gRPC call broken (pure: the caller takes the worker out of rotation where that is due)."""

from __future__ import annotations

import grpc

from disagg.worker.router.errors import APIError

# the worker's error codes that are not a 500; a 503 asks the client to retry
_STATUS = {"invalid_request": 400, "unavailable": 503, "draining": 503, "prefill_failed": 503}
BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # the worker is gone, not the request


def message_error(msg) -> APIError:
    """The API error of a `GenerateResponse` that carries one."""
    code = msg.error.code or "internal"
    status = _STATUS.get(code, 500)
    return APIError(status, msg.error.message, code=code, retry_after=1 if status == 503 else None)


def rpc_error(worker_id: str, e: grpc.aio.AioRpcError) -> APIError:
    if e.code() in BROKEN:
        return APIError(503, f"worker {worker_id} is unavailable: {e.details()}", code="worker_unavailable",
                        retry_after=1)  # fmt: skip
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "the request timed out", code="timeout")
    return APIError(500, f"worker {worker_id} failed: {e.details()}", code="worker_error")


def went_away(worker_id: str) -> APIError:
    """A generation's call cancelled under it (the pool closed the channel of a worker that left
    the registry or stopped answering)."""
    return APIError(503, f"worker {worker_id} went away", code="worker_unavailable", retry_after=1)
