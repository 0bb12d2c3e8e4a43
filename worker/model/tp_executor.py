"""The processes of a tensor-parallel group: rank 0 is the engine's own process, ranks 1..N-1 are
children that each hold their shard and their part of the KV cache and run every step rank 0 runs.

Rank 0 owns the scheduler and the (logical) block manager, so block ids mean the same slots on
every rank. Each step it sends the `ForwardBatch` to the other ranks over a pipe, then all ranks
run the forward pass together; the collectives inside it (gloo on CPU, NCCL on CUDA) meet over a
TCP rendezvous on loopback. Rank 0 alone samples, from the gathered logits.

Failure is loud, never a hang: a rank that exits makes the next step raise `RankFailedError`, a
collective that a peer never joins raises after `timeout`, and a child whose pipe to rank 0 closes
exits, so the engine's process can exit and be restarted whole.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, Listener

import torch
import torch.distributed as dist

from disagg.worker.model.config import ModelConfig
from disagg.worker.model.forward_batch import ForwardBatch
from disagg.worker.model.parallel import TensorParallel, plan_for

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(seconds=120)
RENDEZVOUS_HOST = "127.0.0.1"
AUTHKEY_ENV = "DISAGG_TP_AUTHKEY"  # the control connection's key, kept off the command line


class RankFailedError(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering: the group cannot step again."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the engine's own (cuda:k -> cuda:k+r); the CPU for all."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def make_group(store, rank: int, world_size: int, device: torch.device, timeout: timedelta):
    """The process group of one rank, used directly (no global default group): NCCL on CUDA."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def rank_tp(model_path: str, store, rank: int, world_size: int, device: torch.device, timeout: timedelta):
    config = ModelConfig.from_pretrained(model_path)
    plan = plan_for(rank, world_size, config)  # refuses an unshardable model before any process waits
    return TensorParallel(plan, make_group(store, rank, world_size, device, timeout))


