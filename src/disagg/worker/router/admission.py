"""Admission: the bound on generations this router has in flight (`--max-queue`). Past it a
request is a 429 with Retry-After, before any work is done for it.

A slot counts a generation until it ends on its worker, not until its client has read the answer:
a client slow to read holds only the bytes still to be written to it (bounded by
`--client-write-timeout`, `client_writes.py`), never the queue."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from disagg.worker.router.errors import APIError


class Slots:
    """A request's admitted generations; each is freed once, when it ends (`free`) or with the
    request (`Admission.admit`'s exit frees whatever is left)."""

    def __init__(self, admission: Admission, count: int):
        self._admission = admission
        self.held = count

    def free(self, count: int = 1) -> None:
        count = min(count, self.held)
        self.held -= count
        self._admission.inflight -= count


class Admission:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.inflight = 0  # generations admitted and not finished

    @contextlib.contextmanager
    def admit(self, generations: int) -> Iterator[Slots]:
        """Count a request's `generations` in flight while the block runs, or refuse it.

        Generations, not HTTP requests, are counted: n=8 weighs as much as 8 requests. The check
        and the count are taken together, before any await, so a burst cannot slip past it."""
        if self.inflight + generations > self.max_queue:
            raise APIError(429, "The server is at capacity; retry shortly.", code="queue_full", retry_after=1)
        self.inflight += generations
        slots = Slots(self, generations)
        try:
            yield slots
        finally:
            slots.free(slots.held)
