"""A worker pool of one scripted in-process worker, for router tests that need a stream but no
engine: `Generate` answers the tokens a test gives, as a decode worker's messages would; a call
the test marks `hold_open` then goes on generating (sends nothing more) until it is cancelled.
The pool records each request, each stream that ended, and each abort."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from disagg.proto import worker_pb2 as pb
from disagg.worker.router.policy import WorkerView


def messages(texts: list[str], finish: str, prompt_tokens: int = 3) -> list[pb.GenerateResponse]:
    """One message per text (one token each), the first naming the worker, the last finishing."""
    out = []
    for i, text in enumerate(texts):
        m = pb.GenerateResponse(token_ids=[100 + i], text=text)
        if i == 0:
            m.served_by.CopyFrom(pb.ServedBy(decode_worker="w0"))
        out.append(m)
    out[-1].finish_reason = finish
    out[-1].usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(texts)))
    return out


class _Call:
    def __init__(self, pool: FakePool, items: list[pb.GenerateResponse], hold_open: bool):
        self._pool, self._items, self._hold_open = pool, items, hold_open
        self._it = self._gen()

    def __aiter__(self):  # one stream, however often it is asked for (as a gRPC call)
        return self._it

    async def _gen(self):
        for i, m in enumerate(self._items):
            if self._pool.on_message is not None:
                self._pool.on_message(i)
            yield m
            for _ in range(5):  # the router relays (and writes) this message before the next arrives
                await asyncio.sleep(0)
        if self._hold_open:
            await asyncio.Event().wait()  # still generating: only a cancel ends it
        self._pool.ended += 1

    def cancel(self) -> None:
        pass


class _Stub:
    def __init__(self, pool: FakePool):
        self.pool = pool

    def Generate(self, req, timeout=None):  # noqa: N802 (the gRPC method's name)
        self.pool.requests.append(req)
        return _Call(self.pool, self.pool.script(req), self.pool.hold_open(req))

    async def Abort(self, req, timeout=None):  # noqa: N802
        self.pool.aborts.append(req.request_id)
        return pb.AbortResponse()


class FakePool:
    """What the router uses of a `WorkerPool`, with one ready colocated worker."""

    registry_ok = True
    registry_problem = None
    uses_registry = False
    refresh_seconds = 0.01

    def __init__(self, script: Callable[[pb.GenerateRequest], list[pb.GenerateResponse]],
                 on_message: Callable[[int], None] | None = None,
                 hold_open: Callable[[pb.GenerateRequest], bool] = lambda req: False):  # fmt: skip
        self.script, self.on_message, self.hold_open = script, on_message, hold_open
        self.requests: list[pb.GenerateRequest] = []
        self.ended = 0  # streams that sent their last message
        self.aborts: list[str] = []  # request ids the router aborted
        self.view = WorkerView("w0", "both", "fake:0", free_blocks=100, total_blocks=100)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def next_refresh(self, timeout: float) -> None:
        pass

    def views(self) -> list[WorkerView]:
        return [self.view]

    def all_views(self):
        return [(self.view, True, self.view.address)]

    def stub(self, address: str) -> _Stub:
        return _Stub(self)

    def begin(self, worker_id: str) -> None:
        pass

    def end(self, worker_id: str) -> None:
        pass

    def mark_failed(self, worker_id: str) -> None:
        pass