class RankProcesses:
    """Ranks 1..N-1 of a group, seen from rank 0: start them, feed them each step, stop them."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        device: torch.device,
        world_size: int,
        *,
        threads: int | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ):
        """Starts the children (`python -m disagg.worker.model.tp_rank`: a fresh interpreter, so
        the caller's main module is never re-run) and joins the rendezvous as rank 0; `self.tp`
        is rank 0's view of the group."""
        if world_size < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 for rank processes, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        if device.type == "cpu" and threads is None:
            # ranks on one machine share its cores: each takes its share, rank 0 (this process) too
            threads = max(1, len(os.sched_getaffinity(0)) // world_size)
            torch.set_num_threads(threads)
        config = ModelConfig.from_pretrained(model_path)
        plan = plan_for(0, world_size, config)  # refuse before starting anything
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._closed = False
        authkey = secrets.token_bytes(32)
        store = dist.TCPStore(RENDEZVOUS_HOST, 0, world_size, True, timeout=timeout, wait_for_workers=False)
        self._store = store
        try:
            with Listener((RENDEZVOUS_HOST, 0), authkey=authkey) as listener:
                env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
                for rank in range(1, world_size):
                    spec = dict(
                        control=list(listener.address), model=str(model_path), dtype=str(dtype),
                        device=str(rank_device(device, rank)), rank=rank, world_size=world_size,
                        store_port=store.port, timeout_s=timeout.total_seconds(), threads=threads,
                    )  # fmt: skip
                    # -P: the working directory is not put on sys.path (a checkout's operator/
                    # folder would shadow the standard library's)
                    cmd = [sys.executable, "-P", "-m", "disagg.worker.model.tp_rank", json.dumps(spec)]
                    self.procs.append(subprocess.Popen(cmd, env=env))
                    self.conns.append(self._accept(listener, rank))
            self.tp = TensorParallel(plan, self._join_group(store, device))
        except BaseException:
            self.close()
            raise

    def _accept(self, listener: Listener, rank: int) -> Connection:
        """The control connection of the child just started, or RankFailedError if it exits first."""
        result: list = []
        thread = threading.Thread(target=lambda: result.append(listener.accept()), daemon=True)
        thread.start()
        self._wait(lambda: not thread.is_alive(), f"rank {rank} did not connect")
        if not result:
            raise RankFailedError(f"tensor-parallel rank {rank} did not connect")
        return result[0]

    def _join_group(self, store, device: torch.device):
        """Rank 0's process group; building it waits for every rank, so it runs aside while this
        thread watches that the children stay alive."""
        result: list = []

        def build():
            try:
                result.append(make_group(store, 0, self.world_size, device, self.timeout))
            except BaseException as exc:
                result.append(exc)

        thread = threading.Thread(target=build, name="tp-rendezvous", daemon=True)
        thread.start()
        self._wait(lambda: not thread.is_alive(), "the tensor-parallel rendezvous did not complete")
        if isinstance(result[0], BaseException):
            raise RankFailedError(f"the tensor-parallel rendezvous failed: {result[0]}") from result[0]
        return result[0]

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not done():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RankFailedError(f"{what} within {self.timeout}")
            time.sleep(0.05)

    # ---- lifecycle --------------------------------------------------------------------------
    def start_runners(self, **runner_kwargs) -> None:
        """Every child builds its `ModelRunner(model, **runner_kwargs)` (the same blocks as rank 0's);
        call right before rank 0 builds its own, since CUDA graph capture runs collectives."""
        for conn in self.conns:
            conn.send(runner_kwargs)

    def wait_ready(self) -> None:
        """Block until every child has its runner, raising what a failed one reported."""
        for rank, conn in enumerate(self.conns, start=1):
            self._wait(lambda conn=conn: conn.poll(), f"tensor-parallel rank {rank} was not ready")
            kind, detail = self._recv(rank, conn)
            if kind != "ready":
                raise RankFailedError(f"tensor-parallel rank {rank} failed to start:\n{detail}")

    def close(self, timeout: float = 10.0) -> None:
        """Ask the children to stop, then end those that do not; idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()

    # ---- stepping ---------------------------------------------------------------------------
    def send(self, batch: ForwardBatch) -> None:
        """Hand this step's batch to every child (before rank 0 runs it)."""
        self._send_all(pickle.dumps(batch.to("cpu")))

    # ---- services: per-rank objects a higher layer installs (each rank's KV transport) --------
    def install(self, name: str, factory: str, *args) -> None:
        """Every child builds `factory(runner, rank, *args)` ("module:callable", imported in the
        child) as its service `name`; raises what a child's factory raised."""
        for rank in range(1, self.world_size):
            self._ask(rank, ("install", name, factory, args))

    def ask(self, rank: int, name: str, method: str, *args):
        """Call `method(*args)` on child `rank`'s service `name` and return its result (or raise
        its exception). Only between steps: the child answers once its current step is done."""
        return self._ask(rank, ("call", name, method, args))

    def post(self, name: str, method: str, *args) -> None:
        """Call `method(*args)` on every child's service `name` without waiting: children run it
        after the step they are in, in the order posted. A posted call that raises ends the rank."""
        self._send_all(pickle.dumps(("post", name, method, args)))

    def _ask(self, rank: int, message: tuple):
        self._check_alive()
        conn = self.conns[rank - 1]
        try:
            conn.send_bytes(pickle.dumps(message))
        except OSError as exc:
            raise RankFailedError(f"tensor-parallel rank {rank} is unreachable: {exc}") from exc
        self._wait(conn.poll, f"tensor-parallel rank {rank} did not answer {message[0]} {message[1]!r}")
        kind, value = self._recv(rank, conn)
        if kind == "ok":
            return value
        if kind == "raised":
            raise value
        raise RankFailedError(f"tensor-parallel rank {rank} failed:\n{value}")

    def _send_all(self, data: bytes) -> None:
        self._check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise RankFailedError(f"tensor-parallel rank {rank} is unreachable: {exc}") from exc

    def check_alive(self) -> None:
        """Raise RankFailedError if any child has exited (with what it reported, if anything)."""
        self._check_alive()

    def _check_alive(self) -> None:
        if self._closed:
            raise RankFailedError("the tensor-parallel ranks are shut down")
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                detail = ""
                if rank <= len(self.conns) and self.conns[rank - 1].poll():
                    _kind, detail = self._recv(rank, self.conns[rank - 1])
                raise RankFailedError(
                    f"tensor-parallel rank {rank} exited with code {proc.returncode}\n{detail}"
                )

    @staticmethod
    def _recv(rank: int, conn: Connection) -> tuple[str, str | None]:
        try:
            return conn.recv()
        except (EOFError, OSError):
            return "error", f"rank {rank} closed its connection"


class TensorParallelRunner:
    """Rank 0's `ModelRunner` that brings the other ranks along: the engine calls it the same way.

    A step that fails on rank 0 leaves the ranks out of step with each other (some may wait in a
    collective rank 0 never joins), so after one failure every later step fails at once: the
    engine gives up and its process exits, to be restarted whole.
    """

    def __init__(self, runner, ranks: RankProcesses):
        self.runner = runner
        self.ranks = ranks
        self.failure: str | None = None

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's part of the cache (its KV heads)."""
        return self.runner.kv_cache

    def forward(self, batch: ForwardBatch, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        if self.failure is not None:
            raise RankFailedError(f"the tensor-parallel group failed earlier: {self.failure}")
        try:
            self.ranks.send(batch)
            return self.runner.forward(batch, layer_hook)
        except BaseException as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, RankFailedError):
                raise
            self.ranks.check_alive()  # a dead rank is the likeliest cause: name it
            raise RankFailedError(f"a tensor-parallel step failed on rank 0: {self.failure}") from exc

    def close(self) -> None:
        # after a failure the other ranks may sit in a collective until its timeout: do not wait
        self.ranks.close(timeout=10.0 if self.failure is None else 1.0)
