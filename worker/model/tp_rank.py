"""A tensor-parallel rank other than 0: `python -P -m disagg.worker.model.tp_rank SPEC_JSON`.

Connects back to rank 0's control listener (key in the environment), loads its shard, builds its
runner when rank 0 says how, then runs each batch rank 0 sends until told to stop or until the
connection closes (rank 0 is gone). Errors are reported to rank 0 before exiting non-zero.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client

import torch
import torch.distributed as dist

from disagg.worker.model.loader import load_model
from disagg.worker.model.runner import ModelRunner
from disagg.worker.model.tp_executor import AUTHKEY_ENV, RENDEZVOUS_HOST, rank_tp


def serve(spec: dict) -> int:
    conn = Client(tuple(spec["control"]), authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    try:
        if spec["threads"] is not None:
            torch.set_num_threads(spec["threads"])
        timeout = timedelta(seconds=spec["timeout_s"])
        world, rank, device = spec["world_size"], spec["rank"], torch.device(spec["device"])
        store = dist.TCPStore(RENDEZVOUS_HOST, spec["store_port"], world, False, timeout=timeout)
        tp = rank_tp(spec["model"], store, rank, world, device, timeout)
        model, _ = load_model(spec["model"], dtype=spec["dtype"], device=device, tp=tp)
        runner = ModelRunner(model, **conn.recv())
        conn.send(("ready", None))
        services: dict = {}
        while True:
            message = pickle.loads(conn.recv_bytes())
            if message is None:
                _close(services)
                return 0
            if isinstance(message, tuple):
                _serve_call(conn, runner, spec["rank"], services, message)
            else:
                runner.forward(message)  # the logits are rank 0's to sample
    except EOFError:  # rank 0 is gone: nothing left to serve
        return 1
    except BaseException:
        report = traceback.format_exc()
        print(f"tensor-parallel rank {spec['rank']} failed:\n{report}", file=sys.stderr, flush=True)
        try:
            conn.send(("error", report))
        except OSError:
            pass
        return 1


def _serve_call(conn, runner, rank: int, services: dict, message: tuple) -> None:
    """("install", name, "module:factory", args) | ("call" or "post", name, method, args): a call's
    result or exception goes back to rank 0; a posted call has no answer, and raising ends the rank."""
    kind, name, target, args = message
    try:
        if kind == "install":
            module, _, attr = target.partition(":")
            services[name] = getattr(importlib.import_module(module), attr)(runner, rank, *args)
            result = None
        else:
            result = getattr(services[name], target)(*args)
    except Exception as exc:
        if kind == "post":
            raise
        try:
            reply = pickle.dumps(("raised", exc))
        except Exception:
            reply = pickle.dumps(("raised", RuntimeError(f"{type(exc).__name__}: {exc}")))
        conn.send_bytes(reply)
        return
    if kind != "post":
        conn.send(("ok", result))


def _close(services: dict) -> None:
    for service in services.values():
        close = getattr(service, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
