"""The status an InferenceDeployment shows, computed from its children as they are (pure).

Ready is True only when every role (decode, prefill, router) runs its current template on all
desired replicas and all of them pass readiness: a rollout in flight is Progressing, never Ready.
The autoscaler's `status.<role>.autoscaling` is not touched here (it is merged, not replaced).
"""

from __future__ import annotations

import datetime

from disagg.operator.pod_health import PodProblem
from disagg.operator.rollout import applied_hash, generation_seen, rolled_out

WORKLOADS = ("decode", "prefill", "router")
MAX_PODS_NAMED = 5  # a condition message stays readable in `kubectl describe`


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def role_status(observed: dict | None) -> dict:
    spec = (observed or {}).get("spec") or {}
    status = (observed or {}).get("status") or {}
    replicas = spec.get("replicas", 1) if observed else 0
    ready = status.get("readyReplicas", 0)
    return {
        "ready": f"{ready}/{replicas}",
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": status.get("updatedReplicas", 0),
    }


def _condition(
    ctype: str, ok: bool, reason: str, message: str, generation: int, previous: list[dict], timestamp: str
) -> dict:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == ctype), None)
    # Keep the transition time while the status holds, so an unchanged world yields an unchanged status.
    since = (
        before["lastTransitionTime"]
        if before and before.get("status") == status and before.get("lastTransitionTime")
        else timestamp
    )
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def compute(
    *,
    generation: int,
    endpoint: str,
    desired: dict[str, dict],
    observed: dict[str, dict | None],
    held: list[str],
    problem: tuple[str, str] | None = None,
    redis_observed: dict | None = None,
    redis_managed: bool = False,
    previous: list[dict] | None = None,
    timestamp: str | None = None,
    pod_problems: tuple[PodProblem, ...] | list[PodProblem] = (),
) -> dict:
    """Status for one reconcile.

    desired/observed: per workload ("decode", "prefill", "router"), the stamped manifest and the
    live object. held: names of children held back by the rollout order. problem: (reason,
    message) when the spec is invalid or applying failed. pod_problems: what keeps pods from
    serving (`pod_health`), most urgent first: the Degraded condition names them.
    """
    previous = previous or []
    timestamp = timestamp or now()
    out = {"observedGeneration": generation, "endpoint": endpoint}
    for name in WORKLOADS:
        out[name] = role_status(observed.get(name))

    pending = [
        n for n in WORKLOADS if desired.get(n) is not None and not rolled_out(desired[n], observed.get(n))
    ]
    missing = [n for n in WORKLOADS if observed.get(n) is None]
    stale = [
        n
        for n in WORKLOADS
        if observed.get(n) is not None
        and desired.get(n) is not None
        and not _template_current(desired[n], observed[n])
    ]
    unready = [
        n
        for n in WORKLOADS
        if observed.get(n) is not None and n not in stale and out[n]["readyReplicas"] < out[n]["replicas"]
    ]
    redis_down = redis_managed and ((redis_observed or {}).get("status") or {}).get("readyReplicas", 0) < 1

    if problem is not None:
        ready = (False, problem[0], problem[1])
    elif pending:
        ready = (False, "RolloutInProgress", f"not yet ready on their current template: {', '.join(pending)}")
    else:
        ready = (True, "AllReplicasReady", "every role's updated replicas are ready")

    if problem is not None and problem[0] == "InvalidSpec":
        # Nothing is built from a spec that cannot be read: no rollout is under way.
        progressing = (False, "InvalidSpec", "nothing rolls out until the spec is valid")
    elif missing or stale or held:
        parts = [f"creating {', '.join(missing)}"] if missing else []
        parts += [f"updating {', '.join(stale)}"] if stale else []
        parts += held
        progressing = (True, "WaitingForDecode" if held else "RollingOut", "; ".join(parts))
    elif unready:
        progressing = (True, "PodsStarting", f"waiting for ready pods: {', '.join(unready)}")
    else:
        progressing = (False, "RolloutComplete", "nothing to roll out")

    if problem is not None:
        degraded = (True, problem[0], problem[1])
    elif pod_problems:
        degraded = (True, pod_problems[0].reason, pods_message(pod_problems))
    elif redis_down and not missing:
        degraded = (True, "RedisUnavailable", "the managed Redis has no ready pod")
    else:
        degraded = (False, "AsExpected", "no problem found")

    out["conditions"] = [
        _condition(ctype, *values, generation=generation, previous=previous, timestamp=timestamp)
        for ctype, values in (("Ready", ready), ("Progressing", progressing), ("Degraded", degraded))
    ]
    return out


def pods_message(found) -> str:
    named = "; ".join(p.describe() for p in found[:MAX_PODS_NAMED])
    more = len(found) - MAX_PODS_NAMED
    return named + (f"; and {more} more" if more > 0 else "")


def _template_current(desired: dict, observed: dict) -> bool:
    status = observed.get("status") or {}
    replicas = (observed.get("spec") or {}).get("replicas", 1)
    return (
        applied_hash(observed) == applied_hash(desired)
        and generation_seen(observed)
        and status.get("updatedReplicas", 0) >= replicas
    )


def changed(current: dict, new: dict) -> bool:
    """Whether writing `new` would change the object's status (the autoscaler's keys ignored)."""
    for key, value in new.items():
        have = current.get(key)
        if isinstance(value, dict) and isinstance(have, dict):
            if any(have.get(k) != v for k, v in value.items()):
                return True
        elif have != value:
            return True
    return False
