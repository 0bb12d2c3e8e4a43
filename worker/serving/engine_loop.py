"""The one thread that owns the engine (and the KV transport agent bound to its cache).

Everything that touches the engine runs here: gRPC handlers submit closures with `call()` and
await the returned future; `step()` outputs are handed to per-request sinks. Between engine
steps the loop runs submitted closures and the registered pollers (KV transfer completions,
sends in flight). When there is no work it sleeps on the command queue, so an idle worker
costs no CPU.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("disagg.worker.engine_loop")


class EngineFailed(RuntimeError):
    """The engine step kept failing: what every request still in the engine is told."""


class EngineLoop:
    def __init__(self, idle_wait: float = 0.05, max_step_failures: int = 5):
        """max_step_failures: consecutive failed engine steps after which the loop gives up:
        `on_fatal(error)` runs on this thread (fail the requests) and the loop stops, so liveness
        turns false and the process can exit instead of retrying forever."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._pollers: list[Callable[[], bool]] = []
        self._idle_wait = idle_wait
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

    def add_poller(self, poll: Callable[[], bool]) -> None:
        """`poll()` runs every iteration on the loop thread; it returns True while it has work."""
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

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread_id

    # ---- the loop -----------------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._idle_wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
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

    def _run(self) -> None:
        busy = False
        failures = 0
        while not self._stop.is_set():
            self._drain(block=not busy)
            busy = False
            for poll in self._pollers:
                try:
                    busy |= bool(poll())
                except Exception:
                    log.exception("poller failed")
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
                busy = True
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
