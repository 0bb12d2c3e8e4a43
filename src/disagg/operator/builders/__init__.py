"""Pure builders: an InferenceDeployment in, the manifests of its children out (no I/O)."""

from __future__ import annotations

from disagg.operator.builders import (
    common,
    config,
    disruption,
    leader_worker_set,
    monitoring,
    network,
    policy,
    redis,
    router,
    service_account,
    workers,
)
from disagg.operator.settings import Settings
from disagg.operator.spec import InferenceDeployment


def hpa_children(idep: InferenceDeployment, body: dict, settings: Settings = Settings()) -> list[dict]:  # noqa: B008
    """HorizontalPodAutoscalers for roles autoscaled in `hpa` mode, built by the autoscaling package."""
    roles = [r for r in ("decode", "prefill") if (a := idep.spec.role(r).autoscaling) and a.mode == "hpa"]
    if not roles:
        return []
    try:
        from disagg.operator.autoscaling.hpa import build_hpa
    except ImportError as exc:
        raise RuntimeError(
            f"spec.{roles[0]}.autoscaling.mode is hpa, but this operator build has no HPA support "
            f"(disagg.operator.autoscaling.hpa is missing: {exc})"
        ) from exc
    return [
        build_hpa(
            idep,
            role,
            leader_worker_set.target_ref(idep, role)
            if leader_worker_set.spans_nodes(idep.spec.role(role), settings)
            else None,
        )
        for role in roles
    ]


def infrastructure(idep: InferenceDeployment, settings: Settings = Settings()) -> list[dict]:  # noqa: B008
    """Everything the worker pools need before they start, in apply order (the generated
    credentials Secret is not here: it is created once, never applied; see credential_secret)."""
    out = [
        service_account.service_account(idep),
        config.configmap(idep),
        *network.policies(idep, settings),
    ]
    if idep.spec.redis.managed:
        out += [redis.service(idep), redis.statefulset(idep, settings)]
    for role in ("decode", "prefill"):
        out += [workers.headless_service(idep, role), disruption.role_pdb(idep, role)]
    return out


def role_workload(idep: InferenceDeployment, role: str, settings: Settings = Settings()) -> dict:  # noqa: B008
    """The role's pods: a StatefulSet, or a LeaderWorkerSet when its ranks span nodes."""
    if leader_worker_set.spans_nodes(idep.spec.role(role), settings):
        return leader_worker_set.leader_worker_set(idep, role, settings)
    return workers.statefulset(idep, role)


def workload_key(idep: InferenceDeployment, role: str, settings: Settings = Settings()) -> tuple[str, str]:  # noqa: B008
    """(kind, name) of `role_workload`, without building it."""
    if leader_worker_set.spans_nodes(idep.spec.role(role), settings):
        return leader_worker_set.KIND, leader_worker_set.name(idep, role)
    return "StatefulSet", common.role_name(idep, role)


def spans_nodes(idep: InferenceDeployment, settings: Settings) -> bool:
    """Whether some role of `idep` runs as a LeaderWorkerSet."""
    return any(leader_worker_set.spans_nodes(idep.spec.role(r), settings) for r in ("decode", "prefill"))


def frontend(idep: InferenceDeployment, settings: Settings = Settings()) -> list[dict]:  # noqa: B008
    return [router.deployment(idep, settings), router.service(idep), disruption.router_pdb(idep)]


def extras(
    idep: InferenceDeployment,
    body: dict,
    service_monitor_available: bool,
    settings: Settings = Settings(),  # noqa: B008
) -> list[dict]:
    out = []
    if idep.spec.monitoring.service_monitor and service_monitor_available:
        out.append(monitoring.service_monitor(idep))
    return out + hpa_children(idep, body, settings)


def build_children(
    idep: InferenceDeployment,
    body: dict | None = None,
    *,
    service_monitor_available: bool = False,
    settings: Settings = Settings(),  # noqa: B008  (frozen)
    leader_worker_sets: bool = False,
) -> list[dict]:
    """Every child in apply order: infrastructure, decode, prefill, router, monitoring and HPAs.

    `body` is the raw InferenceDeployment object, handed to the HPA builder; `settings` are the
    operator's own (allowed host paths, its namespace, GPUs per node); `leader_worker_sets`: the
    cluster serves LeaderWorkerSets (a role spanning nodes is refused otherwise).
    """
    policy.check(idep, settings, leader_worker_sets)
    children = [
        *infrastructure(idep, settings),
        role_workload(idep, "decode", settings),
        role_workload(idep, "prefill", settings),
        *frontend(idep, settings),
        *extras(idep, body or {}, service_monitor_available, settings),
    ]
    # after the builders, so a spec that is also malformed names its more specific field first
    policy.check_kv_transfer(idep)
    return children
