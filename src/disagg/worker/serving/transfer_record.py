"""A remote prefill's transfer record in Redis, across its attempts (the decode worker's
asyncio side).

The record leases the transfer's blocks in the deployment's state: while it lives, the reaper
leaves them alone; once its lease runs out (its decode worker died), the reaper has both workers
reclaim them. Each attempt moves the record to a new generation, which fences a prefill worker
still acting on an older attempt. Redis stays off the first token's path: the first attempt's
record is written while its Prefill call is out, and finished after the first token.
"""

from __future__ import annotations

import asyncio


class TransferRecord:
    """`generation()` is awaited through shield() everywhere: the lease renewal awaits it too,
    and a cancelled awaiter would otherwise cancel the record's write and every other awaiter's
    wait. `background` collects the tasks that outlive a request (finishing after the first
    token); the service awaits them when it closes."""

    def __init__(self, state, request_id: str, lease_seconds: float, background: set[asyncio.Task]):
        self.state = state
        self.request_id = request_id
        self.lease_seconds = lease_seconds
        self.background = background
        self._gen: asyncio.Future | None = None

    def begin(self, prefill_owner: str, blocks: list[int], previous: int = 0) -> None:
        """Start writing the record of an attempt (not awaited: see `generation`)."""
        self._gen = asyncio.ensure_future(self._begin(prefill_owner, blocks, previous))

    async def _begin(self, prefill_owner: str, blocks: list[int], previous: int) -> int:
        """`state.begin_transfer`, settled even when the request is cancelled meanwhile: the Redis
        write finishes in its thread regardless, and a record nobody finishes would hold the
        transfer's blocks in the index until its lease ran out."""
        begin = asyncio.ensure_future(
            self.state.begin_transfer(self.request_id, prefill_owner, blocks, self.lease_seconds, previous)
        )
        try:
            return await asyncio.shield(begin)
        except asyncio.CancelledError:
            gen = await begin
            await self.state.finish_transfer(self.request_id, gen)
            raise

    async def generation(self) -> int:
        return await asyncio.shield(self._gen)

    def renew(self) -> asyncio.Task:
        """Keep the current attempt's lease alive until the returned task is cancelled."""
        return asyncio.create_task(self._renew(self._gen))

    async def _renew(self, gen_future: asyncio.Future) -> None:
        gen = await asyncio.shield(gen_future)
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            await self.state.renew_transfer(self.request_id, gen, self.lease_seconds)

    async def finish(self) -> None:
        await self.state.finish_transfer(self.request_id, await self.generation())

    def finish_later(self) -> None:
        """Finish the record without holding the first token back for Redis."""
        gen_future = self._gen

        async def finish():
            await self.state.finish_transfer(self.request_id, await asyncio.shield(gen_future))

        task = asyncio.create_task(finish())
        self.background.add(task)
        task.add_done_callback(self.background.discard)
