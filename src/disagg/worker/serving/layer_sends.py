"""A prefill's per-layer KV sends, posted only once the device has written that layer.

On a GPU the forward pass is asynchronous: when the model calls the layer hook after layer i,
layer i's K/V writes are only queued on the device's stream. A one-sided write (NIXL reads our
blocks with its own copy engine) posted then could ship the blocks before they hold the layer's
K/V. So each layer is queued with a device event recorded at the hook and posted once that event
has completed: at a later layer's hook (the transfer of early layers still overlaps the compute of
later ones) or, at the latest, when the step is over (`flush`). On a CPU the forward is
synchronous and a layer has no event: it is posted at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol


class DeviceEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class LayerSends:
    """Layers waiting for their K/V, in order; `post(layer)` sends one (and may raise)."""

    def __init__(self, post: Callable[[int], None]):
        self._post = post
        self._waiting: deque[tuple[int, DeviceEvent | None]] = deque()
        self.posted = 0

    @property
    def pending(self) -> int:
        return len(self._waiting)

    @property
    def any(self) -> bool:
        """Whether any layer was queued (posted or waiting)."""
        return self.posted > 0 or bool(self._waiting)

    def add(self, layer: int, written: DeviceEvent | None) -> None:
        """Queue `layer` (its K/V complete once `written` has), then post every layer ready."""
        self._waiting.append((layer, written))
        self.post_ready()

    def post_ready(self) -> None:
        """Post the queued layers whose writes completed, in layer order, without waiting."""
        while self._waiting and (self._waiting[0][1] is None or self._waiting[0][1].query()):
            self._post_next()

    def flush(self) -> None:
        """Post every queued layer, waiting for the device where it is still writing."""
        while self._waiting:
            written = self._waiting[0][1]
            if written is not None:
                written.synchronize()
            self._post_next()

    def drop(self) -> None:
        """Forget the layers not yet posted (the prefill failed)."""
        self._waiting.clear()

    def _post_next(self) -> None:
        layer, _ = self._waiting.popleft()
        self._post(layer)
        self.posted += 1
