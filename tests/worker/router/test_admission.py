"""Admission: generations in flight up to --max-queue; each one's slot freed when it ends."""

from __future__ import annotations

import pytest

from disagg.worker.router.admission import Admission
from disagg.worker.router.errors import APIError


def test_a_request_past_the_queue_is_a_429():
    a = Admission(max_queue=4)
    with a.admit(3):
        with pytest.raises(APIError) as info, a.admit(2):
            pass
        assert info.value.status == 429 and a.inflight == 3
    assert a.inflight == 0


def test_each_generation_frees_its_slot_when_it_ends_and_the_request_frees_the_rest():
    a = Admission(max_queue=4)
    with a.admit(4) as slots:
        slots.free()  # one generation ended on its worker, its output not yet written
        assert a.inflight == 3
        with a.admit(1):  # its slot serves another request meanwhile
            assert a.inflight == 4
        slots.free()
        assert a.inflight == 2
    assert a.inflight == 0
    slots.free()  # a generation whose end is seen after its request: nothing is freed twice
    assert a.inflight == 0
