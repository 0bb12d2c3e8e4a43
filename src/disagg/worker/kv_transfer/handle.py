"""TransferHandle: the sender's view of one nonblocking send (or notice)."""

from __future__ import annotations

import time
from collections.abc import Callable

from disagg.worker.kv_transfer.metrics import TRANSFER_BYTES, TRANSFER_FAILURES, TRANSFER_SECONDS

PENDING, DONE, ERROR = "pending", "done", "error"


class TransferHandle:
    """Polled by the thread that owns the transport; never blocks except in `wait`.

    `error_kind` is a short label (disconnect, timeout, rejected, aborted, error) and `reason`
    the human-readable cause. A handle past its deadline turns into an error, so a dead peer
    never hangs the caller.
    """

    def __init__(
        self,
        backend: str,
        peer_id: str,
        request_id: str,
        nbytes: int,
        timeout: float,
        on_error: Callable[[TransferHandle], None] | None = None,
        counts_bytes: bool = True,
    ):
        self.backend = backend
        self.peer_id = peer_id
        self.request_id = request_id
        self.bytes = nbytes
        self.state = PENDING
        self.error_kind = ""
        self.reason = ""
        self._started = time.monotonic()
        self._finished: float | None = None
        self._deadline = self._started + timeout
        self._on_error = on_error
        self._counts_bytes = counts_bytes

    @property
    def seconds(self) -> float:
        end = self._finished if self._finished is not None else time.monotonic()
        return end - self._started

    def poll(self) -> str:
        if self.state == PENDING:
            self._check()
        if self.state == PENDING and time.monotonic() > self._deadline:
            self._cancel()
            self.fail("timeout", f"not complete after {self._deadline - self._started:g}s")
        return self.state

    def wait(self, timeout: float | None = None) -> str:
        """Poll until done or error (or `timeout` seconds, then still "pending")."""
        until = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        while self.poll() == PENDING:
            if until is not None and time.monotonic() > until:
                break
            time.sleep(pause)
            pause = min(0.001, pause + 0.00005)
        return self.state

    def succeed(self) -> None:
        if self.state != PENDING:
            return
        self.state = DONE
        self._finished = time.monotonic()
        if self._counts_bytes:
            TRANSFER_BYTES.labels(self.backend, "send").inc(self.bytes)
            TRANSFER_SECONDS.labels(self.backend).observe(self.seconds)

    def fail(self, kind: str, reason: str) -> None:
        if self.state != PENDING:
            return
        self.state = ERROR
        self.error_kind = kind
        self.reason = reason
        self._finished = time.monotonic()
        TRANSFER_FAILURES.labels(self.backend, kind).inc()
        if self._on_error is not None:
            self._on_error(self)

    # Overridden by each transport.
    def _check(self) -> None:
        """Advance the state from the underlying operation."""

    def _cancel(self) -> None:
        """Best effort: stop the underlying operation after a timeout."""

    def __repr__(self) -> str:
        extra = f" {self.error_kind}: {self.reason}" if self.state == ERROR else ""
        return f"<TransferHandle {self.backend} {self.request_id}->{self.peer_id} {self.state}{extra}>"


def finished_handle(backend: str, peer_id: str, request_id: str, error: tuple[str, str] | None = None):
    """A handle that is already settled (nothing to move, or refused before posting)."""
    handle = TransferHandle(backend, peer_id, request_id, 0, timeout=0.0, counts_bytes=False)
    if error is None:
        handle.succeed()
    else:
        handle.fail(*error)
    return handle


class AllHandles(TransferHandle):
    """Several sends as one: done when all are, an error as soon as one is (the ranks of a peer
    split differently, each written its own heads)."""

    def __init__(self, backend: str, peer_id: str, request_id: str, handles: list[TransferHandle]):
        timeout = max(h._deadline for h in handles) - time.monotonic()
        super().__init__(backend, peer_id, request_id, sum(h.bytes for h in handles), max(timeout, 0.0),
                         counts_bytes=False)  # fmt: skip
        self.handles = handles

    def _check(self) -> None:
        states = [h.poll() for h in self.handles]
        bad = next((h for h in self.handles if h.state == ERROR), None)
        if bad is not None:
            self.fail(bad.error_kind, bad.reason)
        elif all(state == DONE for state in states):
            self.succeed()


def all_of(backend: str, peer_id: str, request_id: str, handles: list[TransferHandle]) -> TransferHandle:
    if not handles:
        return finished_handle(backend, peer_id, request_id)
    return handles[0] if len(handles) == 1 else AllHandles(backend, peer_id, request_id, handles)
