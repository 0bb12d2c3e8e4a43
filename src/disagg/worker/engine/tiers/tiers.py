"""`KVTiers`: the engine's view of the host and disk tiers below its KV cache.

The block manager hands over cached blocks as it evicts them (`offload`, called before their
new owner writes them): each is copied into the host tier unless it is already there, and the
host tier's least recently used block goes down to the disk tier. Admission asks `find` how many
of a prompt's next blocks live below the cache (host slots found are pinned), allocates cache
blocks, and `restore` copies them back in order; a block that cannot be read (evicted meanwhile,
or a corrupt file) ends the restored prefix there and the rest is recomputed. On CUDA the copies
are asynchronous on the current stream, ordered before the step that reads or overwrites the
blocks; on CPU they are memory copies. `prefetch` starts reading a queued prompt's disk blocks
before its admission.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from disagg.worker.engine.tiers.disk import DiskTier
from disagg.worker.engine.tiers.host import Demoted, HostTier

TIERS = ("host", "disk")


@dataclass
class TierCounters:
    """Monotonic counts of the blocks restored from one tier, and read latencies not yet taken by
    the metrics (what goes into a tier each tier counts itself)."""

    hits: int = 0  # blocks restored from the tier
    bytes_read: int = 0
    read_seconds: list[float] = field(default_factory=list)

    def take_read_seconds(self) -> list[float]:
        out, self.read_seconds = self.read_seconds, []
        return out


@dataclass
class TierHit:
    """A prompt's blocks found below the cache, in order: (hash, token ids, host slot or None for
    the disk tier). Host slots stay pinned until `KVTiers.restore` or `KVTiers.release`."""

    blocks: list[tuple[int, tuple[int, ...], int | None]]
    released: bool = False

    def __len__(self) -> int:
        return len(self.blocks)


class KVTiers:
    def __init__(
        self,
        cache: torch.Tensor,
        block_size: int,
        host_bytes: int,
        disk_dir: str | Path | None = None,
        disk_bytes: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`cache`: the KV cache [layers, blocks, ...]; one block is `cache[:, b]`, whatever its
        dtype (a quantized cache's blocks are bytes and stay so)."""
        self.cache = cache
        self.block_size = block_size
        self.block_shape = (cache.shape[0], *cache.shape[2:])
        self.block_bytes = math.prod(self.block_shape) * cache.element_size()
        host_blocks = host_bytes // self.block_bytes
        if host_blocks < 1:
            raise ValueError(
                f"kv_host_cache_memory must hold at least one KV block ({self.block_bytes} bytes), got {host_bytes}"
            )
        self.host = HostTier(host_blocks, self.block_shape, cache.dtype, pin_memory=cache.is_cuda)
        self.disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        self.counters = {tier: TierCounters() for tier in TIERS}
        self._clock = clock
        self._unsettled: set[int] = set()  # host slots filled by CUDA copies not waited for yet

    # ---- down: blocks leaving the cache -----------------------------------------------------------
    def offload(self, evicted: Sequence[tuple[int, int, tuple[int, ...] | None]]) -> None:
        """Keep the (block id, hash, token ids) blocks the cache is evicting; called before they
        are overwritten."""
        for block, block_hash, tokens in evicted:
            if tokens is None:
                continue
            if self.host.holds(block_hash):
                self.host.touch(block_hash)
                continue
            if self.host.next_victim() in self._unsettled:
                self.wait_copies()  # the slot about to be demoted must hold its bytes
            slot, demoted = self.host.claim(block_hash, tokens)
            if demoted is not None:
                self._demote(demoted)
            if slot is None:  # every slot pinned by restores: the block is not kept
                continue
            self.host.slots[slot].copy_(self.cache[:, block], non_blocking=True)
            if self.cache.is_cuda:
                self._unsettled.add(slot)

    def wait_copies(self) -> None:
        """Until the offload copies issued so far are done (on CPU they are done when issued). The
        step's own writes are ordered after them on the stream; a writer off the stream (another
        worker's NIXL write into a reservation) is not, so a reservation waits for them before it
        is handed out, and so does reading a slot's bytes to demote it."""
        if self._unsettled:
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            self._unsettled.clear()

    def _demote(self, block: Demoted) -> None:
        if self.disk is not None:
            self.disk.put(block)

    # ---- up: blocks coming back --------------------------------------------------------------------
    def holds(self, block_hash: int) -> bool:
        return self.host.holds(block_hash) or (self.disk is not None and self.disk.holds(block_hash))

    def find(self, hashes: Sequence[int], token_ids: Sequence[int], first: int, last: int) -> TierHit:
        """The blocks first, first+1, ... (before `last`) of a sequence that the tiers hold, up to
        the first they do not; their host slots are pinned."""
        bs = self.block_size
        found = []
        for i in range(first, last):
            h, tokens = hashes[i], tuple(token_ids[i * bs : (i + 1) * bs])
            slot = self.host.find(h, tokens)
            if slot is not None:
                self.host.pin(slot)
            elif self.disk is None or not self.disk.holds(h):
                break
            found.append((h, tokens, slot))
        return TierHit(found)

    def restore(self, hit: TierHit, block_ids: Sequence[int]) -> int:
        """Copy the found blocks into cache blocks `block_ids` (one each, in order); returns how many
        leading ones were restored. Releases the hit."""
        restored = 0
        try:
            for (block_hash, tokens, slot), block in zip(hit.blocks, block_ids, strict=False):
                if slot is not None:
                    self.cache[:, block].copy_(self.host.slots[slot], non_blocking=True)
                    tier = "host"
                else:
                    started = self._clock()
                    payload = self.disk.read(block_hash, tokens)
                    if payload is None:
                        break
                    self.cache[:, block].copy_(self._as_block(payload))
                    self.counters["disk"].read_seconds.append(self._clock() - started)
                    tier = "disk"
                self.counters[tier].hits += 1
                self.counters[tier].bytes_read += self.block_bytes
                restored += 1
        finally:
            self.release(hit)
        return restored

    def _as_block(self, payload: memoryview | bytearray) -> torch.Tensor:
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.cache.dtype).view(self.block_shape)

    def release(self, hit: TierHit) -> None:
        """Unpin a hit's host slots (restored or not); idempotent."""
        if not hit.released:
            hit.released = True
            for _, _, slot in hit.blocks:
                if slot is not None:
                    self.host.unpin(slot)

    def prefetch(self, hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """Start reading the disk-tier blocks of a queued sequence."""
        if self.disk is None:
            return
        bs = self.block_size
        self.disk.prefetch(
            [(h, token_ids[i * bs : (i + 1) * bs]) for i, h in enumerate(hashes) if not self.host.holds(h)]
        )

    # ---- accounting ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per tier: blocks held now, and cumulative hits, bytes read and written, evictions and
        (disk) corrupt blocks refused."""
        host, disk = self.host, self.disk
        out = {
            "host": {"blocks": len(host), "evictions": host.evictions, "corrupt": 0,
                     "bytes_written": host.bytes_written},
            "disk": {"blocks": 0, "evictions": 0, "corrupt": 0, "bytes_written": 0} if disk is None else
                    {"blocks": len(disk), "evictions": disk.evictions, "corrupt": disk.corrupt,
                     "bytes_written": disk.bytes_written},
        }  # fmt: skip
        for tier, c in self.counters.items():
            out[tier].update(hits=c.hits, bytes_read=c.bytes_read)
        return out

    def clear(self) -> None:
        """Forget every block of every tier."""
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
