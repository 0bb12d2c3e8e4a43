"""Runs of regions that are adjacent on both sides of a transfer, so one descriptor can carry each run.

Region r of a KV cache starts at r * block_bytes in its tensor, so regions r and r + 1 touch in
memory, even across a layer boundary. A pair list (src[i] -> dst[i]) can therefore be sent as
one (src_start, dst_start, length) descriptor per maximal stretch where both sides advance by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Runs:
    """Maximal runs: pair i of run k is src_starts[k] + i -> dst_starts[k] + i, for i < lengths[k]."""

    src_starts: np.ndarray
    dst_starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        return zip(self.src_starts.tolist(), self.dst_starts.tolist(), self.lengths.tolist(), strict=True)


def find_runs(src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> Runs:
    """Split the pairs src[i] -> dst[i] into maximal runs where both sides step by exactly +1."""
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    if s.ndim != 1 or s.shape != d.shape:
        raise ValueError(f"dst: {d.shape} indices do not pair with src's {s.shape}")
    if len(s) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return Runs(s[starts], d[starts], lengths)


def run_descriptors(
    base: int, starts: np.ndarray, lengths: np.ndarray, unit: int, device_id: int
) -> np.ndarray:
    """Nx3 uint64 (address, bytes, device) of region runs in a tensor starting at `base`."""
    table = np.empty((len(starts), 3), dtype=np.uint64)
    table[:, 0] = np.uint64(base) + starts.astype(np.uint64) * np.uint64(unit)
    table[:, 1] = lengths.astype(np.uint64) * np.uint64(unit)
    table[:, 2] = device_id
    return table


def block_runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """(first, count) of each stretch of consecutive ascending ids in `blocks`, in order."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def segment_descriptors(
    base: int, regions: np.ndarray, region_bytes: int, segments: np.ndarray, device_id: int
) -> np.ndarray:
    """Nx3 uint64 (address, bytes, device) of byte segments (rows of `segments`: offset, length)
    inside each of `regions` of a tensor starting at `base`, region-major."""
    starts = np.uint64(base) + regions.astype(np.uint64)[:, None] * np.uint64(region_bytes)
    table = np.empty((len(regions) * len(segments), 3), dtype=np.uint64)
    table[:, 0] = (starts + segments[:, 0].astype(np.uint64)[None, :]).reshape(-1)
    table[:, 1] = np.tile(segments[:, 1].astype(np.uint64), len(regions))
    table[:, 2] = device_id
    return table
