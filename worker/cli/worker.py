"""`disagg worker`: one prefill, decode or colocated worker (flags, or DISAGG_* environment)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
from pathlib import Path

from disagg.worker.engine.args import EngineArgs
from disagg.worker.kv_state.link import redis_password
from disagg.worker.serving import auth

ROLES = ("prefill", "decode", "both")


def _env(name: str, default=None):
    return os.environ.get(f"DISAGG_{name}", default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--role", choices=ROLES, default=_env("ROLE", "both"), help="prefill, decode or both (colocated)"
    )
    p.add_argument(
        "--model-name", default=_env("MODEL_NAME"), help="served model name (default: directory name)"
    )
    p.add_argument("--worker-id", default=_env("WORKER_ID"), help="unique id (default: role-host-port)")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"),
                   help="bind address of gRPC, /metrics and NIXL's UCX (0.0.0.0 or the pod IP to serve peers)")  # fmt: skip
    p.add_argument("--advertise-host", default=_env("ADVERTISE_HOST", os.environ.get("POD_IP", "127.0.0.1")),
                   help="address peers and the router use to reach this worker")  # fmt: skip
    p.add_argument("--port", type=int, default=int(_env("PORT", 0)), help="gRPC port (0: any free port)")
    p.add_argument(
        "--metrics-port", type=int, default=int(_env("METRICS_PORT", 0)), help="/metrics and /health port"
    )
    p.add_argument(
        "--redis-url", default=_env("REDIS_URL"), help="Redis for registry, transfers, prefix index"
    )
    p.add_argument("--redis-password-file", default=None,
                   help="file with the Redis password (or DISAGG_REDIS_PASSWORD / DISAGG_REDIS_PASSWORD_FILE)")  # fmt: skip
    p.add_argument("--deployment", default=_env("DEPLOYMENT", "default"), help="namespace of the Redis keys")
    p.add_argument("--kv-transfer", choices=("nixl", "grpc"), default=_env("KV_TRANSFER", "nixl"))
    p.add_argument("--disagg-threshold", type=int, default=int(_env("THRESHOLD", 64)),
                   help="decode workers prefill locally when fewer prompt tokens than this are uncached")  # fmt: skip
    p.add_argument("--prefill-placement", choices=("load", "threshold"), default=_env("PREFILL_PLACEMENT", "load"),
                   help="load: a decode worker prefills where the first token comes sooner (protecting its "
                        "running streams); threshold: every prompt with --disagg-threshold uncached tokens "
                        "goes to a prefill worker")  # fmt: skip
    p.add_argument("--disagg-busy-slack", type=float, default=float(_env("DISAGG_BUSY_SLACK", 2.0)),
                   help="with load placement, a decoding worker sends a prompt to a prefill worker unless "
                        "that delays its first token more than this factor over a local prefill")  # fmt: skip
    p.add_argument("--lease-seconds", type=float, default=float(_env("LEASE_SECONDS", 30)),
                   help="lease of a KV transfer record; a dead peer's blocks are reclaimed after it")  # fmt: skip
    p.add_argument("--prefill-timeout", type=float, default=float(_env("PREFILL_TIMEOUT", 120)))
    p.add_argument("--drain-timeout", type=float, default=float(_env("DRAIN_TIMEOUT", 30)),
                   help="longest wait for in-flight streams when draining (/drain, then SIGTERM share it)")  # fmt: skip
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    auth.add_cli_args(p)
    EngineArgs.add_cli_args(p, env=True)


def _password(args) -> str | None:
    try:
        return redis_password(args.redis_password_file)
    except ValueError as e:
        raise SystemExit(f"disagg: {e}") from None


def config_from_args(args):
    from disagg.worker.model.gguf_checkpoint import served_name
    from disagg.worker.serving.main import WorkerConfig

    if not args.model:
        raise SystemExit("disagg worker: --model (or DISAGG_MODEL) is required")
    model_dir = Path(args.model)
    if not model_dir.exists():  # a checkpoint directory or a GGUF file
        raise SystemExit(f"disagg worker: --model {args.model}: no such file or directory")
    worker_id = args.worker_id or f"{args.role}-{socket.gethostname()}-{args.port or os.getpid()}"
    engine = EngineArgs.from_cli_args(args, model=str(model_dir))
    if engine.tensor_parallel_size > 1 and args.role != "both" and args.kv_transfer != "nixl":
        # each rank's process owns a transport over its part of the cache; the gRPC fallback
        # would need a KVTransfer server in every rank's process
        raise SystemExit(
            f"disagg worker: --tensor-parallel-size {engine.tensor_parallel_size} with --role {args.role} "
            f"needs --kv-transfer nixl (got --kv-transfer {args.kv_transfer})"
        )
    # resolved here so that every later reader (KV layout, handshake, logs) sees the real values
    engine = dataclasses.replace(engine, dtype=engine.resolved_dtype(), device=engine.resolved_device())
    return WorkerConfig(
        engine=engine,
        role=args.role,
        worker_id=worker_id,
        model_name=args.model_name or served_name(model_dir),
        host=args.host,
        advertise_host=args.advertise_host,
        port=args.port,
        metrics_port=args.metrics_port,
        redis_url=args.redis_url,
        redis_password=_password(args),
        auth=auth.from_cli_args(args, "disagg worker"),
        deployment=args.deployment,
        kv_transfer=args.kv_transfer,
        disagg_threshold=args.disagg_threshold,
        prefill_placement=args.prefill_placement,
        disagg_busy_slack=args.disagg_busy_slack,
        lease_seconds=args.lease_seconds,
        prefill_timeout=args.prefill_timeout,
        drain_timeout=args.drain_timeout,
    )


def run(args) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = config_from_args(args)
    from disagg.worker.serving.main import WorkerProcess

    return asyncio.run(WorkerProcess(cfg).run())
