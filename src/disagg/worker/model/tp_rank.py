"""A tensor-parallel rank other than 0: `python -P -m disagg.worker.model.tp_rank SPEC_JSON`.

Started by rank 0 (its children) or by `disagg tp-ranks` on another host. SPEC_JSON says where
rank 0 listens (`control`), which rank this is, the GPU it uses (`device_index`), its threads and
the host it runs on; the key is in the environment. It joins rank 0 (`tp_join`), which answers
with what the group shares, loads its shard, builds its runner when rank 0 says how, then runs
each batch rank 0 sends until told to stop or until the connection closes (rank 0 is gone).
Errors are reported to rank 0 before exiting non-zero.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from disagg.worker.model.loader import load_model
from disagg.worker.model.runner import ModelRunner
from disagg.worker.model.tp_executor import rank_tp
from disagg.worker.model.tp_join import AUTHKEY_ENV, GroupSpec, connect


def device_of(group: GroupSpec, device_index: int | None) -> torch.device:
    if group.device_type == "cuda":
        return torch.device("cuda", device_index or 0)
    return torch.device(group.device_type)


def serve(spec: dict) -> int:
    host, port = spec["control"]
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    rank = spec["rank"]
    try:
        conn = connect((host, port), authkey, spec["connect_timeout_s"])
    except (ConnectionError, OSError) as exc:
        print(f"tensor-parallel rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        conn.send(("join", rank, spec.get("host")))
        kind, answer = conn.recv()
        if kind != "group":
            print(f"tensor-parallel rank {rank}: rank 0 refused it: {answer}", file=sys.stderr, flush=True)
            return 1
        group = GroupSpec(**answer)
        if spec["threads"] is not None:
            torch.set_num_threads(spec["threads"])
        timeout = timedelta(seconds=group.timeout_s)
        world, device = group.world_size, device_of(group, spec.get("device_index"))
        # the store is on rank 0's host: the address this rank reached rank 0 at
        store = dist.TCPStore(host, group.store_port, world, False, timeout=timeout)
        tp = rank_tp(group.model, store, rank, world, device, timeout)
        model, _ = load_model(group.model, dtype=group.dtype, device=device, tp=tp)
        runner = ModelRunner(model, **conn.recv())
        conn.send(("ready", None))
        services: dict = {}
        while True:
            message = pickle.loads(conn.recv_bytes())
            if message is None:
                _close(services)
                return 0
            if isinstance(message, tuple):
                _serve_call(conn, runner, rank, services, message)
            else:
                runner.forward(message)  # the logits are rank 0's to sample
    except EOFError:  # rank 0 is gone: nothing left to serve
        print(f"tensor-parallel rank {rank}: rank 0 closed the connection", file=sys.stderr, flush=True)
        return 1
    except BaseException:
        report = traceback.format_exc()
        print(f"tensor-parallel rank {rank} failed:\n{report}", file=sys.stderr, flush=True)
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
