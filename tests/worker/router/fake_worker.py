"""A worker pool of one scripted in-process worker, for router tests that need a stream but no
engine: `Generate` answers the tokens a test gives, as a decode worker's messages would."""

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
    def __init__(self, items: list[pb.GenerateResponse], on_message: Callable[[int], None] | None):
        self._items, self._on_message = items, on_message
        self._it = self._gen()

    def __aiter__(self):  # one stream, however often it is asked for (as a gRPC call)
        return self._it

    async def _gen(self):
        for i, m in enumerate(self._items):
            if self._on_message is not None:
                self._on_message(i)
            yield m
            for _ in range(5):  # the router relays (and writes) this message before the next arrives
                await asyncio.sleep(0)

    def cancel(self) -> None:
        pass


class _Stub:
    def __init__(self, pool: FakePool):
        self.pool = pool

    def Generate(self, req, timeout=None):  # noqa: N802 (the gRPC method's name)
        self.pool.requests.append(req)
        return _Call(self.pool.script(req), self.pool.on_message)

    async def Abort(self, req, timeout=None):  # noqa: N802
        return pb.AbortResponse()


class FakePool:
    """What the router uses of a `WorkerPool`, with one ready colocated worker."""

    registry_ok = True
    registry_problem = None
    uses_registry = False
    refresh_seconds = 0.01

    def __init__(self, script: Callable[[pb.GenerateRequest], list[pb.GenerateResponse]],
                 on_message: Callable[[int], None] | None = None):  # fmt: skip
        self.script, self.on_message = script, on_message
        self.requests: list[pb.GenerateRequest] = []
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
