"""Admission: the bound on generations this router has in flight (`--max-queue`). Past it a
request is a 429 with Retry-After, before any work is done for it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from disagg.worker.router.errors import APIError


class Admission:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.inflight = 0  # generations admitted and not finished

    @contextlib.contextmanager
    def admit(self, generations: int) -> Iterator[None]:
        """Count a request's `generations` in flight while the block runs, or refuse it.

        Generations, not HTTP requests, are counted: n=8 weighs as much as 8 requests. The check
        and the count are taken together, before any await, so a burst cannot slip past it."""
        if self.inflight + generations > self.max_queue:
            raise APIError(429, "The server is at capacity; retry shortly.", code="queue_full", retry_after=1)
        self.inflight += generations
        try:
            yield
        finally:
            self.inflight -= generations
