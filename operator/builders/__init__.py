"""Pure builders: an InferenceDeployment in, the manifests of its children out (no I/O)."""

from __future__ import annotations

from disagg.operator.builders import (
    config,
    disruption,
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


def hpa_children(idep: InferenceDeployment, body: dict) -> list[dict]:
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
    return [build_hpa(idep, role) for role in roles]


def infrastructure(idep: InferenceDeployment, settings: Settings = Settings()) -> list[dict]:  # noqa: B008
    """Everything the worker pools need before they start, in apply order (the generated
    credentials Secret is not here: it is created once, never applied; see credential_secret)."""
    out = [
        service_account.service_account(idep),
        config.configmap(idep),
        *network.policies(idep, settings),
    ]
    if idep.spec.redis.managed:
        out += [redis.service(idep), redis.statefulset(idep)]
    for role in ("decode", "prefill"):
        out += [workers.headless_service(idep, role), disruption.role_pdb(idep, role)]
    return out


def role_statefulset(idep: InferenceDeployment, role: str) -> dict:
    return workers.statefulset(idep, role)


def frontend(idep: InferenceDeployment) -> list[dict]:
    return [router.deployment(idep), router.service(idep), disruption.router_pdb(idep)]


def extras(idep: InferenceDeployment, body: dict, service_monitor_available: bool) -> list[dict]:
    out = []
    if idep.spec.monitoring.service_monitor and service_monitor_available:
        out.append(monitoring.service_monitor(idep))
    return out + hpa_children(idep, body)


def build_children(
    idep: InferenceDeployment,
    body: dict | None = None,
    *,
    service_monitor_available: bool = False,
    settings: Settings = Settings(),  # noqa: B008  (frozen)
) -> list[dict]:
    """Every child in apply order: infrastructure, decode, prefill, router, monitoring and HPAs.

    `body` is the raw InferenceDeployment object, handed to the HPA builder; `settings` are the
    operator's own (allowed host paths, its namespace).
    """
    policy.check(idep, settings)
    children = [
        *infrastructure(idep, settings),
        role_statefulset(idep, "decode"),
        role_statefulset(idep, "prefill"),
        *frontend(idep),
        *extras(idep, body or {}, service_monitor_available),
    ]
    # after the builders, so a spec that is also malformed names its more specific field first
    policy.check_kv_transfer(idep)
    return children
