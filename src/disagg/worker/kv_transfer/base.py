"""KVTransport: what both transports (NIXL, gRPC stream) offer to the worker.

Sender (prefill worker P), from the thread that owns the transport:
    add_peer(peer_id, payload)                      once per peer, payload from the peer's handshake
    h = send(peer_id, transfer_id, src, dst, layers)  nonblocking; any number per transfer
    finish(peer_id, transfer_id, first_token)       after the last send: tells the receiver how many
                                                    (and the token the prefill sampled, if given)
    abort(peer_id, transfer_id, reason)             the transfer will not complete (see below)
    h.poll() / h.wait(timeout)                      "pending" | "done" | "error" (+ h.reason)
Receiver (decode worker D), polled each engine step:
    poll_completed() -> [transfer_id]               every send of the transfer has landed
    poll_failed()    -> [(transfer_id, reason)]     the sender aborted, vanished, or stalled
    take_first_token(transfer_id) -> int | None     the token a completed transfer's FINAL carried
    finishing() -> bool                             a FINAL came, parts are still landing
    accept(transfer_id, block_ids)                  before asking a peer to send: the only blocks
                                                    that transfer may write (until it settles or
                                                    `forget`); the gRPC receiver refuses the rest

Writes are one-sided: a send posted before an abort may still land in the receiver's blocks. So
the ABORT notice goes out only once every send of the transfer has settled (done, failed, or
past its own timeout), and the handle `abort` returns settles after it: an ABORT notice, like a
FINAL's completion, means nothing more of that transfer will land, and the sender may reuse
its source blocks once that handle settled.

A send that errors evicts the peer when the cause is the connection (disconnect, timeout), so the
next send raises UnknownPeer and the caller handshakes again. Use a fresh transfer id per attempt
(e.g. request id + generation): ids that completed or failed are remembered and their late notices
dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from disagg.proto import kv_transfer_pb2 as pb
from disagg.worker.kv_transfer.errors import UnknownPeer
from disagg.worker.kv_transfer.handle import DONE, ERROR, PENDING, TransferHandle, finished_handle
from disagg.worker.kv_transfer.layout import KVLayout
from disagg.worker.kv_transfer.metrics import TRANSFER_BYTES, TRANSFER_FAILURES, TRANSFER_REFUSED
from disagg.worker.kv_transfer.tracker import ReceiveTracker

log = logging.getLogger(__name__)

# Error kinds after which the peer's cached handshake is dropped.
EVICTING_ERRORS = frozenset({"disconnect", "timeout"})


@dataclass
class _Outgoing:
    """Sends issued for one (peer, transfer) until `finish`."""

    parts: int = 0
    failure: str = ""


class KVTransport(ABC):
    backend: str = ""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        name: str,
        *,
        default_timeout: float = 30.0,
        stall_timeout: float | None = None,
    ):
        if not name:
            raise ValueError("name: a transport needs a non-empty name (the worker id)")
        if default_timeout <= 0:
            raise ValueError(f"default_timeout: must be positive, got {default_timeout}")
        layout.check_tensor(kv_cache)
        self.kv_cache = kv_cache
        self.layout = layout
        self.name = name
        self.default_timeout = default_timeout
        self.tracker = ReceiveTracker(stall_timeout)
        self._outgoing: dict[tuple[str, str], _Outgoing] = {}
        self._peer_layouts: dict[str, KVLayout] = {}
        # peer id -> how many ranks of this worker write into that peer (its FINAL says so)
        self._senders: dict[str, int] = {}
        # Notices still in flight: a gRPC call whose future is garbage-collected gets cancelled.
        self._notices: list[TransferHandle] = []
        # (peer, transfer) -> its sends not known to have settled (an abort waits for them)
        self._posted: dict[tuple[str, str], list[TransferHandle]] = {}
        # (peer, transfer) -> its abort, until the ABORT notice went out after its sends settled
        self._aborting: dict[tuple[str, str], AbortAfterSends] = {}
        # transfer id -> the blocks reserved for it (read by receiving server threads)
        self._accepting: dict[str, frozenset[int]] = {}
        self._accept_lock = threading.Lock()
        # transfer id -> the first token its FINAL carried, until taken or the transfer fails
        self._first_tokens: dict[str, int] = {}

    # ---- peers -------------------------------------------------------------------------------
    @abstractmethod
    def handshake_payload(self) -> bytes:
        """What a peer passes to `add_peer` to send blocks to this worker."""

    @abstractmethod
    def add_peer(self, peer_id: str, payload: bytes, address: str | None = None) -> None:
        """Cache a peer's handshake (replacing an older one). Raises IncompatiblePeer / ValueError."""

    @abstractmethod
    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer: sends to it turn into errors, and transfers it was sending to us that
        already started are reported by poll_failed (call this when the peer is known dead)."""

    def has_peer(self, peer_id: str) -> bool:
        return peer_id in self._peer_layouts

    def peers(self) -> list[str]:
        return list(self._peer_layouts)

    def _peer_layout(self, peer_id: str) -> KVLayout:
        try:
            return self._peer_layouts[peer_id]
        except KeyError:
            raise UnknownPeer(f"no handshake cached for peer {peer_id!r}: call add_peer first") from None

    # ---- sender ------------------------------------------------------------------------------
    def send(
        self,
        peer_id: str,
        transfer_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        layers: range | list[int] | None = None,
        timeout: float | None = None,
    ) -> TransferHandle:
        """Write our blocks `src_block_ids` into the peer's `dst_block_ids` for the given layers
        (all when None). Nonblocking; the source blocks must stay untouched until the handle is done."""
        if not transfer_id:
            raise ValueError("transfer_id: must be non-empty")
        src, dst = list(src_block_ids), list(dst_block_ids)
        if len(src) != len(dst):
            raise ValueError(f"dst_block_ids: {len(dst)} ids for {len(src)} src_block_ids")
        remote = self._peer_layout(peer_id)
        layers = range(self.layout.num_layers) if layers is None else layers
        src_regions = self.layout.region_indices(layers, src)
        try:
            dst_regions = remote.region_indices(layers, dst)
        except ValueError as exc:
            raise ValueError(f"dst_block_ids: {exc} on peer {peer_id!r}") from exc
        if not src_regions:
            return finished_handle(self.backend, peer_id, transfer_id)
        outgoing = self._outgoing.setdefault((peer_id, transfer_id), _Outgoing())
        outgoing.parts += 1
        timeout = self.default_timeout if timeout is None else timeout
        handle = self._post(peer_id, transfer_id, layers, src, dst, src_regions, dst_regions, timeout)
        if handle.state == PENDING:
            self._posted.setdefault((peer_id, transfer_id), []).append(handle)
        return handle

    def finish(
        self, peer_id: str, transfer_id: str, timeout: float | None = None, first_token: int | None = None
    ) -> TransferHandle:
        """Tell the receiver how many sends this transfer had; it completes once all have landed.
        `first_token` rides along, so the receiver can emit it as soon as the KV is complete.
        If a send already failed, the receiver is told to abort instead and the handle is an error."""
        outgoing = self._outgoing.pop((peer_id, transfer_id), _Outgoing())
        timeout = self.default_timeout if timeout is None else timeout
        if outgoing.failure:
            self.abort(peer_id, transfer_id, outgoing.failure)
            return finished_handle(self.backend, peer_id, transfer_id, ("aborted", outgoing.failure))
        self._peer_layout(peer_id)
        notice = pb.KVNotice(
            kind=pb.KVNotice.FINAL,
            request_id=transfer_id,
            parts=outgoing.parts,
            senders=self._senders.get(peer_id, 0),
        )
        if first_token is not None:
            notice.first_token = first_token
        return self._track_notice(self._notify(peer_id, notice, timeout))

    def abort(self, peer_id: str, transfer_id: str, reason: str) -> TransferHandle | None:
        """Tell the receiver this transfer will not complete, once its sends have settled; the
        handle settles after the notice went out (None: peer unknown, nothing can land). Calling
        it again for the same transfer returns the same handle."""
        key = (peer_id, transfer_id)
        self._outgoing.pop(key, None)
        if key in self._aborting:
            return self._aborting[key]
        sends = [h for h in self._posted.pop(key, ()) if h.state == PENDING]
        if not self.has_peer(peer_id):
            return None
        notice = pb.KVNotice(kind=pb.KVNotice.ABORT, request_id=transfer_id, reason=reason[:500],
                             senders=self._senders.get(peer_id, 0))  # fmt: skip
        if not sends:
            return self._track_notice(self._notify(peer_id, notice, self.default_timeout))
        handle = self._aborting[key] = AbortAfterSends(self, notice, peer_id, sends)
        return handle

    def _track_notice(self, handle: TransferHandle) -> TransferHandle:
        self._notices = [h for h in self._notices if h.poll() == PENDING]
        # sends that settled no longer hold back an abort: keep the table to transfers in flight
        for key in [k for k, sends in self._posted.items() if all(h.state != PENDING for h in sends)]:
            del self._posted[key]
        if handle.state == PENDING:
            self._notices.append(handle)
        return handle

    def _on_send_error(self, handle: TransferHandle) -> None:
        outgoing = self._outgoing.get((handle.peer_id, handle.request_id))
        reason = f"{handle.error_kind}: {handle.reason}"
        if outgoing is not None:
            outgoing.failure = outgoing.failure or reason  # `finish` will abort instead
        elif handle.bytes:
            # FINAL already went out counting this send, which will never land: abort now.
            self.abort(handle.peer_id, handle.request_id, reason)
        log.warning(
            "KV send %s to %s failed (%s): %s",
            handle.request_id,
            handle.peer_id,
            handle.error_kind,
            handle.reason,
        )
        if handle.error_kind in EVICTING_ERRORS and self.has_peer(handle.peer_id):
            self.remove_peer(handle.peer_id)

    @abstractmethod
    def _post(
        self, peer_id, transfer_id, layers, src, dst, src_regions, dst_regions, timeout
    ) -> TransferHandle:
        """Start moving the regions; return a pending (or settled) handle."""

    @abstractmethod
    def _notify(self, peer_id: str, notice: pb.KVNotice, timeout: float) -> TransferHandle:
        """Deliver a FINAL or ABORT notice after every earlier send of the same transfer was posted."""

    # ---- receiver ----------------------------------------------------------------------------
    def poll_completed(self) -> list[str]:
        """Transfer ids whose every send has landed in our cache (each reported once)."""
        self._pump()
        done = self.tracker.pop_completed()
        self._settled(done)
        return done

    def poll_failed(self) -> list[tuple[str, str]]:
        """(transfer id, reason) of incoming transfers that will not complete."""
        self._pump()
        failed = self.tracker.pop_failed()
        self._settled(t for t, _ in failed)
        for tid, reason in failed:
            self._first_tokens.pop(tid, None)
            TRANSFER_FAILURES.labels(self.backend, reason.split(":", 1)[0]).inc()
        return failed

    def forget(self, transfer_id: str) -> None:
        """Drop receive state of a transfer the caller gave up on (its late notices are ignored,
        its late writes refused where the transport can refuse them)."""
        self.tracker.forget(transfer_id)
        self._first_tokens.pop(transfer_id, None)
        with self._accept_lock:
            self._accepting.pop(transfer_id, None)

    def finishing(self) -> bool:
        """An incoming transfer's FINAL arrived and its last parts are landing: poll again soon."""
        return self.tracker.finishing()

    def take_first_token(self, transfer_id: str) -> int | None:
        """The token the completed transfer's FINAL carried (once; None if it carried none)."""
        return self._first_tokens.pop(transfer_id, None)

    def accept(self, transfer_id: str, block_ids: list[int]) -> None:
        """Expect `transfer_id` to write exactly into `block_ids` (the receiver's reservation)."""
        with self._accept_lock:
            self._accepting[transfer_id] = frozenset(block_ids)

    def accepts(self, transfer_id: str, block_ids) -> bool:
        """Whether `transfer_id` may write `block_ids`; a refusal is counted."""
        with self._accept_lock:
            allowed = self._accepting.get(transfer_id)
        if allowed is not None and allowed.issuperset(block_ids):
            return True
        TRANSFER_REFUSED.labels(self.backend).inc()
        log.warning("refused KV write of transfer %r into blocks it did not reserve", transfer_id)
        return False

    def _settled(self, transfer_ids) -> None:
        with self._accept_lock:
            for tid in transfer_ids:
                self._accepting.pop(tid, None)

    def _received(self, sender: str, transfer_id: str, nbytes: int) -> None:
        TRANSFER_BYTES.labels(self.backend, "recv").inc(nbytes)
        self.tracker.on_part(sender, transfer_id, nbytes)

    def _on_notice(self, sender: str, notice: pb.KVNotice) -> None:
        if notice.kind == pb.KVNotice.PART:
            self._received(sender, notice.request_id, notice.bytes)
        elif notice.kind == pb.KVNotice.FINAL:
            if notice.HasField("first_token"):  # before the FINAL can complete the transfer
                self._first_tokens[notice.request_id] = notice.first_token
            self.tracker.on_final(sender, notice.request_id, notice.parts, notice.senders)
        elif notice.kind == pb.KVNotice.ABORT:
            self.tracker.on_failure(sender, notice.request_id, f"aborted: {notice.reason}", notice.senders)
        else:
            log.warning("ignoring KV notice of unknown kind %s from %s", notice.kind, sender)

    def _pump(self) -> None:
        """Collect what arrived since the last poll (NIXL notifications); pushed transports have none."""
        return None

    def close(self) -> None:
        for peer_id in list(self._peer_layouts):
            self.remove_peer(peer_id)


