"""KV transport over NIXL (UCX): the sender WRITEs regions straight into the receiver's tensor.

The whole KV tensor is registered once and described as one descriptor per (layer, block)
region, prepared once locally and once per peer, so a send only picks indices. When the send's
regions form runs adjacent on both sides (consecutive block ids, as the block manager hands them
out), it is posted instead with one descriptor per run, built for that send. Each send carries
a PART notice as its NIXL notification, delivered after its data; FINAL and ABORT are plain
notifications. On CPU, UCX moves the bytes with CMA and notifications over TCP.

Threading: NIXL agents here run without their progress thread (it competes with the caller on
small machines), so progress happens when the owning thread polls: the sender polling its
handles, the receiver calling poll_completed each step.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from disagg.proto import kv_transfer_pb2 as pb
from disagg.worker.kv_transfer.base import KVTransport
from disagg.worker.kv_transfer.errors import IncompatiblePeer
from disagg.worker.kv_transfer.handle import TransferHandle, all_of, finished_handle
from disagg.worker.kv_transfer.handshake import (
    agent_name,
    decode_handshake,
    encode_handshake,
    parse_handshake,
)
from disagg.worker.kv_transfer.layout import KVLayout
from disagg.worker.kv_transfer.region_runs import find_runs, run_descriptors, segment_descriptors
from disagg.worker.kv_transfer.tp_layout import TPLayout, block_segments, head_copies
from disagg.worker.kv_transfer.ucx_env import check_ucx_env

log = logging.getLogger(__name__)

_PURGE_PROGRESS_CALLS = 10

DESCRIPTOR_MODES = ("auto", "prepped", "merged")
# "auto" builds per-send run descriptors when runs cut the descriptor count at least this much.
# Measured (bench/kv_transfer.py, 2-core CPU, CMA): each descriptor costs ~2-3 us of UCX work on
# the posting thread whichever path built it, because NIXL merges adjacent prepared regions
# itself; the per-send path skips that merge pass and is 3-15% faster from runs of 4 regions up,
# on par at 1-2, where the prepared path saves building the tables.
MERGE_RATIO = 2
# UCX worker threads that share a send's descriptors (NIXL's num_threads; idle threads cost no CPU).
# Measured: a send of ids from real churned allocators (thousands of descriptors) went from 26% to
# ~46% of an in-process copy_ with 2; one large contiguous run does not split and stays ~3 GiB/s.
DEFAULT_THREADS = 2


def _error_kind(exc: Exception) -> str:
    text = f"{type(exc).__name__} {exc}"
    return "disconnect" if "Disconnect" in text or "DISCONNECT" in text else "error"


_SIOCGIFADDR = 0x8915


def _interface_of(address: str) -> str | None:
    """The network interface holding IPv4 `address` (Linux), None if none does."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def restrict_ucx_to(host: str) -> str | None:
    """Make UCX (NIXL's notifications and TCP lanes) listen only on the interface of `host`, the
    address the worker binds, by setting UCX_NET_DEVICES before an agent is created. Left alone
    when already set or when `host` means every interface; returns the value in effect."""
    if os.environ.get("UCX_NET_DEVICES") or host in ("", "0.0.0.0", "::", "[::]"):
        return os.environ.get("UCX_NET_DEVICES")
    device = "lo" if host.startswith("127.") or host == "localhost" else _interface_of(host)
    if device is None:
        raise RuntimeError(f"no network interface holds {host}: set UCX_NET_DEVICES for NIXL explicitly")
    os.environ["UCX_NET_DEVICES"] = device
    return device


def _region_table(base: int, layout: KVLayout, device_id: int) -> np.ndarray:
    """Nx3 (address, length, device) of every region, index = layer * num_blocks + block."""
    table = np.empty((layout.num_regions, 3), dtype=np.uint64)
    table[:, 0] = base + np.arange(layout.num_regions, dtype=np.uint64) * np.uint64(layout.block_bytes)
    table[:, 1] = layout.block_bytes
    table[:, 2] = device_id
    return table


class _Peer:
    def __init__(self, agent_name: str, dlist, layout: KVLayout, base: int, mem_type: str, device_id: int,
                 segments: np.ndarray | None = None):  # fmt: skip
        # segments: rows (src offset, dst offset, length) of the bytes of each (layer, block)
        # region that go to this peer; None: whole regions
        self.segments = segments
        self.agent_name = agent_name
        self.sender_name = agent_name  # how its notices name it when it sends to us
        self.dlist = dlist
        self.layout = layout
        self.base = base
        self.mem_type = mem_type
        self.device_id = device_id
        self.handles: set[NixlHandle] = set()


