"""The one thread that owns the engine (and the KV transport agent bound to its cache).

Everything that touches the engine runs here: gRPC handlers submit closures with `call()` and
await the returned future; `step()` outputs are handed to per-request sinks. Between engine
steps the loop runs submitted closures and the registered pollers (KV transfer completions,
sends in flight). When there is no work it sleeps on the command queue, so an idle worker
costs no CPU. When only pollers have work (a decode worker awaiting a remote prefill's KV, which
takes as long as the prompt's compute), the loop polls every `spin_wait` seconds for
`spin_seconds` after its last step (the tail of the sends that step posted is picked up at
once) and while a poller answers `SOON` (what it waits for is landing now: a transfer whose
FINAL notice came, its last parts a fraction of a millisecond behind), then every `poll_wait`
seconds: a loop that polled back to back for the whole wait kept a core busy for nothing and held
the GIL the asyncio thread needed to send the Prefill call (1-3 ms more per call). A submitted
closure still wakes the loop at once.

The loop's thread yields the CPU after every step and every batch of closures. On a CPU host a
worker's threads share its cores: the asyncio thread, woken with what the loop handed it (a token,
a committed remote prefill), waited 0.1-5 ms until the scheduler preempted the computing engine
thread (`perf sched`: runnable for 4 ms while the engine thread kept the core, even niced); with
the yield (which also lets go of the GIL) it runs at once, 0.1-0.3 ms later.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("disagg.worker.engine_loop")

# A poller's answer when it has work that will be ready within a fraction of a millisecond: the
# loop then polls at the spin rate (any other true answer: at `poll_wait`).
SOON = "soon"


def yield_cpu() -> None:
    """Let a thread this one just woke run now (also lets go of the GIL)."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()


class EngineFailed(RuntimeError):
    """The engine step kept failing: what every request still in the engine is told."""


class EngineLoop:
    def __init__(
        self,
        idle_wait: float = 0.05,
        max_step_failures: int = 5,
        spin_seconds: float = 0.002,
        spin_wait: float = 0.0001,
        poll_wait: float = 0.001,
        clock: Callable[[], float] = time.monotonic,
    ):
        """max_step_failures: consecutive failed engine steps after which the loop gives up:
        `on_fatal(error)` runs on this thread (fail the requests) and the loop stops, so liveness
        turns false and the process can exit instead of retrying forever. clock: what the spin
        window after a step is measured by."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._pollers: list[Callable[[], bool]] = []
        self._idle_wait = idle_wait
        self._spin_seconds = spin_seconds
        self._spin_wait = spin_wait
        self._poll_wait = poll_wait
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.engine = None
        self.step_fn: Callable[[], None] | None = None  # runs one engine step and dispatches outputs
        self.has_work: Callable[[], bool] = lambda: False
        self.on_iteration: Callable[[], None] | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.max_step_failures = max_step_failures
        self.error: BaseException | None = None
        self.thread_id: int | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, init: Callable[[], None]) -> concurrent.futures.Future:
        """Start the thread; `init` runs first on it (model load, transport agent creation)."""
        ready: concurrent.futures.Future = concurrent.futures.Future()

        def main():
            self.thread_id = threading.get_ident()
            try:
                init()
            except BaseException as e:
                self.error = e
                ready.set_exception(e)
                return
            ready.set_result(None)
            self._run()

        self._thread = threading.Thread(target=main, name="engine-loop", daemon=True)
        self._thread.start()
        return ready

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add_poller(self, poll: Callable[[], bool | str]) -> None:
        """`poll()` runs every iteration on the loop thread; it returns True while it has work
        (`SOON` when that work is about to be ready)."""
        self._pollers.append(poll)

    # ---- submission ---------------------------------------------------------------------------
    def _give_up(self, error: BaseException) -> None:
        self.error = EngineFailed(f"the engine step failed {self.max_step_failures} times in a row: {error}")
        log.error("%s; failing its requests and stopping", self.error)
        if self.on_fatal is not None:
            try:
                self.on_fatal(self.error)
            except Exception:
                log.exception("failing the requests after the engine failed")

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("the engine loop is stopped"))
            return fut
        self._commands.put((fut, fn, args))
        return fut

    # ---- the loop -----------------------------------------------------------------------------
    def _drain(self, wait: float) -> bool:
        """Run the queued closures, waiting up to `wait` seconds for the first; True if any ran."""
        try:
            item = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
        except queue.Empty:
            return False
        while item is not None:
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                item = None
        return True

    def _wait(self, stepped: bool, polling: bool | str, last_step: float) -> float:
        """How long the next drain may block: not at all after a step."""
        if stepped:
            return 0.0
        if not polling:
            return self._idle_wait
        if polling == SOON or self._clock() - last_step < self._spin_seconds:
            return self._spin_wait
        return self._poll_wait

    def _run(self) -> None:
        stepped = polling = False
        last_step = 0.0
        failures = 0
        while not self._stop.is_set():
            wait = self._wait(stepped, polling, last_step)
            ran = self._drain(wait)
            if ran or not wait:
                # a thread the last closures or step woke (the asyncio thread, handed a token or
                # a result) runs now rather than when the scheduler next preempts this one
                yield_cpu()
            stepped = polling = False
            for poll in self._pollers:
                try:
                    answer = poll()
                except Exception:
                    log.exception("poller failed")
                    continue
                if answer == SOON or (answer and not polling):
                    polling = answer
            if self.has_work() and self.step_fn is not None:
                try:
                    self.step_fn()
                    failures = 0
                except Exception as e:
                    failures += 1
                    log.exception("engine step failed (%d of %d in a row)", failures, self.max_step_failures)
                    if failures >= self.max_step_failures:
                        self._give_up(e)
                        break
                    time.sleep(0.1)  # do not spin on a persistent failure
                stepped, last_step = True, self._clock()
            if self.on_iteration is not None:
                self.on_iteration()
        self._stop.set()
        # fail whatever is still queued so no caller waits forever
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].set_exception(RuntimeError("the engine loop stopped"))
