"""Receiver-side bookkeeping: which requests have fully landed, which failed.

A sender issues any number of sends for a request (one per layer group, say), each reported by
a PART notice once its bytes are in place, then one FINAL notice carrying how many sends it
issued. Notices may arrive in any order (separate NIXL transfers or gRPC streams are not
ordered with respect to each other), so a request is complete when FINAL has arrived and the
PART count reaches it. Entries are keyed by (sender, request id): a late notice from a replaced
sender never completes another sender's request, and notices for a request that already
completed or failed are ignored, so each request is reported exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

# How many settled (sender, request) keys are remembered to drop their late notices.
_CLOSED_MEMORY = 65536


@dataclass
class _Entry:
    parts: int = 0
    bytes: int = 0
    expected: int | None = None
    senders: int = 1  # sending ranks whose every part the request needs (from FINAL)
    last_activity: float = field(default_factory=time.monotonic)


class ReceiveTracker:
    def __init__(self, stall_timeout: float | None = None):
        """stall_timeout: report a request failed when nothing arrived for it for this long."""
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._completed: list[str] = []
        self._failed: list[tuple[str, str]] = []
        self._stall_timeout = stall_timeout
        self._closed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.bytes_received = 0
        self._senders_done: dict[str, int] = {}  # request id -> sending ranks complete so far
        self._senders_aborted: dict[str, int] = {}  # request id -> sending ranks that aborted it

    def _close(self, key: tuple[str, str]) -> None:
        self._entries.pop(key, None)
        self._closed[key] = None
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)

    def _entry(self, sender: str, request_id: str) -> _Entry | None:
        if (sender, request_id) in self._closed:
            return None
        entry = self._entries.setdefault((sender, request_id), _Entry())
        entry.last_activity = time.monotonic()
        return entry

    def _settle(self, key: tuple[str, str], entry: _Entry) -> None:
        if entry.expected is not None and entry.parts >= entry.expected:
            self._close(key)
            if entry.senders > 1:  # several ranks of one sender each write part of the request
                done = self._senders_done[key[1]] = self._senders_done.get(key[1], 0) + 1
                if key[1] in self._senders_aborted:
                    self._ranks_settled(key[1], entry.senders)
                    return
                if done < entry.senders:
                    return
                del self._senders_done[key[1]]
            self._completed.append(key[1])
            # Leftovers of a replaced sender for the same request must not report it failed later.
            for other in [k for k in self._entries if k[1] == key[1]]:
                self._close(other)

    def on_part(self, sender: str, request_id: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_received += nbytes
            entry = self._entry(sender, request_id)
            if entry is None:
                return
            entry.parts += 1
            entry.bytes += nbytes
            self._settle((sender, request_id), entry)

    def on_final(self, sender: str, request_id: str, parts: int, senders: int = 1) -> None:
        """`senders` > 1: the request completes once that many senders (the ranks of a
        tensor-parallel worker, each with its own part of the KV heads) have each completed."""
        with self._lock:
            entry = self._entry(sender, request_id)
            if entry is None:
                return
            entry.expected = parts
            entry.senders = max(senders, 1)
            self._settle((sender, request_id), entry)

    def on_failure(self, sender: str, request_id: str, reason: str, senders: int = 1) -> None:
        """`senders` > 1: one of that many ranks writing into this cache aborted the request. It
        failed ("a sending rank aborted: ..."), but reads as aborted (nothing more will land) only
        once every rank completed or aborted: then a second failure, "aborted: by every sending
        rank", is reported."""
        with self._lock:
            if (sender, request_id) in self._closed:
                return
            self._close((sender, request_id))
            if senders <= 1:
                self._senders_done.pop(request_id, None)
                self._senders_aborted.pop(request_id, None)
                self._failed.append((request_id, reason))
                return
            aborted = self._senders_aborted[request_id] = self._senders_aborted.get(request_id, 0) + 1
            if aborted == 1:
                self._failed.append((request_id, f"a sending rank {reason}"))
            self._ranks_settled(request_id, senders)

    def _ranks_settled(self, request_id: str, senders: int) -> None:
        if self._senders_done.get(request_id, 0) + self._senders_aborted[request_id] >= senders:
            self._senders_done.pop(request_id, None)
            del self._senders_aborted[request_id]
            self._failed.append((request_id, "aborted: by every sending rank"))

    def fail_sender(self, sender: str, reason: str) -> None:
        """The sender is gone: everything still in flight from it failed."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == sender]:
                self._close(key)
                self._senders_done.pop(key[1], None)
                self._senders_aborted.pop(key[1], None)
                self._failed.append((key[1], reason))

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._senders_done.pop(request_id, None)
            self._senders_aborted.pop(request_id, None)
            for key in [k for k in self._entries if k[1] == request_id]:
                self._close(key)

    def pop_completed(self) -> list[str]:
        with self._lock:
            done, self._completed = self._completed, []
            return done

    def pop_failed(self, now: float | None = None) -> list[tuple[str, str]]:
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._stall_timeout is not None:
                for key, entry in list(self._entries.items()):
                    if now - entry.last_activity > self._stall_timeout:
                        self._close(key)
                        self._failed.append(
                            (key[1], f"stalled: nothing received for {self._stall_timeout:g}s")
                        )
            failed, self._failed = self._failed, []
            return failed

    def finishing(self, within: float = 0.05, now: float | None = None) -> bool:
        """Whether a FINAL arrived for a request still missing parts, and something of it arrived
        in the last `within` seconds: the rest is about to land (a sender that went quiet is not)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return any(
                e.expected is not None and now - e.last_activity < within for e in self._entries.values()
            )

    def in_flight(self) -> int:
        with self._lock:
            return len(self._entries)