class NixlHandle(TransferHandle):
    def __init__(self, transport: NixlTransport, xfer, peer: _Peer, **kw):
        super().__init__(**kw)
        self._transport = transport
        self._xfer = xfer
        self._peer = peer
        peer.handles.add(self)

    def _check(self) -> None:
        try:
            status = self._transport.agent.check_xfer_state(self._xfer)
        except Exception as exc:
            self._settle_error(_error_kind(exc), f"{type(exc).__name__}: {exc}")
            return
        if status == "DONE":
            self._release()
            self.succeed()
        elif status == "ERR":
            self._settle_error("error", "NIXL reported the transfer failed")

    def _settle_error(self, kind: str, reason: str) -> None:
        self._release()
        self.fail(kind, reason)

    def _cancel(self) -> None:
        self._release()

    def _release(self) -> None:
        self._peer.handles.discard(self)
        if self._xfer is not None:
            xfer, self._xfer = self._xfer, None
            try:
                self._transport.agent.release_xfer_handle(xfer)
            except Exception as exc:  # an active transfer that cannot be cancelled
                log.debug("releasing a NIXL transfer handle failed: %s", exc)


class NixlTransport(KVTransport):
    backend = "nixl"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        name: str,
        *,
        descriptors: str = "auto",
        threads: int | None = None,
        tp_rank: int = 0,
        **kw,
    ):
        """tp_rank: which rank of its tensor-parallel worker this transport's cache belongs to."""
        super().__init__(kv_cache, layout, name, **kw)
        if not 0 <= tp_rank < layout.tp_size:
            raise ValueError(f"tp_rank: must be in [0, {layout.tp_size}), got {tp_rank}")
        self.tp_rank = tp_rank
        # peer id -> the ids of that peer's ranks we write heads into (a peer split differently)
        self._fanout: dict[str, list[str]] = {}
        if descriptors not in DESCRIPTOR_MODES:
            raise ValueError(f"descriptors: must be one of {DESCRIPTOR_MODES}, got {descriptors!r}")
        if threads is None:
            threads = int(os.environ.get("DISAGG_NIXL_THREADS", DEFAULT_THREADS))
        if threads < 0:
            raise ValueError(f"threads: must be >= 0, got {threads}")
        self.descriptors = descriptors
        self.last_descriptors = 0  # descriptors in the latest send, for benchmarks and metrics
        check_ucx_env(cuda=kv_cache.is_cuda)
        # NIXL logs every agent creation at INFO on stdout; keep worker output to warnings unless asked.
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent_name = agent_name(name)
        self.agent = nixl_agent(
            self.agent_name,
            nixl_agent_config(enable_prog_thread=False, backends=["UCX"], num_threads=threads),
        )
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self._registration = self.agent.register_memory(kv_cache)
        table = _region_table(kv_cache.data_ptr(), layout, self.device_id)
        self._local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, self.mem_type)
        self._metadata = self.agent.get_agent_metadata()  # after registering: the snapshot includes it
        self._peers: dict[str, _Peer] = {}

    def handshake_payload(self) -> bytes:
        return encode_handshake(
            self.layout,
            self.backend,
            self.agent_name,
            agent_metadata=self._metadata,
            base_address=self.kv_cache.data_ptr(),
            mem_type=self.mem_type,
            device_id=self.device_id,
        )

    def add_peer(self, peer_id: str, payload: bytes, address: str | None = None) -> None:
        """`address` is unused: NIXL finds the peer from its agent metadata. A tensor-parallel
        peer's payload holds each of its ranks' handshakes: split like us, our rank r writes
        into its rank r; split otherwise, into each rank that owns heads this rank holds."""
        msg = parse_handshake(payload)
        rank_payloads = list(msg.rank_payloads) or [bytes(payload)]
        peer_tp = (msg.layout.tp_size or 1, msg.layout.model_kv_heads or msg.layout.num_kv_heads)
        if peer_id in self._peers or peer_id in self._fanout:
            self.remove_peer(peer_id)
        if len(rank_payloads) != peer_tp[0]:
            raise ValueError(f"payload: {len(rank_payloads)} rank handshakes for a peer of TP={peer_tp[0]}")
        if peer_tp == self.layout.tp_key:
            self._add_rank(peer_id, rank_payloads[self.tp_rank])
        else:
            self._add_fanout(peer_id, TPLayout(*peer_tp), rank_payloads)

    def _add_fanout(self, peer_id: str, peer_tp: TPLayout, rank_payloads: list[bytes]) -> None:
        if self.layout.kv_cache_dtype != "auto":
            raise IncompatiblePeer(
                f"the peer splits the model's KV heads differently (TP={peer_tp.tp_size}, here "
                f"TP={self.layout.tp_size}), and head segments of a {self.layout.kv_cache_dtype} KV cache "
                "(values with scales) are not supported: use equal tensor-parallel sizes"
            )
        mine = TPLayout(self.layout.tp_size, self.layout.model_kv_heads)
        copies = head_copies(mine, peer_tp)
        head_bytes = self.layout.head_dim * self.layout.itemsize
        subs: list[str] = []
        try:
            for copy in copies:
                if copy.src_rank != self.tp_rank:
                    continue
                segments = block_segments(copy, mine, peer_tp, self.layout.block_size, head_bytes)
                sub = f"{peer_id}#rank{copy.dst_rank}"
                self._add_rank(sub, rank_payloads[copy.dst_rank], np.asarray(segments, dtype=np.uint64))
                self._senders[sub] = len({c.src_rank for c in copies if c.dst_rank == copy.dst_rank})
                subs.append(sub)
        except BaseException:
            for sub in subs:
                self.remove_peer(sub)
            raise
        self._fanout[peer_id] = subs

    def _add_rank(self, peer_id: str, payload: bytes, segments: np.ndarray | None = None) -> None:
        msg, remote = decode_handshake(payload, self.layout, self.backend, cross_tp=segments is not None)
        if msg.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"payload: mem_type must be DRAM or VRAM, got {msg.mem_type!r}")
        name = self.agent.add_remote_agent(msg.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        table = _region_table(msg.base_address, remote, msg.device_id)
        try:
            dlist = self.agent.prep_xfer_dlist(name, table, msg.mem_type)
        except Exception:
            self.agent.remove_remote_agent(name)
            raise
        self._peers[peer_id] = _Peer(
            name, dlist, remote, msg.base_address, msg.mem_type, msg.device_id, segments
        )
        self._peer_layouts[peer_id] = remote

    def has_peer(self, peer_id: str) -> bool:
        subs = self._fanout.get(peer_id)
        if subs is None:
            return super().has_peer(peer_id)
        return all(sub in self._peers for sub in subs)  # a rank evicted: handshake again

    def send(self, peer_id, transfer_id, src_block_ids, dst_block_ids, layers=None, timeout=None):
        subs = self._fanout.get(peer_id)
        if subs is None:
            return super().send(peer_id, transfer_id, src_block_ids, dst_block_ids, layers, timeout)
        handles = [super(NixlTransport, self).send(sub, transfer_id, src_block_ids, dst_block_ids, layers,
                                                   timeout) for sub in subs]  # fmt: skip
        return all_of(self.backend, peer_id, transfer_id, handles)

    def finish(
        self, peer_id: str, transfer_id: str, timeout: float | None = None, first_token: int | None = None
    ) -> TransferHandle:
        subs = self._fanout.get(peer_id)
        if subs is None:
            return super().finish(peer_id, transfer_id, timeout, first_token)
        handles = [super(NixlTransport, self).finish(sub, transfer_id, timeout, first_token) for sub in subs]
        return all_of(self.backend, peer_id, transfer_id, handles)

    def abort(self, peer_id: str, transfer_id: str, reason: str) -> TransferHandle | None:
        subs = self._fanout.get(peer_id)
        if subs is None:
            return super().abort(peer_id, transfer_id, reason)
        handles = [super(NixlTransport, self).abort(sub, transfer_id, reason) for sub in subs]
        return all_of(self.backend, peer_id, transfer_id, [h for h in handles if h is not None])

    def remove_peer(self, peer_id: str) -> None:
        for sub in self._fanout.pop(peer_id, ()):
            self.remove_peer(sub)
        self._senders.pop(peer_id, None)
        peer = self._peers.pop(peer_id, None)
        self._peer_layouts.pop(peer_id, None)
        if peer is None:
            return
        self.tracker.fail_sender(peer.sender_name, f"disconnect: peer {peer_id} removed")
        for handle in list(peer.handles):
            handle._settle_error("disconnect", f"peer {peer_id} removed")
        try:
            self.agent.release_dlist_handle(peer.dlist)
            self.agent.remove_remote_agent(peer.agent_name)
        except Exception as exc:
            log.debug("cleanup of NIXL peer %s: %s", peer_id, exc)
        # Without a progress thread, operations UCX queued on a dead peer's endpoint are only
        # purged when the worker progresses; left queued, UCX asserts when the agent is destroyed.
        for _ in range(_PURGE_PROGRESS_CALLS):
            self._pump()

    def _post(self, peer_id, transfer_id, layers, src, dst, src_regions, dst_regions, timeout):
        peer = self._peers[peer_id]
        region_bytes = self.layout.block_bytes if peer.segments is None else int(peer.segments[:, 2].sum())
        nbytes = len(src_regions) * region_bytes
        notice = pb.KVNotice(kind=pb.KVNotice.PART, request_id=transfer_id, bytes=nbytes)
        try:
            xfer = self._make_xfer(peer, src_regions, dst_regions, notice.SerializeToString())
        except Exception as exc:
            return self._refused(peer_id, transfer_id, exc)
        handle = NixlHandle(
            self, xfer, peer, backend=self.backend, peer_id=peer_id, request_id=transfer_id,
            nbytes=nbytes, timeout=timeout, on_error=self._on_send_error,
        )  # fmt: skip
        try:
            status = self.agent.transfer(xfer)
        except Exception as exc:
            handle._settle_error(_error_kind(exc), f"{type(exc).__name__}: {exc}")
            return handle
        if status == "DONE":
            handle._release()
            handle.succeed()
        elif status == "ERR":
            handle._settle_error("error", "NIXL refused to post the transfer")
        return handle

    def _make_xfer(self, peer: _Peer, src_regions: list[int], dst_regions: list[int], notif: bytes):
        """One descriptor per run of regions adjacent on both sides when that pays, else prepped
        regions; for a peer split differently, one per head segment of each region."""
        if peer.segments is not None:
            local = segment_descriptors(
                self.kv_cache.data_ptr(),
                np.asarray(src_regions),
                self.layout.block_bytes,
                peer.segments[:, [0, 2]],
                self.device_id,
            )
            remote = segment_descriptors(peer.base, np.asarray(dst_regions), peer.layout.block_bytes,
                                         peer.segments[:, [1, 2]], peer.device_id)  # fmt: skip
            self.last_descriptors = len(local)
            return self._write(peer, local, remote, notif)
        runs = find_runs(src_regions, dst_regions)
        self.last_descriptors = len(runs)
        if not self._merge(len(src_regions), len(runs)):
            self.last_descriptors = len(src_regions)
            return self.agent.make_prepped_xfer(
                "WRITE",
                self._local_dlist,
                np.asarray(src_regions, dtype=np.int32),
                peer.dlist,
                np.asarray(dst_regions, dtype=np.int32),
                notif_msg=notif,
            )
        unit = self.layout.block_bytes
        local = run_descriptors(self.kv_cache.data_ptr(), runs.src_starts, runs.lengths, unit, self.device_id)
        remote = run_descriptors(peer.base, runs.dst_starts, runs.lengths, unit, peer.device_id)
        return self._write(peer, local, remote, notif)

    def _write(self, peer: _Peer, local, remote, notif: bytes):
        """A WRITE of `local` descriptors (address, bytes, device rows) into the peer's `remote`."""
        return self.agent.initialize_xfer(
            "WRITE",
            self.agent.get_xfer_descs(local, self.mem_type),
            self.agent.get_xfer_descs(remote, peer.mem_type),
            peer.agent_name,
            notif_msg=notif,
        )

    def _merge(self, regions: int, runs: int) -> bool:
        if self.descriptors == "prepped":
            return False
        if self.descriptors == "merged":
            return True
        return runs * MERGE_RATIO <= regions

    def _refused(self, peer_id: str, transfer_id: str, exc: Exception) -> TransferHandle:
        handle = TransferHandle(
            self.backend, peer_id, transfer_id, 0, timeout=1.0, on_error=self._on_send_error
        )
        handle.fail(_error_kind(exc), f"{type(exc).__name__}: {exc}")
        return handle

    def _notify(self, peer_id: str, notice: pb.KVNotice, timeout: float) -> TransferHandle:
        peer = self._peers[peer_id]
        try:
            self.agent.send_notif(peer.agent_name, notice.SerializeToString())
        except Exception as exc:
            return self._refused(peer_id, notice.request_id, exc)
        return finished_handle(self.backend, peer_id, notice.request_id)

    def _pump(self) -> None:
        for sender, messages in self.agent.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            for raw in messages:
                notice = pb.KVNotice()
                try:
                    notice.ParseFromString(raw)
                except Exception:
                    log.warning("ignoring a malformed KV notification from %s", sender)
                    continue
                self._on_notice(sender, notice)

    def close(self) -> None:
        super().close()
        try:
            self.agent.release_dlist_handle(self._local_dlist)
            self.agent.deregister_memory(self._registration)
        except Exception as exc:
            log.debug("NIXL cleanup: %s", exc)
