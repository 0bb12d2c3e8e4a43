"""Per-layer KV sends wait for the device to have written their layer, and keep layer order."""

from __future__ import annotations

import pytest

from disagg.worker.serving.layer_sends import LayerSends


class Event:
    """A device event that completes when the test says so; counts host waits on it."""

    def __init__(self, done: bool = False):
        self.done, self.waits = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_a_layer_is_posted_only_once_its_writes_completed_and_in_order():
    posted = []
    sends = LayerSends(posted.append)
    e0, e1, e2 = Event(), Event(), Event()
    sends.add(0, e0)
    sends.add(1, e1)
    assert posted == [] and sends.pending == 2 and sends.any
    e1.done = True  # a later layer done first (another stream): still waits for layer 0
    sends.add(2, e2)
    assert posted == []
    e0.done = True
    sends.post_ready()
    assert posted == [0, 1] and sends.pending == 1
    sends.flush()  # the step is over: the host waits for the last layer's event, then posts it
    assert posted == [0, 1, 2] and e2.waits == 1 and (e0.waits, e1.waits) == (0, 0)
    assert sends.posted == 3 and sends.pending == 0


def test_without_events_layers_go_at_once():
    posted = []
    sends = LayerSends(posted.append)
    for layer in range(3):
        sends.add(layer, None)
    assert posted == [0, 1, 2]


def test_dropped_layers_are_never_posted_and_a_failing_post_stops_the_queue():
    posted = []
    sends = LayerSends(posted.append)
    sends.add(0, Event())
    sends.drop()
    sends.flush()
    assert posted == [] and not sends.any

    def boom(layer):
        raise ValueError(f"layer {layer}: peer evicted")

    failing = LayerSends(boom)
    with pytest.raises(ValueError, match="layer 0"):
        failing.add(0, None)
    assert failing.posted == 0
