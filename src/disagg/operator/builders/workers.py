"""Prefill and decode workers: one StatefulSet and one headless Service per role.

Role identity (the worker's role flag, the `disagg.dev/role` label, the `DISAGG_ROLE` variable) is set
here and nowhere else; user-supplied env may not override it.
"""

from __future__ import annotations

import posixpath

from disagg.operator import constants as c
from disagg.operator import footprints
from disagg.operator.builders import common, config, hardening, model, secrets
from disagg.operator.spec import InferenceDeployment, Role, SpecError, quantity_bytes
from disagg.worker.cli.flags import Drain
from disagg.worker.engine.args import cli_flag
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.process_args import WorkerProcessArgs

GPU = "nvidia.com/gpu"
SHM_VOLUME = "dshm"
# /dev/shm per tensor-parallel rank: NCCL's intra-pod transport keeps its buffers
# there (a memory-backed emptyDir counts against the pod's memory limit, so it is bounded).
SHM_PER_RANK = 1  # GiB
# Of a pod's termination grace period, what the worker keeps for deregistering and stopping after
# its in-flight streams have drained (at most this, at most a third of the period).
STOP_MARGIN_SECONDS = 10
# The worker's probe and preStop endpoints, all on the port named "metrics".
HEALTH_PATH = "/health"  # 200 once loaded and registered, 503 while loading or draining
LIVE_PATH = "/live"  # 200 while the process and its engine loop run, draining included
DRAIN_PATH = "/drain"  # stops admitting; answers once in-flight streams are done
# The KV cache's disk tier: its volume, where the worker finds it, and the share of the volume the
# tier fills (an emptyDir over its sizeLimit gets the pod evicted).
KV_DISK_VOLUME = "kv-disk"
KV_DISK_MOUNT = "/var/cache/disagg-kv"
KV_DISK_FILL = 0.9
# The interface the servers bind: the pod's own (they default to loopback outside a pod).
BIND_ALL = "0.0.0.0"


def drain_timeout(grace_seconds: int) -> float:
    """The worker's `--drain-timeout`: the grace period less a margin to stop after draining."""
    return grace_seconds - min(STOP_MARGIN_SECONDS, grace_seconds / 3)


def device(role: Role) -> str:
    """`cuda` when the role asks for NVIDIA GPUs, else `cpu`."""
    for section in ("limits", "requests"):
        count = (role.resources.get(section) or {}).get(GPU)
        if count is not None and str(count) != "0":
            return "cuda"
    return "cpu"


def check_supported(idep: InferenceDeployment, role: Role) -> None:
    """Settings the CRD admits but this worker cannot run: refused with the field named."""
    prefill, decode = idep.spec.prefill.block_size, idep.spec.decode.block_size
    if prefill != decode:
        # KV blocks move from prefill to decode workers as they are, and the router hashes prompts
        # into blocks of this size for the prefix index: one size for the whole deployment.
        raise SpecError(
            "spec.prefill.kvCache.blockSize",
            f"must equal spec.decode.kvCache.blockSize ({prefill} != {decode})",
        )
    if role.kv_host_bytes is not None and role.tensor_parallel_size > 1:
        raise SpecError(
            f"spec.{role.name}.kvCache.host", "is not supported with tensorParallelSize above 1 yet"
        )
    limit = (role.resources.get("limits") or {}).get("memory")
    if role.kv_host_bytes is not None and limit is not None:
        limit_bytes = quantity_bytes(limit, f"spec.{role.name}.resources.limits.memory")
        if role.kv_host_bytes >= limit_bytes:
            raise SpecError(
                f"spec.{role.name}.kvCache.host.memory",
                f"must be below resources.limits.memory ({limit}): the tier lives in the pod's memory",
            )


def desired_replicas(idep: InferenceDeployment, role: Role) -> int | None:
    """The StatefulSet's replica count: `replicas`, or for an autoscaled role the count it is
    created with (the autoscaler's last decision in the status, else minReplicas).

    An autoscaled role's count is applied only when the StatefulSet is created; the reconciler
    leaves it out afterwards (see `disagg.operator.replicas`), so this never fights the autoscaler.
    """
    auto = role.autoscaling
    if auto is None:
        return role.replicas
    desired = idep.autoscaler_desired.get(role.name, auto.min_replicas)
    return max(auto.min_replicas, min(auto.max_replicas, desired))


