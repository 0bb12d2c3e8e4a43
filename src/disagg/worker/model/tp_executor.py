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
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener

import torch
import torch.distributed as dist

from disagg.worker.model.config import ModelConfig
from disagg.worker.model.forward_batch import ForwardBatch
from disagg.worker.model.parallel import TensorParallel, plan_for
from disagg.worker.model.tp_join import (
    AUTHKEY_ENV,
    GroupSpec,
    authenticate,
    keepalive,
    peer_closed,
    recv_timeout,
)

log = logging.getLogger(__name__)
# after a failed step, how long to look for a rank whose exit explains it before naming none
DEAD_RANK_GRACE_SECONDS = 2.0

DEFAULT_TIMEOUT = timedelta(seconds=120)
DEFAULT_JOIN_TIMEOUT = timedelta(seconds=600)  # ranks on other hosts: their pods may start later
JOIN_HELLO_TIMEOUT = 10.0  # seconds a connection has to authenticate and to say which rank it is
RENDEZVOUS_HOST = "127.0.0.1"
LISTEN_ALL = "0.0.0.0"  # with ranks on other hosts: they reach rank 0 on its pod's address


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
    """Ranks 1..N-1 of a group, seen from rank 0: start them (or wait for those started on other
    hosts), feed them each step, stop them."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        device: torch.device,
        world_size: int,
        *,
        threads: int | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        local_ranks: int | None = None,
        port: int = 0,
        authkey: bytes | None = None,
        join_timeout: timedelta = DEFAULT_JOIN_TIMEOUT,
    ):
        """Starts ranks 1..local_ranks-1 as children (`python -m disagg.worker.model.tp_rank`: a
        fresh interpreter, so the caller's main module is never re-run), waits for the others
        (started on other hosts by `disagg tp-ranks`, which connect to `port` on every interface
        with `authkey`; the rendezvous store listens on `port + 1`), and joins the rendezvous as
        rank 0; `self.tp` is rank 0's view of the group."""
        if world_size < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 for rank processes, got {world_size}")
        local_ranks = world_size if local_ranks is None else local_ranks
        if not 1 <= local_ranks <= world_size:
            raise ValueError(f"tensor_parallel_local_ranks must be in [1, {world_size}], got {local_ranks}")
        self.world_size = world_size
        self.local_ranks = local_ranks
        self.timeout = timeout
        remote = local_ranks < world_size
        if remote and authkey is None:
            raise ValueError(
                f"tensor_parallel_local_ranks is {local_ranks} of {world_size}: ranks from other hosts "
                "need the internal credential (DISAGG_INTERNAL_TOKEN), which authenticates their control "
                "connection"
            )
        if remote and not 0 < port < 65535:
            raise ValueError(
                f"tensor_parallel_port must be in [1, 65534] with ranks on other hosts, got {port}"
            )
        if device.type == "cpu" and threads is None:
            # ranks on one machine share its cores: each takes its share, rank 0 (this process) too
            threads = max(1, len(os.sched_getaffinity(0)) // local_ranks)
            torch.set_num_threads(threads)
        config = ModelConfig.from_pretrained(model_path)
        plan = plan_for(0, world_size, config)  # refuse before starting anything
        self.procs: list[subprocess.Popen] = []  # the children: ranks 1..local_ranks-1
        self.conns: list[Connection] = []  # every rank's control connection, index rank - 1
        self.hosts: dict[int, str] = {}  # the host each rank from another host said it runs on
        self._awaiting: set[int] = set()  # ranks whose answer rank 0 waits for
        self._closed = False
        authkey = authkey if remote else secrets.token_bytes(32)
        # The store (unauthenticated: torch has no credential for it) listens on a socket bound
        # here: left to itself, TCPStore listens on every interface even for ranks on this host.
        listen = socket.create_server((LISTEN_ALL if remote else RENDEZVOUS_HOST, port + 1 if remote else 0))
        store = dist.TCPStore(RENDEZVOUS_HOST, listen.getsockname()[1], world_size, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listen.detach())  # fmt: skip
        self._store = store
        self._group = GroupSpec(str(model_path), str(dtype), device.type, world_size, store.port,
                                timeout.total_seconds())  # fmt: skip
        try:
            # authenticated per connection in `_accept` (bounded in time), not by the listener
            with Listener((LISTEN_ALL if remote else RENDEZVOUS_HOST, port if remote else 0)) as listener:
                env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
                control = [RENDEZVOUS_HOST, listener.address[1]]
                for rank in range(1, local_ranks):
                    spec = dict(control=control, rank=rank, device_index=rank_device(device, rank).index,
                                threads=threads, connect_timeout_s=timeout.total_seconds())  # fmt: skip
                    cmd = [sys.executable, "-m", "disagg.worker.model.tp_rank", json.dumps(spec)]
                    self.procs.append(subprocess.Popen(cmd, env=env))
                if remote:
                    log.info("waiting for tensor-parallel ranks %d..%d from other hosts on port %d",
                             local_ranks, world_size - 1, port)  # fmt: skip
                self.conns = self._join(listener, authkey, join_timeout if remote else timeout)
            self.tp = TensorParallel(plan, self._join_group(store, device))
        except BaseException:
            self.close()
            raise

    def _join(self, listener: Listener, authkey: bytes, timeout: timedelta) -> list[Connection]:
        """Every other rank's control connection, in rank order: accept until each rank has said
        which it is (connections that fail authentication or name a wrong rank are dropped)."""
        joined: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            while len(joined) < self.world_size - 1:
                missing = sorted(set(range(1, self.world_size)) - joined.keys())
                conn = self._accept(listener, authkey, deadline, missing)
                if conn is not None and (rank := self._hello(conn, joined)) is not None:
                    joined[rank] = conn
        except BaseException:
            for conn in joined.values():
                conn.close()
            raise
        return [joined[r] for r in range(1, self.world_size)]

    def _accept(
        self, listener: Listener, authkey: bytes, deadline: float, missing: list[int]
    ) -> Connection | None:
        """The next authenticated connection; None for one that failed authentication (or said
        nothing within JOIN_HELLO_TIMEOUT)."""
        result: list = []

        def accept():
            try:
                result.append(listener.accept())
            except OSError as exc:
                result.append(exc)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        while thread.is_alive():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RankFailedError(self._not_joined(missing))
            time.sleep(0.05)
        if isinstance(result[0], BaseException):
            log.warning("accepting on the tensor-parallel control port failed: %s", result[0])
            return None
        conn = result[0]
        try:
            authenticate(conn, authkey, JOIN_HELLO_TIMEOUT)
        except (AuthenticationError, OSError, EOFError) as exc:
            log.warning(
                "a connection to the tensor-parallel control port was refused: %s", exc or type(exc).__name__
            )
            conn.close()
            return None
        keepalive(conn)
        return conn

    def _not_joined(self, missing: list[int]) -> str:
        local = [r for r in missing if r < self.local_ranks]
        remote = [r for r in missing if r >= self.local_ranks]
        parts = []
        if local:
            parts.append(f"ranks {local} (started here) did not connect within {self.timeout}")
        if remote:
            parts.append(f"ranks {remote} did not join from other hosts (`disagg tp-ranks --leader HOST:PORT "
                         f"--first-rank {remote[0]}`)")  # fmt: skip
        return "tensor-parallel group incomplete: " + "; ".join(parts)

    def _hello(self, conn: Connection, joined: dict[int, Connection]) -> int | None:
        """Read the rank's ("join", rank, host), answer with the group, return the rank; None (and
        the connection closed) for a rank that is out of range, taken, or says nothing in time."""
        try:
            if not conn.poll(JOIN_HELLO_TIMEOUT):
                raise ValueError(f"said nothing within {JOIN_HELLO_TIMEOUT}s")
            kind, rank, host = conn.recv()
            if kind != "join" or not isinstance(rank, int) or not 1 <= rank < self.world_size:
                raise ValueError(f"asked to join as rank {rank!r} of {self.world_size}")
            if rank in joined:
                raise ValueError(f"asked to join as rank {rank}, which has joined already")
            conn.send(("group", self._group.to_dict()))
        except (ValueError, TypeError, EOFError, OSError) as exc:
            log.warning("a tensor-parallel rank was refused: %s", exc)
            try:
                conn.send(("refused", str(exc)))
            except (OSError, ValueError):
                pass
            conn.close()
            return None
        recv_timeout(conn, 0)  # joined: from now on a step may take as long as it takes
        if rank >= self.local_ranks:
            self.hosts[rank] = host
            log.info("tensor-parallel rank %d joined from %s", rank, host)
        return rank

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
        self._awaiting.update(range(1, self.world_size))

    def wait_ready(self) -> None:
        """Block until every child has its runner, raising what a failed one reported."""
        for rank, conn in enumerate(self.conns, start=1):
            self._wait(lambda conn=conn: conn.poll(), f"tensor-parallel rank {rank} was not ready")
            kind, detail = self._recv(rank, conn)
            self._awaiting.discard(rank)
            if kind != "ready":
                raise RankFailedError(f"tensor-parallel rank {rank} failed to start:\n{detail}")

    def close(self, timeout: float = 10.0) -> None:
        """Ask every rank to stop, then end the children that do not; idempotent."""
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
            self.install_on(rank, name, factory, *args)

    def install_on(self, rank: int, name: str, factory: str, *args) -> None:
        """`install` on one rank (arguments that differ by rank: the host a rank runs on)."""
        self._ask(rank, ("install", name, factory, args))

    def host_of(self, rank: int) -> str | None:
        """The host a rank that joined from another host runs on; None for rank 0's children."""
        return self.hosts.get(rank)

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
        self._awaiting.add(rank)
        self._wait(conn.poll, f"tensor-parallel rank {rank} did not answer {message[0]} {message[1]!r}")
        kind, value = self._recv(rank, conn)
        self._awaiting.discard(rank)
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

    def check_alive(self, grace: float = 0.0) -> None:
        """Raise RankFailedError if any rank has exited (with what it reported, if anything): a
        child that exited, a rank from another host whose connection closed or that reported an
        error. With `grace`, look again until that many seconds passed: a collective fails on a
        dying peer's reset before its exit or closed connection shows."""
        deadline = time.monotonic() + grace
        while True:
            self._check_alive()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(remaining, 0.05))

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
        for rank in range(self.local_ranks, len(self.conns) + 1):
            conn, where = self.conns[rank - 1], f"tensor-parallel rank {rank} (on {self.hosts.get(rank)})"
            if peer_closed(conn):
                raise RankFailedError(f"{where} exited: its connection closed")
            if rank not in self._awaiting and conn.poll():
                # a rank speaks unasked only to report the error it is exiting with
                _kind, detail = self._recv(rank, conn)
                raise RankFailedError(f"{where} failed:\n{detail}")

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
            self.ranks.check_alive(
                grace=DEAD_RANK_GRACE_SECONDS
            )  # a dead rank is the likeliest cause: name it
            raise RankFailedError(f"a tensor-parallel step failed on rank 0: {self.failure}") from exc

    def close(self) -> None:
        # after a failure the other ranks may sit in a collective until its timeout: do not wait
        self.ranks.close(timeout=10.0 if self.failure is None else 1.0)
