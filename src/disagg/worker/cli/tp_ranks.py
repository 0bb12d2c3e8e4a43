"""`disagg tp-ranks`: tensor-parallel ranks of a worker whose rank 0 runs on another host.

A worker started with `--tensor-parallel-local-ranks L` (fewer than `--tensor-parallel-size N`)
runs ranks 0..L-1 and waits for the others. This command, on another host, starts ranks
FIRST..FIRST+COUNT-1 (one process each, on this host's GPUs 0..COUNT-1 when rank 0 runs on
CUDA), which connect to rank 0 (`--leader HOST:PORT`, the worker's `--tensor-parallel-port`),
authenticated with the deployment's internal credential, and from then on run every step rank 0
runs. It exits when they do: 0 when rank 0 stopped them, non-zero as soon as one fails or loses
rank 0 (the others are stopped), so the pod is restarted together with its worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time

from disagg.worker.cli.flags import TpRanks as F
from disagg.worker.model.tp_join import AUTHKEY_ENV, authkey_from_token
from disagg.worker.serving import auth
from disagg.worker.serving.auth import TOKEN_ENV, read_token

log = logging.getLogger("disagg.tp_ranks")
PROG = "disagg tp-ranks"
STOP_GRACE_S = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        F.LEADER, required=True, help="HOST:PORT of rank 0's control port (its --tensor-parallel-port)"
    )
    first = p.add_mutually_exclusive_group(required=True)
    first.add_argument(F.FIRST_RANK, type=int, help="the first rank this host runs (>= 1)")
    first.add_argument(F.NODE_INDEX, type=int,
                       help="this host's index in the group (1, 2, ...): the first rank is index x --count")  # fmt: skip
    p.add_argument(F.COUNT, type=int, required=True, help="ranks this host runs (one per GPU)")
    p.add_argument(F.HOST, default=os.environ.get("POD_IP", "127.0.0.1"),
                   help="this host's address: the ranks' KV transports (UCX) bind its interface "
                        "(default: $POD_IP, else 127.0.0.1)")  # fmt: skip
    p.add_argument(F.THREADS, type=int, default=None,
                   help="torch threads per rank on CPU (default: this host's cores / --count)")  # fmt: skip
    p.add_argument(F.CONNECT_TIMEOUT, type=float, default=600.0,
                   help="seconds to keep trying to reach rank 0 (it may start later)")  # fmt: skip
    auth.add_token_file_arg(p)
    p.add_argument(F.LOG_LEVEL, default="info")


def _first_rank(args) -> int:
    first = args.first_rank if args.first_rank is not None else args.node_index * args.count
    if first < 1:
        raise SystemExit(f"{PROG}: --first-rank must be >= 1 (rank 0 is the worker's), got {first}")
    return first


def _leader(value: str) -> list:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SystemExit(f"{PROG}: --leader must be HOST:PORT, got {value!r}")
    return [host.strip("[]"), int(port)]


def run(args) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.count < 1:
        raise SystemExit(f"{PROG}: --count must be >= 1, got {args.count}")
    first, control = _first_rank(args), _leader(args.leader)
    token = read_token(args.internal_token_file, PROG)
    if token is None:
        raise SystemExit(
            f"{PROG}: no internal credential: set {TOKEN_ENV} (from a Secret) or --internal-token-file; "
            "rank 0 accepts ranks from other hosts only with it"
        )
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // args.count)
    env = {**os.environ, AUTHKEY_ENV: authkey_from_token(token).hex()}
    env.pop(TOKEN_ENV, None)  # the ranks need the derived key only
    procs = {}
    for i in range(args.count):
        spec = dict(control=control, rank=first + i, device_index=i, threads=threads, host=args.host,
                    connect_timeout_s=args.connect_timeout)  # fmt: skip
        cmd = [sys.executable, "-m", "disagg.worker.model.tp_rank", json.dumps(spec)]
        procs[first + i] = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
    log.info(
        "started tensor-parallel ranks %d..%d for rank 0 at %s", first, first + args.count - 1, args.leader
    )
    return supervise(procs)


def _die_with_parent() -> None:
    """In the rank's process before it runs: the kernel kills it when this command dies, however
    it dies, so no rank outlives its host's supervisor holding rank 0's group."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def supervise(procs: dict[int, subprocess.Popen]) -> int:
    """Wait for the ranks: the first that exits non-zero (or a SIGTERM) stops the others and
    gives this command's exit code; 0 once all stopped cleanly."""
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(143))
    running = dict(procs)
    while running and not stopping:
        for rank, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[rank]
            if code != 0:
                log.error("tensor-parallel rank %d exited with code %d; stopping the others", rank, code)
                stopping.append(code)
                break
        time.sleep(0.2)
    for proc in running.values():
        proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in running.values():
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return stopping[0] if stopping else 0
