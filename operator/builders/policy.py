"""Settings a resource may ask for only where the operator's installer allows them."""

from __future__ import annotations

from disagg.operator.builders.workers import device
from disagg.operator.settings import Settings
from disagg.operator.spec import InferenceDeployment, SpecError


def check(idep: InferenceDeployment, settings: Settings) -> None:
    check_placeable(idep, settings)
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


def check_placeable(idep: InferenceDeployment, settings: Settings) -> None:
    """A worker's ranks share one pod, so a GPU role's tensorParallelSize must fit one node."""
    for role in (idep.spec.prefill, idep.spec.decode):
        tp = role.tensor_parallel_size
        if device(role) == "cuda" and tp > settings.gpus_per_node:
            raise SpecError(
                f"spec.{role.name}.tensorParallelSize",
                f"is {tp}, but a node gives a pod at most {settings.gpus_per_node} GPUs (the operator's "
                "--gpus-per-node) and workers spanning nodes (LeaderWorkerSet) are not supported",
            )


def check_kv_transfer(idep: InferenceDeployment) -> None:
    """Prefill and decode workers move KV from one cache to another; a tensor-parallel worker's
    cache is split over its ranks' processes, which the KV transports do not read or write yet, so
    the worker refuses those roles with more than one rank (it serves them colocated only)."""
    for role in (idep.spec.prefill, idep.spec.decode):
        if role.tensor_parallel_size > 1:
            raise SpecError(
                f"spec.{role.name}.tensorParallelSize",
                f"is {role.tensor_parallel_size}, but KV transfer between tensor-parallel workers is "
                "not supported yet (the worker shards models only when serving colocated); set 1",
            )
