"""The worker's Redis link (`serving/state_link.py`) against a real Redis."""

from __future__ import annotations

import asyncio


def test_a_deregistered_worker_stays_out_of_the_registry_while_its_upkeep_was_running(redis_url):
    """Heartbeats every millisecond up to the moment the worker leaves: none may write its entry
    back after the delete (the heartbeat re-registers an entry it finds gone)."""
    from disagg.worker.kv_state import KVState, WorkerInfo
    from disagg.worker.serving.state_link import StateLink

    info = WorkerInfo(id="decode-0", role="decode", address="127.0.0.1:1")
    kv, observer = KVState(redis_url, "leave", "decode-0"), KVState(redis_url, "leave", "observer")
    link = StateLink(kv, info, heartbeat_seconds=0.001, reap_seconds=3600)

    def listed() -> bool:
        return "decode-0" in {w.id for w in observer.workers()}

    async def run() -> bool:
        await link.register()
        link.start(lambda: {}, lambda request_id: None)
        while kv.heartbeat_count < 20:  # upkeep under way
            await asyncio.sleep(0.001)
        await link.deregister()
        beats = kv.heartbeat_count
        await asyncio.sleep(0.2)  # ~200 heartbeat periods
        await link.stop()
        return kv.heartbeat_count == beats

    counting = kv.heartbeat

    def heartbeat(*args, **kwargs):
        kv.heartbeat_count += 1
        return counting(*args, **kwargs)

    kv.heartbeat_count = 0
    kv.heartbeat = heartbeat
    try:
        quiet_after = asyncio.run(run())
        assert not listed() and quiet_after
    finally:
        kv.close()
        observer.close()
