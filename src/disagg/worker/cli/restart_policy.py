"""When `disagg up` starts a dead child again: a crash-loop backoff, as a kubelet restarts a pod.

The first death of a child that had been running restarts it at once; each further death in a
row doubles the wait (from `initial` up to `cap`); a child that ran `reset_after` seconds before
dying counts as healthy again, so its next death is a first one. On top of the backoff, at most
`max_restarts` restarts fit in any `window` seconds: one more waits until the oldest of them
leaves the window. Nothing here ever gives up: a child that keeps dying is retried slowly, and
its siblings keep serving. Pure: the caller passes the time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    initial: float = 1.0  # the wait before the second restart in a row
    cap: float = 60.0  # the longest wait between restarts
    reset_after: float = 60.0  # seconds of running that make a child healthy again
    max_restarts: int = 5  # restarts allowed in any `window` seconds
    window: float = 300.0
    failures: int = 0  # deaths in a row (reset by a long enough run)
    started_at: float | None = None
    _restarts: deque[float] = field(default_factory=deque)  # restart times inside the window

    def __post_init__(self) -> None:
        if self.max_restarts < 1 or min(self.initial, self.cap, self.window) <= 0:
            raise ValueError("restart policy: max_restarts, initial, cap and window must be positive")

    def started(self, now: float, restart: bool = True) -> None:
        self.started_at = now
        if restart:
            self._restarts.append(now)

    def died(self, now: float) -> float:
        """The child was found dead at `now`: the time to start it again."""
        if self.started_at is not None and now - self.started_at >= self.reset_after:
            self.failures = 0
        self.failures += 1
        at = now + self.backoff()
        while self._restarts and self._restarts[0] <= now - self.window:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            # the oldest restart that must leave the window before one more fits in it
            at = max(at, self._restarts[-self.max_restarts] + self.window)
        return at

    def backoff(self) -> float:
        if self.failures <= 1:
            return 0.0
        return min(self.cap, self.initial * 2 ** (self.failures - 2))
