"""A role whose ranks span nodes: one LeaderWorkerSet (kubernetes-sigs/lws) instead of a StatefulSet.

A GPU role with more tensor-parallel ranks than a node gives one pod (`--gpus-per-node`) runs
each replica as a group of `size` pods, `ranks / size` ranks (and GPUs) each:

- the leader pod is the worker (`disagg worker`, rank 0 and the next ranks of its node), told to
  wait for the others on its tensor-parallel port (`--tensor-parallel-local-ranks`);
- every other pod runs `disagg tp-ranks`, pointed at its leader through the variables the LWS
  controller sets in its pods: LWS_LEADER_ADDRESS (the leader's DNS name) and LWS_WORKER_INDEX
  (1..size-1: the pod's first rank is index x ranks per pod);
- `RecreateGroupOnPodRestart`: a rank that fails takes its whole group down and back up (a group
  cannot continue without one of its ranks).

Both templates carry the role's labels (the NetworkPolicies, the headless Service and the
PodDisruptionBudget select them as they select StatefulSet pods), the same hardening, and the
internal credential by secretKeyRef, which authenticates the ranks' control connection. The LWS
is named apart from the role's StatefulSet and Service (`<deployment>-<role>-lws`): the LWS
controller makes a StatefulSet and a Service of the LWS's own name.
"""

from __future__ import annotations

from disagg.operator.builders import common, hardening, model, secrets, workers
from disagg.operator.settings import Settings
from disagg.operator.spec import InferenceDeployment, Role, SpecError
from disagg.worker.cli.flags import TpRanks
from disagg.worker.engine.args import cli_flag, default

GROUP = "leaderworkerset.x-k8s.io"
API_VERSION = f"{GROUP}/v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
# The leader's tensor-parallel control port (the rendezvous store listens on the next one).
TP_PORT = default("tensor_parallel_port")


def spans_nodes(role: Role, settings: Settings) -> bool:
    """A GPU role with more ranks than one pod may hold GPUs."""
    return workers.device(role) == "cuda" and role.tensor_parallel_size > settings.gpus_per_node


def group_size(role: Role, settings: Settings) -> int:
    """Pods per group: the fewest that fit the ranks, each holding the same number of ranks."""
    tp, per_node = role.tensor_parallel_size, settings.gpus_per_node
    size = -(-tp // per_node)
    if tp % size:
        raise SpecError(
            f"spec.{role.name}.tensorParallelSize",
            f"is {tp}: it spans {size} nodes of {per_node} GPUs (the operator's --gpus-per-node), and the "
            f"ranks must split evenly over them (a multiple of {size})",
        )
    return size


def name(idep: InferenceDeployment, role_name: str) -> str:
    return f"{common.role_name(idep, role_name)}-lws"


def target_ref(idep: InferenceDeployment, role_name: str) -> dict:
    """The LWS as a scale target (an HPA's `scaleTargetRef`)."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name(idep, role_name)}


def _follower_container(idep: InferenceDeployment, role: Role, pod_ranks: int) -> dict:
    """`disagg tp-ranks`: this pod's ranks, joining the group's leader."""
    leader = workers.worker_container(idep, role, pod_ranks)
    redis_env = {e["name"] for e in secrets.redis_password_env(idep)}
    args = [
        "tp-ranks",
        TpRanks.LEADER,
        f"$(LWS_LEADER_ADDRESS):{TP_PORT}",
        TpRanks.NODE_INDEX,
        "$(LWS_WORKER_INDEX)",
        TpRanks.COUNT,
        str(pod_ranks),
        TpRanks.HOST,
        "$(POD_IP)",
    ]
    container = {
        "name": "ranks",
        "image": leader["image"],
        "imagePullPolicy": leader["imagePullPolicy"],
        "command": ["disagg"],
        "args": args,
        # the worker's variables but the Redis password: these ranks never reach Redis
        "env": [e for e in workers.env(idep, role) if e["name"] not in redis_env],
        "volumeMounts": [
            model.mount(idep),
            {"name": workers.SHM_VOLUME, "mountPath": "/dev/shm"},
            *hardening.scratch_mounts(cache=True),
        ],
        "securityContext": workers.container_security(idep),
    }
    if "resources" in leader:
        container["resources"] = leader["resources"]
    return container


def leader_worker_set(idep: InferenceDeployment, role_name: str, settings: Settings) -> dict:
    role = idep.spec.role(role_name)
    size = group_size(role, settings)
    pod_ranks = role.tensor_parallel_size // size
    workers.check_supported(idep, role)
    extra = (
        cli_flag("tensor_parallel_local_ranks"),
        str(pod_ranks),
        cli_flag("tensor_parallel_port"),
        str(TP_PORT),
    )
    leader = workers.worker_container(idep, role, pod_ranks, extra)
    leader["ports"] += [
        {"name": "tp-control", "containerPort": TP_PORT, "protocol": "TCP"},
        {"name": "tp-store", "containerPort": TP_PORT + 1, "protocol": "TCP"},
    ]
    follower = _follower_container(idep, role, pod_ranks)
    lws_spec = {
        "leaderWorkerTemplate": {
            "size": size,
            # one lost rank stops its group: recreate every pod of the group together
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": workers.pod_template(
                idep, role_name, workers.pod_spec(idep, role, leader, pod_ranks)
            ),
            "workerTemplate": workers.pod_template(
                idep, role_name, workers.pod_spec(idep, role, follower, pod_ranks)
            ),
        },
    }
    replicas = workers.desired_replicas(idep, role)
    if replicas is not None:
        lws_spec = {"replicas": replicas, **lws_spec}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": common.metadata(idep, name(idep, role_name), role_name),
        "spec": lws_spec,
    }