class AbortAfterSends(TransferHandle):
    """An abort whose transfer still has sends in flight: polls them until each settled (their
    own deadlines bound the wait), then sends the ABORT notice and settles as that notice does."""

    def __init__(
        self, transport: KVTransport, notice: pb.KVNotice, peer_id: str, sends: list[TransferHandle]
    ):
        timeout = max(h._deadline for h in sends) - time.monotonic() + transport.default_timeout
        super().__init__(
            transport.backend, peer_id, notice.request_id, 0, max(timeout, 0.0), counts_bytes=False
        )
        self._transport = transport
        self._notice_msg = notice
        self._sends = sends
        self._notice: TransferHandle | None = None

    def _check(self) -> None:
        if self._notice is None:
            if any(h.poll() == PENDING for h in self._sends):
                return
            t = self._transport
            if not t.has_peer(self.peer_id):  # evicted meanwhile: nothing more can land there
                self._settle(None)
                return
            self._notice = t._track_notice(t._notify(self.peer_id, self._notice_msg, t.default_timeout))
        state = self._notice.poll()
        if state == DONE:
            self._settle(None)
        elif state == ERROR:
            self._settle(self._notice)

    def _settle(self, failed: TransferHandle | None) -> None:
        self._cancel()
        if failed is None:
            self.succeed()
        else:
            self.fail(failed.error_kind, failed.reason)

    def _cancel(self) -> None:
        key = (self.peer_id, self.request_id)
        if self._transport._aborting.get(key) is self:
            del self._transport._aborting[key]
