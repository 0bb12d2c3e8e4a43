"""Settings a resource may ask for only where the operator's installer allows them."""

from __future__ import annotations

from disagg.operator.builders import leader_worker_set as lws
from disagg.operator.settings import Settings
from disagg.operator.spec import InferenceDeployment, SpecError


def check(idep: InferenceDeployment, settings: Settings, leader_worker_sets: bool = False) -> None:
    check_placeable(idep, settings, leader_worker_sets)
    src = idep.spec.model.source
    if src.kind == "hostPath" and not settings.host_path_allowed(src.path):
        allowed = ", ".join(settings.host_path_prefixes)
        raise SpecError(
            "spec.model.source.hostPath.path",
            f"{src.path!r} is not allowed: "
            + (
                f"this operator mounts host paths only under {allowed}"
                if allowed
                else "this operator mounts no host paths (its installer enables them with "
                "--allow-host-path PREFIX); use a PVC"
            ),
        )


def check_placeable(idep: InferenceDeployment, settings: Settings, leader_worker_sets: bool) -> None:
    """A GPU role with more ranks than a node gives a pod runs as a LeaderWorkerSet: only where the
    cluster serves that API, and scaled by its replicas or an HPA (the operator's own autoscaler
    scales StatefulSets)."""
    for role in (idep.spec.prefill, idep.spec.decode):
        if not lws.spans_nodes(role, settings):
            continue
        tp = role.tensor_parallel_size
        if not leader_worker_sets:
            raise SpecError(
                f"spec.{role.name}.tensorParallelSize",
                f"is {tp}, but a node gives a pod at most {settings.gpus_per_node} GPUs (the operator's "
                f"--gpus-per-node): workers spanning nodes run as a LeaderWorkerSet, and this cluster does not "
                f"serve {lws.API_VERSION} {lws.PLURAL} (install LeaderWorkerSet, kubernetes-sigs/lws)",
            )
        lws.group_size(role, settings)
        if role.autoscaling is not None and role.autoscaling.mode == "operator":
            raise SpecError(
                f"spec.{role.name}.autoscaling.mode",
                f"is operator, but spec.{role.name}.tensorParallelSize {tp} spans nodes (a LeaderWorkerSet): "
                "autoscale it with mode hpa, which scales the LeaderWorkerSet's groups",
            )


def check_kv_transfer(idep: InferenceDeployment) -> None:
    """Every rank of a tensor-parallel prefill or decode worker moves its own KV heads over its own
    NIXL agent; the gRPC fallback serves one cache per worker, so the worker refuses it with more
    than one rank."""
    if idep.spec.kv_transfer.backend == "nixl":
        return
    for role in (idep.spec.prefill, idep.spec.decode):
        if role.tensor_parallel_size > 1:
            raise SpecError(
                "spec.kvTransfer.backend",
                f"is {idep.spec.kv_transfer.backend!r}, but spec.{role.name}.tensorParallelSize is "
                f"{role.tensor_parallel_size}: KV moves between tensor-parallel workers over nixl only",
            )
