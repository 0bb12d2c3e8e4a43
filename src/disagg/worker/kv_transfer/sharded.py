"""The KV transport of a tensor-parallel worker, as its rank 0 (the engine's process) sees it.

Every rank owns a transport over its own part of the cache: rank 0's lives here, the others in
their processes (`rank_service.RankKV`). This class offers the worker what one `KVTransport`
offers, so the serving code is the same for any number of ranks:

- handshake: rank 0's payload, carrying every rank's payload (`rank_payloads`, index = rank).
  Every rank of a sender reads the whole payload and writes the KV heads it holds into the
  receiver's ranks that own them: rank r into rank r when both split the model alike, else the
  head copies of `tp_layout.head_copies` (see `NixlTransport.add_peer`).
- sending: each `send` / `finish` runs on rank 0 and is posted to every other rank, which sends
  the same blocks of its own heads after its part of the step. The handle `finish` returns is
  done once every rank's sends of the transfer are done, and fails if any rank's fails.
- receiving: `accept` / `forget` go to every rank; a transfer completes once it has landed on
  every rank, and fails as soon as it fails on one. That failure reads as an abort (nothing more
  will land: `serving.kv_receiver.settles`) only once every rank settled (completed, or aborted by all
  its senders): then a second failure, "aborted: on every tensor-parallel rank", says so.
"""

from __future__ import annotations

import logging

from disagg.proto import kv_transfer_pb2 as pb
from disagg.worker.kv_transfer.handle import DONE, ERROR, PENDING, TransferHandle, finished_handle
from disagg.worker.kv_transfer.rank_service import FACTORY, SERVICE

log = logging.getLogger(__name__)


