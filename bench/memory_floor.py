"""What reading a model's weights once costs on this machine: memory bandwidth, measured three ways.

- copy: a 1 GiB tensor copy, bytes read + written per second (the STREAM convention);
- read: a sum over the same 1 GiB, bytes read per second;
- GEMV: one large matrix-vector product of the model's dtype, weight bytes per second: what a
  matmul-bound decode step can reach with that routine (torch's `F.linear`, and the native
  kernel of the decode step where the dtype has one).

Sources are random: a constant buffer can be backed by few physical pages on hosts that merge
identical pages, and then it measures a cache, not memory. Every figure is the best of several
repetitions and comes with the 1-min load average taken right after it: on a shared machine the
same command moves by 2x with the load, so only figures from one run are compared.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Bandwidth:
    bytes_per_s: float
    load: float  # 1-min load average when measured

    @property
    def gbps(self) -> float:
        return self.bytes_per_s / 1e9


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Shortest of `repeats` timed calls, after one untimed call (first-touch page faults)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def random_buffer(nbytes: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:  # int8 weights: the whole symmetric range
        return torch.randint(-127, 128, (nbytes // dtype.itemsize,), generator=g, dtype=dtype)
    return torch.rand(nbytes // dtype.itemsize, generator=g).to(dtype)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> Bandwidth:
    """Bytes read + written per second by a tensor copy of random data."""
    src = random_buffer(nbytes)
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), repeats)
    return Bandwidth(2 * src.numel() * src.element_size() / t, os.getloadavg()[0])


class CopyProbe:
    """A quick bandwidth sample (one copy of 256 MiB of random data, ~10 ms) to take beside each
    measurement: this machine's memory bandwidth moves by up to 2x within seconds (other tenants),
    so a floor measured a minute away from a step says little about that step."""

    def __init__(self, nbytes: int = 256 << 20):
        self._src = random_buffer(nbytes, seed=3)
        self._dst = torch.empty_like(self._src)
        self._dst.copy_(self._src)  # first-touch page faults

    def seconds_per_byte(self) -> float:
        """Seconds per byte read + written (the STREAM convention, as `copy_bandwidth`)."""
        t = time.perf_counter()
        self._dst.copy_(self._src)
        return (time.perf_counter() - t) / (2 * self._src.numel() * self._src.element_size())


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> Bandwidth:
    """Bytes read per second by a sum over random data."""
    src = random_buffer(nbytes, seed=1)
    t = best_time(src.sum, repeats)
    return Bandwidth(src.numel() * src.element_size() / t, os.getloadavg()[0])


def gemv_bandwidth(
    in_features: int,
    dtype: torch.dtype,
    gemv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
    nbytes: int = 256 << 20,
    repeats: int = 5,
) -> Bandwidth:
    """Weight bytes per second of `gemv(x [1, in], W [out, in])`, W of about `nbytes` (far past
    the last-level cache) of random `dtype`."""
    out_features = max(1, nbytes // (in_features * dtype.itemsize))
    w = random_buffer(out_features * in_features * dtype.itemsize, dtype, seed=2).view(
        out_features, in_features
    )
    x = torch.rand(1, in_features).to(dtype if dtype.is_floating_point else torch.float32)
    with torch.inference_mode():
        t = best_time(lambda: gemv(x, w), repeats)
    return Bandwidth(w.numel() * w.element_size() / t, os.getloadavg()[0])
