"""The KV transport of a tensor-parallel rank other than 0, run inside that rank's process.

Rank 0 installs it in every child (`RankProcesses.install`) and drives it over the control
connection: sends, `finish`, `accept` and `forget` are posted (run after the step the child is
in, in order), and one `poll` per child between steps answers how this rank's sends of each
transfer went and which incoming transfers landed or failed here. The transport is the same
class rank 0 uses, over this rank's part of the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from disagg.worker.kv_transfer.handle import DONE, ERROR, PENDING, finished_handle
from disagg.worker.kv_transfer.layout import KVLayout

log = logging.getLogger(__name__)

SERVICE = "kv"
FACTORY = f"{__name__}:RankKV"


@dataclass
class _Sending:
    """This rank's sends of one (peer, transfer), until rank 0 hears how they ended."""

    handles: list = field(default_factory=list)
    finished: bool = False
    failure: tuple[str, str] | None = None  # (error kind, reason)


class RankKV:
    def __init__(self, runner, rank: int, kind: str, name: str, host: str, layout_fields: dict):
        """`layout_fields`: rank 0's layout but for the shape (model id, ranks, the model's KV
        heads, how values are stored): every rank of a worker describes its cache alike."""
        from disagg.worker.kv_transfer import create_transport

        if kind == "nixl":
            from disagg.worker.kv_transfer.nixl_transport import restrict_ucx_to

            restrict_ucx_to(host)
        layout = KVLayout.from_tensor(runner.kv_cache, **layout_fields)
        self.rank = rank
        self.transport = create_transport(kind, runner.kv_cache, layout, f"{name}-r{rank}", tp_rank=rank)
        self.sending: dict[tuple[str, str], _Sending] = {}
        self.aborting: dict[tuple[str, str], object] = {}  # (peer, transfer) -> its abort's handle
        self.peers: set[str] = set()  # added by rank 0 and not removed since
        self.closed = False

    def handshake_payload(self) -> bytes:
        return self.transport.handshake_payload()

    def add_peer(self, peer_id: str, payload: bytes) -> None:
        self.transport.add_peer(peer_id, payload)
        self.peers.add(peer_id)

    def remove_peer(self, peer_id: str) -> None:
        self.peers.discard(peer_id)
        self.transport.remove_peer(peer_id)

    # ---- sender (posted) ---------------------------------------------------------------------
    def send(self, peer_id: str, transfer_id: str, src: list[int], dst: list[int], layers) -> None:
        sending = self.sending.setdefault((peer_id, transfer_id), _Sending())
        if sending.failure is not None:
            return
        try:
            sending.handles.append(self.transport.send(peer_id, transfer_id, src, dst, layers))
        except Exception as exc:  # UnknownPeer (evicted), bad ids: the transfer fails on this rank
            sending.failure = ("error", f"rank {self.rank}: {type(exc).__name__}: {exc}")

    def finish(self, peer_id: str, transfer_id: str) -> None:
        sending = self.sending.setdefault((peer_id, transfer_id), _Sending())
        sending.finished = True
        if sending.failure is not None:
            self.transport.abort(peer_id, transfer_id, sending.failure[1])
            return
        try:
            sending.handles.append(self.transport.finish(peer_id, transfer_id))
        except Exception as exc:
            sending.failure = ("error", f"rank {self.rank}: {type(exc).__name__}: {exc}")

    def abort(self, peer_id: str, transfer_id: str, reason: str) -> None:
        """The notice goes out once this rank's sends of the transfer settled; rank 0 hears
        "done" from `poll` after that."""
        self.sending.pop((peer_id, transfer_id), None)
        try:
            handle = self.transport.abort(peer_id, transfer_id, reason)
        except Exception as exc:
            log.debug("abort notice for %s from rank %d failed: %s", transfer_id, self.rank, exc)
            handle = None
        # None: no notice to wait for (the peer is unknown here, or the notice failed)
        self.aborting[(peer_id, transfer_id)] = handle or finished_handle("", peer_id, transfer_id)

    # ---- receiver (posted) -------------------------------------------------------------------
    def accept(self, transfer_id: str, block_ids: list[int]) -> None:
        self.transport.accept(transfer_id, block_ids)

    def forget(self, transfer_id: str) -> None:
        self.transport.forget(transfer_id)

    # ---- asked between steps -----------------------------------------------------------------
    def poll(self, transfers: list[tuple[str, str]], receiving: bool) -> dict:
        """How this rank's sends of `transfers` stand ("pending", "done", or (kind, reason) of
        the first error; settled ones are dropped here), the peers it evicted, and, when
        `receiving`, the transfers that landed in or failed on this rank since the last poll."""
        sends = {}
        for key in transfers:
            aborting = self.aborting.get(key)
            if aborting is not None:  # "done" once the notice went out after this rank's sends
                if aborting.poll() == PENDING:
                    sends[key] = "pending"
                else:
                    sends[key] = "done"
                    del self.aborting[key]
                continue
            sending = self.sending.get(key)
            if sending is None:
                sends[key] = ("error", f"rank {self.rank} has no sends of transfer {key[1]!r}")
                continue
            states = [h.poll() for h in sending.handles]
            bad = next((h for h in sending.handles if h.state == ERROR), None)
            if sending.failure is None and bad is not None:
                sending.failure = (bad.error_kind, f"rank {self.rank}: {bad.reason}")
            if sending.failure is not None:
                sends[key] = sending.failure
            elif sending.finished and all(s == DONE for s in states):
                sends[key] = "done"
            else:
                sends[key] = "pending"
                continue
            del self.sending[key]
        # peers this rank's transport evicted after a send failed (disconnect, timeout): rank 0
        # drops them everywhere, so the next request handshakes again
        evicted = [p for p in self.peers if not self.transport.has_peer(p)]
        self.peers.difference_update(evicted)
        result = {"sends": sends, "evicted": evicted}
        if receiving:
            result["completed"] = self.transport.poll_completed()
            result["failed"] = self.transport.poll_failed()
        return result

    def close(self) -> None:
        """Idempotent: rank 0 closes it when the worker drains, the rank again when it stops."""
        if not self.closed:
            self.closed = True
            self.transport.close()
