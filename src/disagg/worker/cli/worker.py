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
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.process_args import WorkerProcessArgs


def add_arguments(p: argparse.ArgumentParser) -> None:
    pod_ip = os.environ.get("POD_IP")  # the downward API's, in a pod: what peers reach it at
    WorkerProcessArgs.add_cli_args(p, env=True, defaults={"advertise_host": pod_ip} if pod_ip else None)
    auth.add_cli_args(p)
    auth.add_peer_identity_arg(p)
    ServingArgs.add_cli_args(p, env=True)
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
    serving = ServingArgs.from_cli_args(args)
    if engine.tensor_parallel_size > 1 and args.role != "both" and serving.kv_transfer != "nixl":
        # each rank's process owns a transport over its part of the cache; the gRPC fallback
        # would need a KVTransfer server in every rank's process
        raise SystemExit(
            f"disagg worker: --tensor-parallel-size {engine.tensor_parallel_size} with --role {args.role} "
            f"needs --kv-transfer nixl (got --kv-transfer {serving.kv_transfer})"
        )
    # resolved here so that every later reader (KV layout, handshake, logs) sees the real values
    engine = dataclasses.replace(engine, dtype=engine.resolved_dtype(), device=engine.resolved_device())
    internal = auth.from_cli_args(args, "disagg worker")
    if internal.peer_identity == "certificate":
        from disagg.worker.serving.peer_identity import check_own_certificate

        check_own_certificate(args.grpc_tls_dir, worker_id)
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
        auth=internal,
        deployment=args.deployment,
        serving=serving,
    )


def run(args) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = config_from_args(args)
    from disagg.worker.serving.main import WorkerProcess

    return asyncio.run(WorkerProcess(cfg).run())
