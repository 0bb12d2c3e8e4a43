"""`disagg up` restarts a dead child with a crash-loop backoff and a rate limit over a window,
never gives up on it and never stops its siblings. Time is injected: no test here waits."""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg.worker.cli.restart_policy import RestartPolicy
from disagg.worker.cli.up import Child, Deployment


def test_deaths_in_a_row_double_the_wait_up_to_the_cap():
    p = RestartPolicy(initial=1, cap=8, reset_after=60, max_restarts=100, window=300)
    now, waits = 0.0, []
    p.started(now, restart=False)
    for _ in range(7):
        now += 0.5  # dies half a second after each start
        at = p.died(now)
        waits.append(at - now)
        now = at
        p.started(now)
    assert waits == [0, 1, 2, 4, 8, 8, 8]


def test_a_long_run_resets_the_backoff():
    p = RestartPolicy(initial=1, cap=60, reset_after=60, max_restarts=100, window=300)
    p.started(0.0, restart=False)
    assert p.died(1.0) == 1.0
    p.started(1.0)
    assert p.died(2.0) == 3.0
    p.started(3.0)
    assert p.died(3.0 + 61) == 3.0 + 61  # ran a minute: a first death again


def test_the_window_limits_restarts_without_giving_up():
    p = RestartPolicy(initial=1, cap=1, reset_after=1000, max_restarts=3, window=100)
    p.started(0.0, restart=False)
    now, starts = 0.0, []
    for _ in range(7):
        now = p.died(now)
        p.started(now)
        starts.append(now)
    # three restarts fit in 100 s; the fourth waits for the first to leave the window, and so on
    assert starts == [0, 1, 2, 100, 101, 102, 200]


def test_deaths_far_apart_are_restarted_forever():
    p = RestartPolicy()
    p.started(0.0, restart=False)
    now = 0.0
    for _ in range(100):
        now += 3600
        assert p.died(now) == now
        p.started(now)


class FakeProc:
    def __init__(self):
        self.returncode = None
        self.signals = 0

    def poll(self):
        return self.returncode

    def terminate(self):
        self.signals += 1


class FakeChild(Child):
    def start(self) -> None:
        self.proc = FakeProc()
        self.starts = getattr(self, "starts", 0) + 1


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _deployment(tmp_path: Path, clock: Clock) -> tuple[Deployment, FakeChild, FakeChild]:
    dep = Deployment(argparse.Namespace(run_dir=str(tmp_path)), clock=clock)
    policy = RestartPolicy(initial=2, cap=10, reset_after=30, max_restarts=4, window=60)
    flaky = FakeChild("decode-0", ["x"], tmp_path / "d.log", policy=policy)
    healthy = FakeChild("prefill-0", ["x"], tmp_path / "p.log")
    dep.children = [healthy, flaky]
    for c in dep.children:
        dep.launch(c, first=True)
    return dep, flaky, healthy


def test_a_child_that_keeps_dying_is_restarted_with_backoff_and_its_sibling_untouched(tmp_path):
    clock = Clock()
    dep, flaky, healthy = _deployment(tmp_path, clock)
    starts = []
    for _ in range(400):  # 200 s of the supervision loop, every half second
        if flaky.alive() and flaky.proc.poll() is None:
            flaky.proc.returncode = 1  # dies as soon as it is looked at
        dep.restart_dead()
        if flaky.alive():
            starts.append(clock.now)
        clock.now += 0.5
    assert healthy.starts == 1 and healthy.proc.signals == 0 and healthy.alive()
    assert flaky.starts > 6  # never given up on
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # dead at once: restarted at once; then 2, 4, 8 s of backoff, each found dead half a second after
    # its start; the fifth restart waits for the first (at 0 s) to leave the 60 s window
    assert starts[0] == 0 and gaps[:4] == [2.5, 4.5, 8.5, 44.5], starts
    # and never more than 4 restarts in any 60 s
    assert all(sum(1 for t in starts if s <= t < s + 60) <= 4 for s in starts)
