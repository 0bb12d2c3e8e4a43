"""`WorkerProcessArgs`: who a worker process is and how it joins its deployment (its role and id,
the addresses it binds and advertises, the Redis of the deployment), each declared once with its
default and help, like `EngineArgs`.

`disagg worker` generates these flags from the fields (`DISAGG_<FLAG>` gives a pod's default),
`WorkerConfig` takes its defaults from them, and what starts workers writes their command lines
from them: the operator through `cli_flag`, `disagg up` and the tests through `cli_args`.
Standard library only: the operator imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.worker.engine.settings import Settings, setting

# kv_state.records.ROLES, which the registry checks, names them too (a test keeps the two equal):
# importing kv_state would register its Redis gauge in the operator's /metrics
ROLES = ("prefill", "decode", "both")


@dataclass
class DeploymentArgs(Settings):
    """What every process of a deployment (worker, router) shares: its Redis, the namespace of
    its keys there, and how it logs."""

    GROUP = "deployment"

    redis_url: str | None = setting(None, "Redis of the deployment: worker registry, transfers, prefix index")
    redis_password_file: str | None = setting(
        None, "file with the Redis password (or DISAGG_REDIS_PASSWORD / DISAGG_REDIS_PASSWORD_FILE)"
    )
    deployment: str = setting("default", "namespace of the Redis keys")
    log_level: str = setting("INFO", "logging level (DEBUG, INFO, WARNING, ERROR)")


@dataclass
class WorkerProcessArgs(DeploymentArgs):
    GROUP = "worker"

    role: str = setting("both", "prefill, decode or both (colocated)", choices=ROLES)
    model_name: str | None = setting(None, "served model name (default: directory name)")
    worker_id: str | None = setting(None, "unique id (default: role-host-port)")
    host: str = setting(
        "127.0.0.1", "bind address of gRPC, /metrics and NIXL's UCX (0.0.0.0 or the pod IP to serve peers)"
    )
    # the worker command's default is $POD_IP when that is set (a pod's downward API)
    advertise_host: str = setting("127.0.0.1", "address peers and the router use to reach this worker")
    port: int = setting(0, "gRPC port (0: any free port)")
    metrics_port: int = setting(0, "/metrics and /health port")
