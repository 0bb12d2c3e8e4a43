"""Local ports come from below the ephemeral range and skip ports already in use."""

from __future__ import annotations

import socket

import pytest

from disagg.worker.cli import ports


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    port = ports.free_port()
    assert ports._RANGE[0] <= port < ports._RANGE[1] < 32768
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_that_is_taken(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_RANGE", (taken, taken + 1))
        with pytest.raises(RuntimeError, match="no free port"):
            ports.free_port()
        monkeypatch.setattr(ports, "_RANGE", (taken - 1, taken + 1))
        for _ in range(5):  # random start: sometimes the taken port is tried first
            try:
                assert ports.free_port() == taken - 1
            except RuntimeError:  # only when the neighbour is busy too
                with socket.socket() as s, pytest.raises(OSError):
                    s.bind(("127.0.0.1", taken - 1))
