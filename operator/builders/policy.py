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