class ShardedTransport:
    def __init__(self, local, ranks, kind: str, name: str, host: str):
        """`local`: rank 0's transport; `ranks`: the other ranks' processes (`RankProcesses`)."""
        self.local = local
        self.ranks = ranks
        self.backend = local.backend
        self.world_size = ranks.world_size
        layout = local.layout
        fields = {f: getattr(layout, f) for f in ("model_id", "tp_size", "model_kv_heads", "kv_cache_dtype",
                                                  "weight_quantization")}  # fmt: skip
        for r in self._children:  # a rank on another host binds its own host's interface
            ranks.install_on(r, SERVICE, FACTORY, kind, name, ranks.host_of(r) or host, fields)
        payloads = [local.handshake_payload()]
        payloads += [ranks.ask(r, SERVICE, "handshake_payload") for r in self._children]
        msg = pb.KVHandshake()
        msg.ParseFromString(payloads[0])
        msg.rank_payloads.extend(payloads)
        self._payload = msg.SerializeToString()
        self._expected: dict[str, set[int]] = {}  # transfer id -> ranks it has not landed on yet
        # transfer id failed on a rank -> ranks where it has not settled yet (until forgotten)
        self._failing: dict[str, set[int]] = {}
        self._landed: list[str] = []
        self._failed: list[tuple[str, str]] = []
        self._finishing: dict[tuple[str, str], FinishHandle] = {}
        self._send_polls = 0  # rounds of `_poll_sends` so far

    @property
    def _children(self) -> range:
        return range(1, self.world_size)

    @property
    def layout(self):
        return self.local.layout

    # ---- peers -------------------------------------------------------------------------------
    def handshake_payload(self) -> bytes:
        return self._payload

    def add_peer(self, peer_id: str, payload: bytes, address: str | None = None) -> None:
        """Every rank adds the peer from its whole payload and picks the peer's ranks it writes
        into (refusing a peer it cannot write into, saying why)."""
        self.local.add_peer(peer_id, payload)
        try:
            for r in self._children:
                self.ranks.ask(r, SERVICE, "add_peer", peer_id, payload)
        except BaseException:
            self.remove_peer(peer_id)
            raise

    def remove_peer(self, peer_id: str) -> None:
        self.local.remove_peer(peer_id)
        self.ranks.post(SERVICE, "remove_peer", peer_id)

    def has_peer(self, peer_id: str) -> bool:
        return self.local.has_peer(peer_id)

    def peers(self) -> list[str]:
        return self.local.peers()

    # ---- sender ------------------------------------------------------------------------------
    def send(self, peer_id, transfer_id, src_block_ids, dst_block_ids, layers=None, timeout=None):
        handle = self.local.send(peer_id, transfer_id, src_block_ids, dst_block_ids, layers, timeout)
        self.ranks.post(SERVICE, "send", peer_id, transfer_id, list(src_block_ids), list(dst_block_ids),
                        None if layers is None else list(layers))  # fmt: skip
        return handle

    def finish(
        self, peer_id: str, transfer_id: str, timeout: float | None = None, first_token: int | None = None
    ) -> TransferHandle:
        """The first token rides on rank 0's FINAL only (the receiver reads it from its rank 0, and
        otherwise waits for the Prefill answer)."""
        self.ranks.post(SERVICE, "finish", peer_id, transfer_id)
        local = self.local.finish(peer_id, transfer_id, timeout, first_token)
        timeout = self.local.default_timeout if timeout is None else timeout
        handle = FinishHandle(self, local, timeout)
        self._finishing[(peer_id, transfer_id)] = handle
        return handle

    def abort(self, peer_id: str, transfer_id: str, reason: str) -> TransferHandle:
        """Every rank sends its ABORT notice once its own sends of the transfer settled; the
        handle settles once every rank's has (the source blocks are free to reuse from then)."""
        self.ranks.post(SERVICE, "abort", peer_id, transfer_id, reason)
        local = self.local.abort(peer_id, transfer_id, reason)
        if local is None:
            local = finished_handle(self.backend, peer_id, transfer_id)
        # each rank's sends are bounded by its own timeout, then its notice by another
        handle = FinishHandle(self, local, 2 * self.local.default_timeout)
        self._finishing[(peer_id, transfer_id)] = handle
        return handle

    def _poll_sends(self) -> None:
        """One question per child: how its sends of every unsettled `finish` stand."""
        pending = [k for k, h in self._finishing.items() if h.state == PENDING]
        if not pending:
            return
        self._send_polls += 1
        for r in self._children:
            reply = self.ranks.ask(r, SERVICE, "poll", pending, self._receiving)
            self._take_receipts(r, reply)
            for key, state in reply["sends"].items():
                handle = self._finishing.get(key)
                if handle is not None:
                    handle.settle_rank(r, state)

    # ---- receiver ----------------------------------------------------------------------------
    def accept(self, transfer_id: str, block_ids: list[int]) -> None:
        self.local.accept(transfer_id, block_ids)
        self.ranks.post(SERVICE, "accept", transfer_id, list(block_ids))
        self._expected[transfer_id] = set(range(self.world_size))

    def forget(self, transfer_id: str) -> None:
        self.local.forget(transfer_id)
        self.ranks.post(SERVICE, "forget", transfer_id)
        self._expected.pop(transfer_id, None)
        self._failing.pop(transfer_id, None)

    def take_first_token(self, transfer_id: str) -> int | None:
        return self.local.take_first_token(transfer_id)

    def finishing(self) -> bool:
        return self.local.finishing()

    def poll_completed(self) -> list[str]:
        self._poll_receivers()
        landed, self._landed = self._landed, []
        return landed

    def poll_failed(self) -> list[tuple[str, str]]:
        self._poll_receivers()
        failed, self._failed = self._failed, []
        return failed

    def _poll_receivers(self) -> None:
        self._take_receipts(0, {"completed": self.local.poll_completed(), "failed": self.local.poll_failed()})
        if self._receiving:
            for r in self._children:
                self._take_receipts(r, self.ranks.ask(r, SERVICE, "poll", [], True))

    def _take_receipts(self, rank: int, reply: dict) -> None:
        for peer_id in reply.get("evicted", ()):
            if self.local.has_peer(peer_id):
                log.warning("KV peer %s evicted by tensor-parallel rank %d: dropping it on every rank",
                            peer_id, rank)  # fmt: skip
                self.remove_peer(peer_id)
        for tid, reason in reply.get("failed", ()):
            waiting = self._expected.pop(tid, None)
            if waiting is not None:
                # the other ranks' senders may still be writing: not an abort of the whole yet
                self._failed.append((tid, f"tensor-parallel rank {rank}: {reason}"))
                self._failing[tid] = waiting  # the ranks it landed on already are settled
            if reason.startswith("aborted"):  # a stall or a lost sender never settles a rank
                self._settle_rank(tid, rank)
        for tid in reply.get("completed", ()):
            self._settle_rank(tid, rank)
            waiting = self._expected.get(tid)
            if waiting is None:
                continue
            waiting.discard(rank)
            if not waiting:
                del self._expected[tid]
                self._landed.append(tid)

    @property
    def _receiving(self) -> bool:
        return bool(self._expected or self._failing)

    def _settle_rank(self, tid: str, rank: int) -> None:
        """A failed transfer completed or was aborted on `rank`: once so on every rank, nothing
        more of it will land."""
        ranks = self._failing.get(tid)
        if ranks is None:
            return
        ranks.discard(rank)
        if not ranks:
            self.forget(tid)
            self._failed.append((tid, "aborted: on every tensor-parallel rank"))

    def close(self) -> None:
        self.local.close()
        try:
            self.ranks.post(SERVICE, "close")
        except Exception as exc:  # the ranks are gone already: nothing to close there
            log.debug("closing the ranks' KV transports: %s", exc)


class FinishHandle(TransferHandle):
    """Done once rank 0's `finish` is done and every other rank reports its sends done."""

    def __init__(self, transport: ShardedTransport, local: TransferHandle, timeout: float):
        super().__init__(transport.backend, local.peer_id, local.request_id, 0, timeout, counts_bytes=False)
        self._transport = transport
        self._local = local
        self._waiting = set(transport._children)
        self._seen_polls = transport._send_polls

    def settle_rank(self, rank: int, state) -> None:
        if rank not in self._waiting:
            return  # settled already: asked again for another handle, it no longer knows the key
        if state == DONE:
            self._waiting.discard(rank)
        elif state != PENDING:
            kind, reason = state
            self._drop()
            self.fail(kind, reason)

    def _check(self) -> None:
        local = self._local.poll()
        if local == ERROR:
            self._drop()
            self.fail(self._local.error_kind, self._local.reason)
            return
        if self._waiting:
            # one round answers every pending finish: ask again only once this handle has seen
            # the last round's answer (polling N handles costs one round, not N)
            if self._seen_polls == self._transport._send_polls:
                self._transport._poll_sends()
            self._seen_polls = self._transport._send_polls
        if self.state == PENDING and local == DONE and not self._waiting:
            self._drop()
            self.succeed()

    def _cancel(self) -> None:
        self._drop()

    def _drop(self) -> None:
        key = (self.peer_id, self.request_id)
        if self._transport._finishing.get(key) is self:  # not the abort that replaced it
            del self._transport._finishing[key]
