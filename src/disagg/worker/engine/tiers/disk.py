"""The disk tier: KV blocks the host tier let go of, one checksummed file each in a local directory.

Writes are queued and done by a background thread (a temporary file renamed into place), so the
engine never waits on the disk to evict; a block still queued is read from memory. The directory
belongs to one engine: it is locked while the engine runs, emptied of block files when the tier
opens (what a crashed predecessor left is never served: its blocks are not in this process's
index) and when it closes. Reads verify the file (`block_file.decode`); a corrupt or truncated
file is deleted, counted and reported as a miss, so the prefix is recomputed. `prefetch` reads
files on another thread ahead of the step that needs them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from disagg.worker.engine.tiers import block_file
from disagg.worker.engine.tiers.host import Demoted

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
_STAGED_BYTES = 256 << 20  # prefetched payloads waiting for their step


class DiskTierInUse(RuntimeError):
    """Another engine holds the directory."""


class DiskTier:
    def __init__(self, directory: str | Path, capacity_bytes: int):
        self.dir = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise DiskTierInUse(f"the KV disk tier {self.dir} is in use by another engine") from None
        self.removed_stale = self._remove_block_files()
        self._mutex = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recent first
        self._pending: dict[int, Demoted] = {}  # queued for writing, readable meanwhile
        self._staged: OrderedDict[int, tuple[tuple[int, ...], memoryview]] = OrderedDict()
        self._staged_bytes = 0
        self._prefetching: set[int] = set()
        self._prefetches: list[Future] = []
        self.used_bytes = 0
        self.evictions = 0
        self.corrupt = 0
        self.bytes_written = 0
        self._queue: queue.Queue[Demoted | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-prefetch")
        self._closed = False

    # ---- what it holds ---------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._mutex:
            return len(self._index) + len(self._pending)

    def holds(self, block_hash: int) -> bool:
        with self._mutex:
            return block_hash in self._index or block_hash in self._pending

    def file_path(self, block_hash: int) -> Path:
        return self.dir / block_file.file_name(block_hash)

    # ---- writes ----------------------------------------------------------------------------------
    def put(self, block: Demoted) -> None:
        """Queue a block for writing (a no-op when the tier already holds it)."""
        if (
            self._closed
            or block_file.file_size(len(block.token_ids), len(block.payload)) > self.capacity_bytes
        ):
            return
        with self._mutex:
            if block.block_hash in self._index or block.block_hash in self._pending:
                return
            self._pending[block.block_hash] = block
        self._queue.put(block)

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    def _write_loop(self) -> None:
        while (block := self._queue.get()) is not None:
            try:
                self._write(block)
            except OSError as e:  # a full or failing disk loses the block, not the engine
                log.warning("KV disk tier: could not write block %016x: %s", block.block_hash, e)
            finally:
                with self._mutex:
                    self._pending.pop(block.block_hash, None)
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, block: Demoted) -> None:
        size = block_file.file_size(len(block.token_ids), len(block.payload))
        for victim in self._make_room(size):
            with contextlib.suppress(FileNotFoundError):
                self.file_path(victim).unlink()
        path = self.file_path(block.block_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.writelines(block_file.encode(block.block_hash, block.token_ids, block.payload))
        os.replace(tmp, path)
        with self._mutex:
            self._index[block.block_hash] = size
            self.used_bytes += size
            self.bytes_written += size

    def _make_room(self, size: int) -> list[int]:
        """Take least recently used blocks out of the index until `size` more bytes fit."""
        victims = []
        with self._mutex:
            while self._index and self.used_bytes + size > self.capacity_bytes:
                victim, victim_size = self._index.popitem(last=False)
                self.used_bytes -= victim_size
                self.evictions += 1
                victims.append(victim)
        return victims

    # ---- reads -----------------------------------------------------------------------------------
    def read(self, block_hash: int, token_ids: Sequence[int]) -> memoryview | None:
        """The block's payload, verified; None when it is not here, or its file proved corrupt."""
        tokens = tuple(token_ids)
        with self._mutex:
            staged = self._staged.pop(block_hash, None)
            if staged is not None:
                self._staged_bytes -= len(staged[1])
            pending = self._pending.get(block_hash)
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        if staged is not None and staged[0] == tokens:
            return staged[1]
        if pending is not None:
            return memoryview(pending.payload) if pending.token_ids == tokens else None
        return self._read_file(block_hash, tokens)

    def _read_file(self, block_hash: int, tokens: tuple[int, ...]) -> memoryview | None:
        with self._mutex:
            if block_hash not in self._index:
                return None
        try:
            with open(self.file_path(block_hash), "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)  # writable: tensors view it in place
                f.readinto(data)
        except FileNotFoundError:  # evicted since the lookup
            return None
        try:
            return block_file.decode(data, block_hash, tokens)
        except block_file.CorruptBlock as e:
            if self._refuse(block_hash):
                log.warning("KV disk tier: block %016x refused (%s); it will be recomputed", block_hash, e)
            return None

    def _refuse(self, block_hash: int) -> bool:
        """Forget a corrupt block, count it and delete its file; False when another reader did first."""
        with self._mutex:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size
                self.corrupt += 1
        if size is not None:
            with contextlib.suppress(FileNotFoundError):
                self.file_path(block_hash).unlink()
        return size is not None

    def prefetch(self, blocks: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Start reading these (hash, token ids) blocks' files so that a later `read` finds them in
        memory; blocks not on disk, or already staged, are skipped."""
        wanted = []
        with self._mutex:
            for h, tokens in blocks:
                if h in self._index and h not in self._staged and h not in self._prefetching:
                    self._prefetching.add(h)
                    wanted.append((h, tuple(tokens)))
        if wanted and not self._closed:
            self._prefetches = [f for f in self._prefetches if not f.done()]
            self._prefetches.append(self._reader.submit(self._prefetch, wanted))

    def _prefetch(self, blocks: list[tuple[int, tuple[int, ...]]]) -> None:
        for h, tokens in blocks:
            try:
                payload = self._read_file(h, tokens)
            finally:
                with self._mutex:
                    self._prefetching.discard(h)
            if payload is None:
                continue
            with self._mutex:
                self._staged[h] = (tokens, payload)
                self._staged_bytes += len(payload)
                while self._staged_bytes > _STAGED_BYTES:
                    _, (_, old) = self._staged.popitem(last=False)
                    self._staged_bytes -= len(old)

    def wait_prefetched(self) -> None:
        """Wait for the prefetches started so far (a step never needs to: it reads what is missing)."""
        wait(self._prefetches)

    def clear(self) -> None:
        """Forget and delete every block (queued writes land first)."""
        self.flush()
        self.wait_prefetched()
        self._forget_all()

    def _forget_all(self) -> None:
        with self._mutex:
            self._index.clear()
            self._staged.clear()
            self.used_bytes = self._staged_bytes = 0
        self._remove_block_files()

    # ---- lifetime --------------------------------------------------------------------------------
    def _remove_block_files(self) -> int:
        removed = 0
        for path in self.dir.iterdir():
            if path.suffix in (block_file.SUFFIX, ".tmp") and path.is_file():
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def close(self) -> None:
        """Stop the writer, delete every block file, release the directory; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._queue.put(None)
        self._writer.join()
        self._forget_all()
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