def resources_of(idep: InferenceDeployment, role: Role, pod_ranks: int | None = None) -> dict:
    """The container's resources; `pod_ranks`: the ranks this pod runs (all of them by default;
    fewer when the role's ranks span several pods, see `leader_worker_set`)."""
    path = f"spec.{role.name}.resources"
    requests = dict(role.resources.get("requests") or {})
    limits = dict(role.resources.get("limits") or {})
    tp = role.tensor_parallel_size
    ranks = tp if pod_ranks is None else pod_ranks
    per_pod = "" if ranks == tp else f" (tensorParallelSize {tp} over {tp // ranks} pods)"
    if GPU in limits and str(limits[GPU]).isdigit() and int(limits[GPU]) < ranks:
        raise SpecError(
            f"{path}.limits.{GPU}",
            f"{ranks} ranks per pod{per_pod} need at least that many GPUs, got {limits[GPU]}",
        )
    if tp > 1 and device(role) == "cuda":
        # one GPU per rank, all in this pod: an extended resource's request equals its limit
        count = int(limits.get(GPU) or requests.get(GPU))
        if count != ranks:
            raise SpecError(
                f"{path}.limits.{GPU}",
                f"must equal the {ranks} ranks per pod{per_pod} (one GPU per rank), got {count}",
            )
        requests[GPU] = limits[GPU] = ranks
    rdma = idep.spec.kv_transfer
    if rdma.rdma_count > 0:
        requests[rdma.rdma_resource] = rdma.rdma_count
        limits[rdma.rdma_resource] = rdma.rdma_count
    out = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _args(idep: InferenceDeployment, role: Role) -> list[str]:
    spec = idep.spec
    process = WorkerProcessArgs.cli_flag
    args = [
        "worker",
        process("role"),
        role.name,
        cli_flag("model"),
        model.model_dir(idep),
        process("model_name"),
        spec.model.name,
        # $(VAR) is expanded by the kubelet from the container's env (the downward API values).
        process("worker_id"),
        "$(POD_NAME)",
        process("host"),
        BIND_ALL,
        process("advertise_host"),
        "$(POD_IP)",
        process("port"),
        str(c.WORKER_GRPC_PORT),
        process("metrics_port"),
        str(c.WORKER_METRICS_PORT),
        process("redis_url"),
        common.redis_url(idep),
        process("deployment"),
        idep.deployment_id,
        ServingArgs.cli_flag("kv_transfer"),
        spec.kv_transfer.backend,
        cli_flag("block_size"),
        str(role.block_size),
        cli_flag("gpu_memory_utilization"),
        str(role.memory_fraction),
        cli_flag("device"),
        device(role),
        cli_flag("dtype"),
        spec.model.dtype,
        cli_flag("quantization"),
        spec.model.quantization,
        cli_flag("kv_cache_dtype"),
        spec.model.kv_cache_dtype,
        ServingArgs.cli_flag("drain_timeout"),
        f"{drain_timeout(role.termination_grace_seconds):g}",
    ]
    if role.name == "decode":  # decode workers decide where their prompts are prefilled
        args += [ServingArgs.cli_flag("prefill_placement"), spec.kv_transfer.prefill_placement,
                 ServingArgs.cli_flag("disagg_threshold"), str(spec.kv_transfer.disagg_threshold)]  # fmt: skip
    if spec.model.max_model_length is not None:
        args += [cli_flag("max_model_len"), str(spec.model.max_model_length)]
    if role.kv_host_bytes is not None:
        args += [cli_flag("kv_host_cache_memory"), str(role.kv_host_bytes)]
    if role.kv_disk is not None:
        args += [cli_flag("kv_disk_cache_dir"), KV_DISK_MOUNT,
                 cli_flag("kv_disk_cache_size"), str(int(role.kv_disk.size_bytes * KV_DISK_FILL))]  # fmt: skip
    if role.tensor_parallel_size > 1:  # the worker starts its other ranks itself, in this pod
        args += [cli_flag("tensor_parallel_size"), str(role.tensor_parallel_size)]
    if spec.speculative is not None and role.name == "decode":  # prefill workers never decode
        spec_args = spec.speculative
        args += [cli_flag("speculative_method"), spec_args.method,
                 cli_flag("num_speculative_tokens"), str(spec_args.num_tokens)]  # fmt: skip
        if spec_args.draft_path:
            draft = posixpath.normpath(posixpath.join(c.MODEL_MOUNT, spec_args.draft_path.lstrip("/")))
            args += [cli_flag("speculative_draft_model"), draft]
    return args


def check_memory_limit(role: Role) -> None:
    """A CPU worker's KV cache and weights live in the pod's memory: without a limit the worker
    would size from the node's memory and the pod be killed by the node, not by its own bound."""
    if device(role) == "cpu" and not (role.resources.get("limits") or {}).get("memory"):
        raise SpecError(
            f"spec.{role.name}.resources.limits.memory",
            "is required on CPU: the worker sizes its KV cache from the pod's memory limit",
        )


def prestop_command(role: Role) -> list[str]:
    """`disagg drain` inside the pod: /drain needs the internal credential, which a kubelet httpGet
    hook cannot send; the command reads it from the container's environment like the worker."""
    return [
        "disagg",
        "drain",
        Drain.URL,
        f"http://127.0.0.1:{c.WORKER_METRICS_PORT}{DRAIN_PATH}",
        Drain.TIMEOUT,
        str(role.termination_grace_seconds),
    ]


def env(idep: InferenceDeployment, role: Role) -> list[dict]:
    for i, item in enumerate(role.env):
        if item["name"] in common.RESERVED_ENV:
            raise SpecError(f"spec.{role.name}.env[{i}].name", f"{item['name']} is set by the operator")
    env = [
        {"name": "DISAGG_ROLE", "value": role.name},
        {"name": "DISAGG_DEPLOYMENT", "value": idep.deployment_id},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *secrets.serving_env(idep),
        *secrets.worker_identity_env(idep),
        *hardening.scratch_env(cache=True),
    ]
    transports = idep.spec.kv_transfer.ucx_transports
    if transports:
        env.append({"name": "UCX_TLS", "value": ",".join(transports)})
    return env + [dict(item) for item in role.env]


def container_security(idep: InferenceDeployment) -> dict:
    security = hardening.container()
    if idep.spec.kv_transfer.rdma_count > 0:
        # RDMA registers (pins) memory, which needs IPC_LOCK (beyond `restricted`: see docs/security.md).
        security["capabilities"] = {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    return security


def worker_container(
    idep: InferenceDeployment, role: Role, pod_ranks: int | None = None, extra_args: tuple[str, ...] = ()
) -> dict:
    """The `disagg worker` container; `pod_ranks`: the ranks it runs itself (see `resources`)."""
    spec = idep.spec
    security = container_security(idep)
    resources = resources_of(idep, role, pod_ranks)
    http_health = {"path": HEALTH_PATH, "port": "metrics"}
    http_live = {"path": LIVE_PATH, "port": "metrics"}
    container = {
        "name": "worker",
        "image": spec.image.ref,
        "imagePullPolicy": spec.image.pull_policy,
        "command": ["disagg"],
        "args": [*_args(idep, role), *extra_args],
        "env": env(idep, role),
        "envFrom": [{"configMapRef": {"name": common.config_name(idep)}}],
        "ports": [
            {"name": "grpc", "containerPort": c.WORKER_GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": c.WORKER_METRICS_PORT, "protocol": "TCP"},
        ],
        # Loading weights can take minutes; the startup probe covers it so liveness can stay strict.
        "startupProbe": {"httpGet": http_health, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {"httpGet": http_health, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": http_live, "periodSeconds": 10, "failureThreshold": 6},
        # Drain: stop admitting work and return once in-flight requests have finished (bounded by
        # --drain-timeout, which is shorter than the grace period); SIGTERM follows the hook.
        "lifecycle": {"preStop": {"exec": {"command": prestop_command(role)}}},
        "volumeMounts": [
            model.mount(idep),
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
            *hardening.scratch_mounts(cache=True),
            *secrets.tls_mounts(idep),
            *([{"name": KV_DISK_VOLUME, "mountPath": KV_DISK_MOUNT}] if role.kv_disk is not None else []),
        ],
        "securityContext": security,
    }
    if resources:
        container["resources"] = resources
    return container


def shm_volume(role: Role, pod_ranks: int | None = None) -> dict:
    """/dev/shm: unbounded for one rank (UCX's shared-memory transport), bounded and sized by the
    rank count (of this pod) for a tensor-parallel worker."""
    empty_dir = {"medium": "Memory"}
    if role.tensor_parallel_size > 1:
        ranks = role.tensor_parallel_size if pod_ranks is None else pod_ranks
        empty_dir["sizeLimit"] = f"{ranks * SHM_PER_RANK}Gi"
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def pod_spec(idep: InferenceDeployment, role: Role, container: dict, pod_ranks: int | None = None) -> dict:
    """A worker pod of `role` around `container`: hardening, model volume, shared memory, placement."""
    spec = idep.spec
    out = {
        "serviceAccountName": common.service_account_name(idep),
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": role.termination_grace_seconds,
        "securityContext": hardening.pod(),
        "initContainers": [
            {**init, "resources": footprints.for_init_container(container.get("resources") or {})}
            for init in model.init_containers(idep)
        ],
        "containers": [container],
        "volumes": [
            model.volume(idep),
            # NCCL and UCX shared-memory transports need more than the container runtime's 64 MiB /dev/shm.
            shm_volume(role, pod_ranks),
            *hardening.scratch_volumes(cache=True),
            *secrets.tls_volumes(idep),
        ],
    }
    disk = role.kv_disk
    if disk is not None and disk.storage_class is None:  # with a class, the StatefulSet claims one per pod
        out["volumes"].append({"name": KV_DISK_VOLUME, "emptyDir": {"sizeLimit": disk.size}})
    if not out["initContainers"]:
        del out["initContainers"]
    if spec.image.pull_secrets:
        out["imagePullSecrets"] = common.pull_secrets(idep)
    if role.node_selector:
        out["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        out["tolerations"] = [dict(t) for t in role.tolerations]
    if role.affinity:
        out["affinity"] = role.affinity
    if role.priority_class:
        out["priorityClassName"] = role.priority_class
    return out


def pod_template(idep: InferenceDeployment, role_name: str, spec: dict) -> dict:
    return {
        "metadata": {
            "labels": common.labels(idep, role_name),
            "annotations": {
                "disagg.dev/model": idep.spec.model.name,
                config.CONFIG_HASH_ANNOTATION: config.config_hash(idep),
            },
        },
        "spec": spec,
    }


def statefulset(idep: InferenceDeployment, role_name: str) -> dict:
    role = idep.spec.role(role_name)
    name = common.role_name(idep, role_name)
    container = worker_container(idep, role)
    check_supported(idep, role)
    check_memory_limit(role)
    sts_spec = {
        "serviceName": name,
        # Workers do not depend on each other's start order.
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": common.selector_labels(idep, role_name)},
        "updateStrategy": {"type": "RollingUpdate"},
        "template": pod_template(idep, role_name, pod_spec(idep, role, container)),
    }
    replicas = desired_replicas(idep, role)
    if replicas is not None:
        sts_spec = {"replicas": replicas, **sts_spec}
    if role.kv_disk is not None and role.kv_disk.storage_class is not None:
        sts_spec["volumeClaimTemplates"] = [kv_disk_claim(role)]
        # the claims go with the pods: a scaled-down or deleted role leaves no volumes behind
        sts_spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Delete"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": common.metadata(idep, name, role_name),
        "spec": sts_spec,
    }


def kv_disk_claim(role: Role) -> dict:
    """Each pod's claim for the KV disk tier (a StatefulSet volumeClaimTemplate)."""
    disk = role.kv_disk
    return {
        "metadata": {"name": KV_DISK_VOLUME},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": disk.storage_class,
            "resources": {"requests": {"storage": disk.size}},
        },
    }


def headless_service(idep: InferenceDeployment, role_name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": common.metadata(idep, common.role_name(idep, role_name), role_name),
        "spec": {
            "clusterIP": "None",
            "selector": common.selector_labels(idep, role_name),
            "ports": [
                {"name": "grpc", "port": c.WORKER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": c.WORKER_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }
